"""Benchmark (issue #7, Scale): the planner on very long models, within its time limit and 4 GB.

Cases: ``gpt2_100b`` (GPT-2, n_embd 4096, 500 blocks: 504 layers, 101B parameters) and
``gpt2_1200l`` (1196 blocks of n_embd 2048, 16 heads: 1200 layers), both built by
harmony_opt.measure.synthetic from gpt2_xl's measured profile; minibatch 64, vPP, 4 GPUs of the
paper's server (1080ti-x4, 10 GiB cap), the CP-SAT planner with ``--time-limit``.

Each case runs in a fresh child process, so its peak resident memory (``ru_maxrss`` from
``os.wait4``) is the planner's alone: profile construction, Harmony's search (the warm
start), the CP-SAT models and the simulator. A case passes when the plan is valid (it
checks against the profile and hardware, and the simulator plays it within the memory
cap), the search takes at most the time limit plus ``SLACK`` (the limit bounds the solver;
the rest of the search must stay small), and the peak memory is under 4 GB.

    python benchmarks/bench_scale.py [--time-limit 10,60] [--only gpt2_100b]

Writes ``benchmarks/results/scale.csv`` and ``.md``; exits 1 when a case fails.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent

log = logging.getLogger("bench_scale")

BATCH, GPUS, MODE = 64, 4, "vPP"
MEMORY_LIMIT_BYTES = 4 * 10**9
#: seconds a search may run past its time limit (the limit is the solver's; setup must stay small)
SLACK = 0.10
SLACK_S = 5.0


def shapes():
    from harmony_opt.measure.synthetic import GPT2_SCALING, GPT2Shape
    return {"gpt2_100b": GPT2_SCALING["gpt2_100b"], "gpt2_1200l": GPT2Shape(n_layer=1196, n_embd=2048, n_head=16)}


def child(name: str, time_limit: float) -> dict:
    """Plan one case in this process and report what the parent needs (one JSON line)."""
    from harmony_opt.core.hardware import scaling_hardware
    from harmony_opt.sim.simulator import simulate
    from harmony_opt.measure.synthetic import gpt2_profile
    from harmony_opt.solver_models.planner import PlannerOptions, plan
    shape = shapes()[name]
    t0 = time.perf_counter()
    profile = gpt2_profile(shape, name=name)
    build_s = time.perf_counter() - t0
    hw = scaling_hardware()        # the paper's server with the host memory these models need
    t0 = time.perf_counter()
    p = plan(profile, hw, BATCH, PlannerOptions(mode=MODE, gpus=GPUS, time_limit=time_limit))
    search_s = time.perf_counter() - t0
    p.check_against(profile, hw)
    tl = simulate(p, profile, hw)
    peak = max(tl.peak_memory().values())
    s = p.solver or {}
    return {"model": name, "layers": profile.num_layers, "params_B": round(shape.parameters() / 1e9, 1),
            "time_limit_s": time_limit, "profile_build_s": round(build_s, 2), "search_s": round(search_s, 2),
            "status": s.get("status"), "iteration_s": round(tl.iteration_time, 4),
            "harmony_time_s": s.get("harmony_time_s"), "lower_bound_s": s.get("lower_bound_s"),
            "packs_fwd": len(p.packs_fwd), "packs_bwd": len(p.packs_bwd),
            "peak_gpu_GiB": round(peak / 2**30, 2), "valid": bool(peak <= hw.gpu_memory_bytes)}


def run_case(name: str, time_limit: float) -> dict:
    cmd = [sys.executable, __file__, "--child", name, "--time-limit", str(time_limit)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.returncode = os.waitstatus_to_exitcode(status)
    rss = int(usage.ru_maxrss) * 1024          # Linux reports KiB
    if proc.returncode != 0:
        row = {"model": name, "time_limit_s": time_limit, "valid": False,
               "error": (err.strip().splitlines() or ["?"])[-1][:200]}
    else:
        row = json.loads(out.strip().splitlines()[-1])
    row.update(process_wall_s=round(wall, 2), peak_rss_GB=round(rss / 1e9, 3))
    in_time = row.get("search_s") is not None and row["search_s"] <= time_limit * (1 + SLACK) + SLACK_S
    row["within_time_limit"] = bool(in_time)
    row["under_4GB"] = rss < MEMORY_LIMIT_BYTES
    row["pass"] = bool(row["valid"] and in_time and row["under_4GB"])
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", default="10,60", help="comma-separated time limits (s), each case runs under each")
    ap.add_argument("--only", default=None, help="one case: " + ", ".join(shapes()))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    limits = [float(x) for x in str(args.time_limit).split(",")]
    if args.child:
        print(json.dumps(child(args.child, limits[0])))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from harmony_opt.core.io import atomic_write_text
    from harmony_opt.report import machine_description, markdown_table
    rows = []
    for limit in limits:
        for name in shapes():
            if args.only and name != args.only:
                continue
            row = run_case(name, limit)
            log.info("%s: search %s s (limit %g s), peak RSS %.2f GB, %s", name, row.get("search_s"), limit,
                     row["peak_rss_GB"], "pass" if row["pass"] else "FAIL " + row.get("error", ""))
            rows.append(row)
    df = pd.DataFrame(rows)
    out = ROOT / "benchmarks" / "results"
    atomic_write_text(out / "scale.csv", df.to_csv(index=False))
    note = (f"\nThe CP-SAT planner on synthetic GPT-2 profiles (harmony_opt.measure.synthetic), D = {BATCH}, {MODE}, "
            f"{GPUS} GPUs, 1080ti-x4 (10 GiB cap) with 2 TiB of host memory, time limits {args.time_limit} s. search_s: wall time of "
            f"`plan()` (Harmony's search for the warm start included); pass = valid plan, search_s <= limit x "
            f"{1 + SLACK:g} + {SLACK_S:g} s, peak RSS of the planner process < 4 GB.\n\n"
            f"Machine: {machine_description()}\n")
    atomic_write_text(out / "scale.md", "# Planner scale benchmark\n\n" + markdown_table(df) + note)
    log.info("wrote %s and %s", out / "scale.csv", out / "scale.md")
    return 0 if df["pass"].all() else 1


if __name__ == "__main__":
    sys.exit(main())
