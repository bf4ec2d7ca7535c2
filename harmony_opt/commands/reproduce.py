"""`harmony-opt reproduce {table1,compare,scaling,servers,all}`: regenerate experiments/results/.

A thin layer over harmony_opt.reproduce; experiments/*.py call the same entry point.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

from ..core.errors import UsageError

EXPERIMENTS = ("table1", "compare", "scaling", "servers", "all")
#: the planner's time limit per search (work seconds, docs/planner.md section 4) without --time-limit
DEFAULT_TIME_LIMITS = {"table1": 20.0, "compare": 5.0, "scaling": 35.0, "servers": 10.0}


def register(sub):
    p = sub.add_parser("reproduce", help="regenerate the experiments' tables and figures")
    p.add_argument("experiment", choices=EXPERIMENTS, help="which experiment (all: every one, in one go)")
    p.add_argument("--out", default=None, help="results folder (default: experiments/results)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="the planner's time limit per search, work seconds (default: table1 20, compare 5, scaling 35, "
                        "servers 10)")
    p.add_argument("--models", default=None, help="comma list of models to restrict to (default: all)")
    p.add_argument("--batches", default=None, help="compare: comma list of minibatch sizes (default 16,64,256)")
    p.add_argument("--gpus", default=None, help="compare: comma list of GPU counts (default 1,2,4)")
    p.add_argument("--jobs", type=int, default=2, help="compare: worker processes (default 2)")
    p.add_argument("--baseline-budget", type=int, default=None,
                   help="compare: skip naive-swap and l2l where minibatch x layers exceeds this (default 0: never)")
    p.set_defaults(func=_reproduce)


def _ints(text, name):
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--{name} {text!r}: give whole numbers separated by commas") from None


def _reproduce(args):
    from .. import reproduce as R
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    out = Path(args.out) if args.out else R.RESULTS_DIR
    models = [m.strip() for m in args.models.split(",")] if args.models else None
    if args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {args.jobs}")
    which = ("table1", "scaling", "servers", "compare") if args.experiment == "all" else (args.experiment,)
    limit = {k: args.time_limit or v for k, v in DEFAULT_TIME_LIMITS.items()}
    timings = {}
    written = []
    load_before = os.getloadavg()
    for exp in which:
        t0 = time.perf_counter()
        if exp == "table1":
            df = R.table1(limit["table1"], models)
            written += R.write_table1(df, out, limit["table1"])
            print(R.markdown_table(df[R.TABLE1_PRINT]))
        elif exp == "scaling":
            names = [m for m in R.SCALING_MODELS if not models or m in models] or list(R.SCALING_MODELS)
            df = R.scaling(limit["scaling"], names)
            written += R.write_scaling(df, out, limit["scaling"])
        elif exp == "servers":
            df = R.two_servers(limit["servers"])
            written += R.write_two_servers(df, out, limit["servers"])
        else:
            budget = R.BASELINE_BUDGET if args.baseline_budget is None else args.baseline_budget
            compare_models = [m for m in (models or R.bundled_names()) if m in R.bundled_names()]
            if not compare_models:
                raise UsageError(f"--models {args.models!r}: none is a bundled profile ({', '.join(R.bundled_names())})")
            cells = R.compare_cells(compare_models,
                                    _ints(args.batches, "batches") if args.batches else R.COMPARE_BATCHES,
                                    _ints(args.gpus, "gpus") if args.gpus else R.COMPARE_GPUS,
                                    time_limit=limit["compare"], baseline_budget=budget)
            df, timelines = R.compare(cells, jobs=args.jobs)
            written += R.write_compare(df, timelines, out, limit["compare"], budget)
        timings[exp] = time.perf_counter() - t0
    for p in written:
        print(f"wrote {p}")
    total = sum(timings.values())
    print("time: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + f"; total {total:.0f} s")
    if args.experiment == "all":
        from ..core.io import atomic_write_text
        print(f"wrote {atomic_write_text(out / 'run_time.md', run_time_report(timings, load_before, limit, args.jobs))}")
    return 0


def run_time_report(timings: dict[str, float], load_before: tuple[float, float, float], limits: dict[str, float],
                    jobs: int) -> str:
    """run_time.md: wall time per experiment, the machine, and how busy it was (load averages)."""
    from .. import reproduce as R
    total = sum(timings.values())
    lines = [f"| {k} | {v:.0f} |" for k, v in timings.items()]
    load_after = os.getloadavg()
    return ("# Run time of `harmony-opt reproduce all`\n\n| experiment | wall time (s) |\n|---|---|\n"
            + "\n".join(lines) + f"\n| total | {total:.0f} |\n\n"
            f"Planner time limits (work seconds): {', '.join(f'{k} {v:g}' for k, v in limits.items())}; compare "
            f"with {jobs} worker processes. Load average (1, 5, 15 min) before the "
            f"run: {', '.join(f'{x:.2f}' for x in load_before)}; after: {', '.join(f'{x:.2f}' for x in load_after)}"
            f" (the run itself keeps up to {max(jobs, 1)} cores busy).\n\nMachine: {R.machine_description()}\n")
