"""Benchmark: does every plan that fits on paper fit at run time?

For each built-in tiny model, profiled here on the CPU (as ``harmony-opt profile`` does), each
cap from the least feasible one (the largest single layer's backward at microbatch 1) upward,
and each planner (our CP-SAT planner, Harmony's search judged by our simulator and by Harmony's
own, naive swapping, L2L, ZeRO-Offload), it plans, compiles against the model's real tensor
sizes, validates the program under the cap and trains ``--steps`` steps under the cap. Columns:

* ``result``: ``ok`` (trained), ``infeasible`` (the planner refused the request with the figures)
  or ``refused`` (a returned plan the compiler or the executor refused: the failure this guards);
* ``predicted_peak``: the program's peak live device bytes from the profile's sizes
  (harmony_opt.compile.program_memory.program_memory), ``measured_peak``: the executor's memory guard's peak of
  live device bytes over the run, ``ratio`` = predicted / measured;
* ``task_peak``: the simulator's peak of its task memory (Harmony's pack memory, workspace included).

    python benchmarks/bench_memory.py [--models gpt2-tiny,bert-tiny] [--steps 2] [--out benchmarks/results]
"""
from __future__ import annotations

import argparse
import contextlib
import io
import time
from pathlib import Path

import pandas as pd
import torch

from harmony_opt.planners.registry import get_planner
from harmony_opt.core.errors import HarmonyOptError, InfeasibleError
from harmony_opt.core.hardware import Hardware
from harmony_opt.core.io import atomic_write_text
from harmony_opt.compile.program_memory import program_memory
from harmony_opt.measure.models import build_model
from harmony_opt.measure.profiler import profile_model
from harmony_opt.sim.simulator import simulate
from harmony_opt.training import train

MODELS = ("gpt2-tiny", "bert-tiny", "vgg-tiny", "resnet-tiny")
FACTORS = (1.0, 1.25, 1.5, 2.0, 3.0, 5.0)
PLANNERS = ("cp-sat", "harmony", "harmony/harmony-cost", "naive-swap", "l2l", "zero-offload")
BATCH = 8
HARDWARE = Hardware(name="cpu-bench", gpus=1, gpu_memory_bytes=2**30, host_memory_bytes=8 * 2**30,
                    pinned_memory_bytes=4 * 2**30, h2d_bandwidth=6e9, d2h_bandwidth=6e9, shared_host_link=True,
                    link_bandwidth=6e9, p2p_bandwidth=0.0, host_copy_bandwidth=6e9, cpu_optimizer_scale=1.0,
                    gpu_optimizer_bandwidth=1e10)


def make_plan(planner: str, prof, cap: int, time_limit: float):
    """``planner`` from the registry; "harmony/harmony-cost" is Harmony's search under its own cost model."""
    name, _, variant = planner.partition("/")
    kw = {"time_limit": time_limit, "processes": 1} if name == "cp-sat" else {}
    if variant == "harmony-cost":
        kw.update(mode="vPP", cost_model="harmony")
    return get_planner(name)(prof, HARDWARE, BATCH, cap, **kw)


def run(models, steps: int, time_limit: float) -> pd.DataFrame:
    rows = []
    for name in models:
        torch.manual_seed(0)
        prof = profile_model(build_model(name), [1, 2, 4, 8], "cpu", progress=False)
        least = int(max(prof.costs("BWD", 1).pack_memory(l, l) for l in range(prof.num_layers)))
        for f in FACTORS:
            cap = int(least * f)
            for planner in PLANNERS:
                row = {"model": name, "cap": cap, "cap_factor": f, "planner": planner}
                try:
                    with contextlib.redirect_stdout(io.StringIO()):
                        p = make_plan(planner, prof, cap, time_limit)
                except InfeasibleError as e:
                    rows.append({**row, "result": "infeasible", "note": str(e).split(";")[0][:120]})
                    continue
                row["task_peak"] = max(simulate(p.replace(cost_model="default"), prof, HARDWARE,
                                                with_timeline=False).meta["peak_memory"].values())
                row["predicted_peak"] = max(program_memory(p, prof, cap).peaks)
                try:
                    res = train(build_model(name), p, steps=steps, progress=False, memory_cap=cap)
                except HarmonyOptError as e:
                    rows.append({**row, "result": "refused", "note": str(e).splitlines()[0][:160]})
                    print(rows[-1], flush=True)
                    continue
                row["measured_peak"] = max(res.peak_device_bytes)
                row["ratio"] = row["predicted_peak"] / row["measured_peak"]
                rows.append({**row, "result": "ok"})
        print(f"{name}: {sum(r['model'] == name for r in rows)} cases", flush=True)
    return pd.DataFrame(rows)


def report(df: pd.DataFrame, command: str, seconds: float) -> str:
    ok = df[df.result == "ok"]
    counts = df.groupby(["planner", "result"]).size().unstack(fill_value=0)
    lines = [
        "# Plans that fit on paper, at run time", "",
        f"`{command}` ({seconds:.0f} s, this project's 2-core CPU machine; the device is the CPU).", "",
        f"**{(df.result == 'refused').sum()} of {len(df)} plans refused at run time**; "
        f"{len(ok)} trained, {(df.result == 'infeasible').sum()} requests refused by the planner with the figures.", "",
        f"Predicted (program from the profile's sizes) over measured (the executor's guard) peak of live "
        f"device bytes: min {ok.ratio.min():.3f}, median {ok.ratio.median():.3f}, max {ok.ratio.max():.3f}; "
        f"within 5 %: {(abs(ok.ratio - 1) <= 0.05).sum()} of {len(ok)}; never below 1 (the guard never stops a "
        f"validated plan): {(ok.ratio >= 1).all()}.", "",
        "```", counts.to_string(), "```", "",
        "Per model, predicted / measured peak:", "",
        "```", ok.groupby("model").ratio.agg(["min", "median", "max"]).round(3).to_string(), "```", "",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=2.0, help="work seconds per CP-SAT plan")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    t0 = time.perf_counter()
    df = run(models, args.steps, args.time_limit)
    out = Path(args.out)
    atomic_write_text(out / "memory.csv", df.to_csv(index=False))
    command = "python benchmarks/bench_memory.py" + ("" if argv is None else " " + " ".join(argv))
    atomic_write_text(out / "memory.md", report(df, command, time.perf_counter() - t0))
    print((out / "memory.md").read_text())


if __name__ == "__main__":
    main()
