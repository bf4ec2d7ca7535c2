"""Benchmark: what deciding the order of the swaps inside their streams could gain on the planner's plans.

Harmony fixes the order of the transfers in each stream by rule (weights in task order, each
microbatch's input one ahead, outputs as they are made), and so do our compiler, executor and
simulator unless a plan carries its own (``Plan.transfer_order``). The timeline model
(solver_models/event_schedule.py) bounds what any other order could gain and, with ``order="free"`` or
``"carried"``, searches for one. For the planner's plan of each of the benchmark's 12 distinct
full-space cases (bench_planner.py: D = 64 on 4 GPUs, D = 32 on 2; at D = 32 both modes give the
same plan), in Harmony's order (``planner_streams``: the streams whose order the planner's plan
carried, where its budget left room for step 7; the columns below are about the rule's order):

* ``simulated_s``: the plan's simulated iteration time (the simulator's greedy dispatch, the rule's order);
* ``fixed_*``: the timeline model with the rule's order (CP-SAT's schedule and bound), ``dispatch_gain``
  = 1 - fixed / simulated, what dispatching the same order otherwise than the simulator's greedy rule gains;
* ``order_bound_s``: the floor over every order of the transfers (``TimelineResult.order_bound_s``),
  ``order_gap`` = 1 - order_bound / simulated, the most any order and dispatch could gain;
* ``free_*``: the timeline model with the order free (``NoOverlap`` per transfer stream), hinted with
  the fixed model's schedule: its best schedule, its bound (over every order), ``order_gain`` = 1 - free / fixed,
  what the order itself gained, and ``moved``, the transfers it runs in another place of their stream;
* ``proven_order_gap`` = 1 - max(order_bound, free_bound) / simulated: the most any order and dispatch
  can gain, with the tighter of the two bounds;
* ``carried_*``: the planner's step 7 without its budget: the timeline model with the order free in the
  streams a plan can carry (``order="carried"``), hinted with the fixed model's schedule, its best
  schedule, the streams its order changes (``ordered_streams``), the simulated time of the plan carrying
  that order (``carried_simulated_s``) and ``carried_gain`` = 1 - carried_simulated / simulated (the planner
  keeps an order only where it is > 0).

    python benchmarks/bench_swap_order.py [--plan-limit 10] [--time-limit 10] [--only vgg416]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent

from harmony_opt.core.bundled import load_profile
from harmony_opt.core.hardware import get_hardware
from harmony_opt.core.io import atomic_write_text
from harmony_opt.report import machine_description, markdown_table
from harmony_opt.sim.simulator import simulate
from harmony_opt.solver_models.planner import PlannerOptions, plan
from harmony_opt.solver_models.event_schedule import solve_timeline

GiB = 2**30
MODELS = ("bert_large", "bert_96", "gpt2_medium", "gpt2_xl", "vgg416", "resnet1026")


def cases():
    for batch, gpus in ((64, 4), (32, 2)):
        for m in MODELS:
            yield m, batch, gpus, int(9e9 if batch == 64 and m in ("bert_96", "gpt2_xl") else 10 * GiB)


def run_case(model, batch, gpus, cap, plan_limit, time_limit) -> dict:
    profile = load_profile(model)
    hw = get_hardware("1080ti-x4").with_gpus(gpus)
    planned = plan(profile, hw, batch, PlannerOptions(time_limit=plan_limit, uneven=True, processes=2),
                   memory_cap=cap)
    p = planned.replace(transfer_order=None)
    sim = simulate(p, profile, hw, with_timeline=False).iteration_time
    fixed = solve_timeline(p, profile, hw, time_limit=time_limit)
    t0 = time.perf_counter()
    free = solve_timeline(p, profile, hw, time_limit=time_limit, order="free", hint=fixed.starts)
    free_wall = time.perf_counter() - t0
    carried = solve_timeline(p, profile, hw, time_limit=time_limit, order="carried", hint=fixed.starts)
    order = carried.order
    carried_sim = sim if order is None else \
        simulate(p.replace(transfer_order=order), profile, hw, with_timeline=False).iteration_time
    return {
        "model": model, "batch": batch, "gpus": gpus, "configuration": p.solver["configuration"]["configuration"],
        "events": fixed.events, "simulated_s": sim,
        "fixed_objective_s": fixed.makespan_s, "fixed_bound_s": fixed.bound_s,
        "dispatch_gain": 1 - fixed.makespan_s / sim,
        "order_bound_s": fixed.order_bound_s, "order_gap": 1 - fixed.order_bound_s / sim,
        "free_status": free.status, "free_objective_s": free.makespan_s, "free_bound_s": free.bound_s,
        "order_gain": 1 - free.makespan_s / fixed.makespan_s,
        "moved": free.moved, "free_wall_s": free_wall,
        "proven_order_gap": 1 - max(fixed.order_bound_s, free.bound_s) / sim,
        "carried_objective_s": carried.makespan_s, "ordered_streams": len(order or ()),
        "carried_simulated_s": carried_sim, "carried_gain": 1 - carried_sim / sim,
        "planner_streams": len(planned.transfer_order or ()),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plan-limit", type=float, default=10.0, help="the planner's time limit per case (s)")
    ap.add_argument("--time-limit", type=float, default=10.0, help="each timeline model's limit (s)")
    ap.add_argument("--only", help="comma-separated model names")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    if only and not only <= set(MODELS):
        ap.error(f"--only {args.only}: give model names among {', '.join(MODELS)}")
    if args.plan_limit <= 0 or args.time_limit <= 0:
        ap.error("--plan-limit and --time-limit must be > 0 seconds")
    rows = []
    for m, batch, gpus, cap in cases():
        if only and m not in only:
            continue
        r = run_case(m, batch, gpus, cap, args.plan_limit, args.time_limit)
        rows.append(r)
        print(f"{m:12s} D={batch} x{gpus}: {r['events']:5d} events, simulated {r['simulated_s']:.4f} s, "
              f"rule's order {r['fixed_objective_s']:.4f} s, order free {r['free_objective_s']:.4f} s "
              f"({r['order_gain']:.2%} faster, {r['moved']} moved, {r['free_wall_s']:.1f} s), order bound "
              f"{r['order_bound_s']:.4f} s, proven gap {r['proven_order_gap']:.2%}; carried order simulated "
              f"{r['carried_simulated_s']:.4f} s ({r['carried_gain']:.2%})", flush=True)
    df = pd.DataFrame(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "swap_order.csv", df.to_csv(index=False))
    cmd = (f"python benchmarks/bench_swap_order.py --plan-limit {args.plan_limit:g} --time-limit {args.time_limit:g}"
           + (f" --only {args.only}" if args.only else ""))
    text = (
        "# What another order of the swaps could gain\n\n"
        f"Command: `{cmd}`; every column in `swap_order.csv`. Machine: {machine_description()}.\n\n"
        + __doc__.split("\n\n", 1)[1].rsplit("\n\n", 1)[0] + "\n\n"
        + markdown_table(df.drop(columns=["configuration"]), floatfmt=".6g") + "\n\n"
        f"- Most any order and dispatch can gain (proven_order_gap): median "
        f"{statistics.median(df.proven_order_gap):.2%}, largest {df.proven_order_gap.max():.2%}.\n"
        f"- Gained by dispatching the rule's order otherwise (dispatch_gain): median "
        f"{statistics.median(df.dispatch_gain):.2%}, largest {df.dispatch_gain.max():.2%}.\n"
        f"- Gained by the order itself in {args.time_limit:g} s (order_gain): median "
        f"{statistics.median(df.order_gain):.2%}, largest {df.order_gain.max():.2%}; cases where a transfer moved: "
        f"{int((df.moved > 0).sum())}/{len(df)}.\n"
        f"- The order a plan can carry, played by the simulator (carried_gain): faster in "
        f"{int((df.carried_gain > 0).sum())}/{len(df)} (largest {df.carried_gain.max():.2%}), slower in "
        f"{int((df.carried_gain < 0).sum())}/{len(df)}; the planner's plan carried an order in "
        f"{int((df.planner_streams > 0).sum())}/{len(df)}.\n")
    atomic_write_text(out / "swap_order.md", text)
    print(f"wrote {out / 'swap_order.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
