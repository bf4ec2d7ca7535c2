"""Benchmark: how far from the model's optimum is the vPP plan, proven with time to spare?

``plan --time-limit 10`` reports a gap per configuration from ``bounds.vpp_bound``, which is loose at
the starts of a large criterion pack (benchmarks/results/vpp_starts.md). This benchmark plans a
Table 1 case with vPP fixed on 4 GPUs, then proves, for every start of the criterion pack whose
cheap bound lies below 98 % of the plan's model value, that every shape of plans of that start
(numbers of forward and backward packs) needs at least that much, or finds what the shape needs
(``solver_models/vpp_exact.py``: CP-SAT on the recurrence with the shape fixed, one process per
shape). The least over the starts of the larger of the two bounds is a valid bound on every plan
of the configuration, and its gap to the plan what a longer search could still gain there.

    OMP_NUM_THREADS=1 python benchmarks/bench_vpp_exact.py --processes 2   # writes benchmarks/results/vpp_exact.{csv,md}

Models of up to ``vpp_exact.MAX_LAYERS`` layers only (every pack a candidate); the number of shapes
grows with the square of the layers, so the default runs the two of 28 layers.
"""
from __future__ import annotations

import argparse
import math
import multiprocessing
import sys
import time
from pathlib import Path

import pandas as pd

from bench_vpp_starts import table1_vpp
from harmony_opt.core.bundled import load_profile
from harmony_opt.core.errors import HarmonyOptError
from harmony_opt.core.io import check_writable, write_results
from harmony_opt.report import machine_description, markdown_table
from harmony_opt.solver_models import bounds, vpp_exact

MODELS = ("bert_large", "gpt2_medium")
#: the share of the plan's model value to prove every plan needs: a gap of at most 2 %
SHARE = 0.98

_TASKS = None


def _shape(args):
    s, f, b, target, limit = args
    t0 = time.process_time()
    r = vpp_exact.shape_bound(_TASKS, s, f, b, target, limit)
    return s, r, time.process_time() - t0


def run_case(model: str, processes: int, limit: float) -> tuple[list[dict], dict]:
    global _TASKS
    p, cfg, S, stash = table1_vpp(model)
    profile, hw, cap = S.profile, S.hw, S.cap
    _TASKS = tasks = S.tasks(cfg, stash=stash)
    vpp_exact.check_exact(tasks)
    fits, cheap = bounds.vpp_bound(profile, hw, 64, cfg, cap, stash, None, per_start=True)
    objective = p.solver["objective"]
    target = math.ceil(SHARE * objective * tasks.ticks_per_s)
    todo = [int(s) for s, v in zip(fits, cheap) if v * tasks.ticks_per_s < target]
    jobs = [(s, f, b, target, limit) for s in todo for f, b in vpp_exact.shapes(tasks, s)]
    print(f"{model}: {cfg}, plan {objective:.4f} s, target {target / tasks.ticks_per_s:.4f} s, starts {todo}, "
          f"{len(jobs)} shapes", flush=True)
    per: dict[int, list] = {s: [] for s in todo}
    with multiprocessing.get_context("fork").Pool(processes) as pool:
        for k, (s, r, cpu) in enumerate(pool.imap_unordered(_shape, jobs, chunksize=4)):
            per[s].append((r, cpu))
            if (k + 1) % 100 == 0:
                print(f"  {k + 1}/{len(jobs)} shapes", flush=True)
    rows = []
    for s, c in zip(fits.tolist(), cheap.tolist()):
        got = per.get(s)
        exact = min(r.bound for r, _ in got) / tasks.ticks_per_s if got else None
        rows.append(dict(model=model, config=f"u={cfg.u_fwd}/{cfg.u_bwd}", start=s, cheap_bound_s=c,
                         shapes=len(got) if got else 0,
                         unproven=sum(not r.proven for r, _ in got) if got else 0,
                         exact_bound_s=exact, bound_s=max(c, exact) if got else c,
                         cpu_s=sum(t for _, t in got) if got else 0.0))
    df = pd.DataFrame(rows)
    proven = float(df.bound_s.min())
    summary = dict(model=model, config=str(cfg), objective_s=objective, simulated_s=p.simulated_iteration_time_s,
                   planner_bound_s=p.solver["configuration"]["bound"], planner_gap=p.solver["configuration"]["gap"],
                   target_s=target / tasks.ticks_per_s, proven_bound_s=proven, proven_gap=(objective - proven) / objective,
                   shapes=int(df.shapes.sum()), unproven=int(df.unproven.sum()), cpu_s=float(df.cpu_s.sum()))
    return rows, summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated bundled profiles (at most "
                                                                  f"{vpp_exact.MAX_LAYERS} layers)")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--limit", type=float, default=5.0, help="CP-SAT's deterministic seconds per shape")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "vpp_exact"))
    a = ap.parse_args(argv)
    if a.processes < 1 or not a.limit > 0:
        ap.error(f"--processes {a.processes} --limit {a.limit:g}: give at least one process and a positive limit")
    for model in a.models.split(","):       # one line now, not a traceback after a 10 s plan
        try:
            layers = load_profile(model).num_layers
        except HarmonyOptError as e:
            ap.error(f"--models: {e}")
        if layers > vpp_exact.MAX_LAYERS:
            ap.error(f"--models: {model} has {layers} layers; the shape bounds need every pack as a candidate, "
                     f"so at most {vpp_exact.MAX_LAYERS}")
    try:
        check_writable(Path(a.out).with_suffix(".md"))
    except HarmonyOptError as e:
        ap.error(f"--out {a.out}: {e}")
    t0 = time.perf_counter()
    rows, summaries = [], []
    for model in a.models.split(","):
        r, s = run_case(model, a.processes, a.limit)
        rows += r
        summaries.append(s)
        print(s, flush=True)
    df, sm = pd.DataFrame(rows), pd.DataFrame(summaries)
    page = (f"# The vPP gap, proven per shape\n\n"
            f"Command: `OMP_NUM_THREADS=1 python benchmarks/bench_vpp_exact.py --models {a.models} --processes "
            f"{a.processes} --limit {a.limit:g}` ({time.perf_counter() - t0:.0f} s). Machine: {machine_description()}. "
            f"D = 64, vPP fixed on 4 GPUs of 1080ti-x4, the configuration `plan --time-limit 10` chooses. "
            f"`planner_gap`: the gap `plan` reports (`bounds.vpp_bound`); `proven_gap`: against the least over the "
            f"criterion starts of the larger of that start's cheap bound and the least over its shapes of what "
            f"`vpp_exact.shape_bound` proves, up to {SHARE:g} of the plan's model value (`target_s`); `unproven`: "
            f"shapes whose solve ran out of time (the larger of CP-SAT's bound and the LP relaxation's counted); `cpu_s`: the proofs' CPU seconds.\n\n"
            f"{markdown_table(sm, floatfmt='.4f')}\n\n## Per start\n\n{markdown_table(df, floatfmt='.4f')}\n")
    write_results(a.out, df, page)
    print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
