"""`python -m experiments {table1,compare,scaling,servers,all}`: regenerate experiments/results/.

``harmony-opt reproduce ...`` calls :func:`main` with the same arguments where this package is
importable (a checkout). Exit codes as the ``harmony-opt`` command's: 0 success, 2 bad input or an
infeasible request (one line on stderr), 1 an internal error.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback
from pathlib import Path

from harmony_opt.core.errors import HarmonyOptError, UsageError

EXPERIMENTS = ("table1", "compare", "scaling", "servers", "all")
#: the planner's time limit per search (work seconds, docs/planner.md section 4) without --time-limit
DEFAULT_TIME_LIMITS = {"table1": 20.0, "compare": 5.0, "scaling": 35.0, "servers": 2.0}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own usage errors: one line, exit 2
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser(prog: str = "python -m experiments") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, description="regenerate the experiments' tables and figures")
    p.add_argument("experiment", nargs="?", default="all", choices=EXPERIMENTS,
                   help="which experiment (default all: every one, in one go)")
    p.add_argument("--out", default=None, help="results folder (default: experiments/results)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="the planner's time limit per search, work seconds (default: table1 20, compare 5, scaling 35, "
                        "servers 2)")
    p.add_argument("--models", default=None, help="comma list of models to restrict to (default: all)")
    p.add_argument("--batches", default=None, help="compare: comma list of minibatch sizes (default 16,64,256)")
    p.add_argument("--gpus", default=None, help="compare: comma list of GPU counts (default 1,2,4)")
    p.add_argument("--jobs", type=int, default=2, help="compare: worker processes (default 2)")
    p.add_argument("--baseline-budget", type=int, default=None,
                   help="compare: skip naive-swap and l2l where minibatch x layers exceeds this (default 0: never)")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def _ints(text, name):
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--{name} {text!r}: give whole numbers separated by commas") from None


def run(args) -> int:
    """Run the experiments ``args`` names; print what was written and how long each took."""
    from harmony_opt.core.bundled import bundled_names
    from harmony_opt.core.io import atomic_write_text
    from harmony_opt.report import markdown_table

    from . import compare as C, scaling as S, servers as V, table1 as T
    from .common import RESULTS_DIR

    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    out = Path(args.out) if args.out else RESULTS_DIR
    models = [m.strip() for m in args.models.split(",")] if args.models else None
    if args.jobs < 1:
        raise UsageError(f"--jobs must be >= 1, got {args.jobs}")
    if args.time_limit is not None and not args.time_limit > 0:
        raise UsageError(f"--time-limit must be > 0 seconds, got {args.time_limit}")
    which = ("table1", "scaling", "servers", "compare") if args.experiment == "all" else (args.experiment,)
    limit = {k: args.time_limit or v for k, v in DEFAULT_TIME_LIMITS.items()}
    timings = {}
    written = []
    load_before = os.getloadavg()
    for exp in which:
        t0 = time.perf_counter()
        if exp == "table1":
            df = T.table1(limit["table1"], models)
            written += T.write_table1(df, out, limit["table1"])
            print(markdown_table(df[T.TABLE1_PRINT]))
        elif exp == "scaling":
            names = [m for m in S.SCALING_MODELS if not models or m in models] or list(S.SCALING_MODELS)
            df = S.scaling(limit["scaling"], names)
            written += S.write_scaling(df, out, limit["scaling"])
        elif exp == "servers":
            names = [m for m in V.SERVER_MODELS if not models or m in models] or list(V.SERVER_MODELS)
            df = V.servers(limit["servers"], names)
            written += V.write_servers(df, out, limit["servers"])
        else:
            budget = C.BASELINE_BUDGET if args.baseline_budget is None else args.baseline_budget
            compare_models = [m for m in (models or bundled_names()) if m in bundled_names()]
            if not compare_models:
                raise UsageError(f"--models {args.models!r}: none is a bundled profile ({', '.join(bundled_names())})")
            cells = C.compare_cells(compare_models,
                                    _ints(args.batches, "batches") if args.batches else C.COMPARE_BATCHES,
                                    _ints(args.gpus, "gpus") if args.gpus else C.COMPARE_GPUS,
                                    time_limit=limit["compare"], baseline_budget=budget)
            df, timelines = C.compare(cells, jobs=args.jobs)
            written += C.write_compare(df, timelines, out, limit["compare"], budget)
        timings[exp] = time.perf_counter() - t0
    for p in written:
        print(f"wrote {p}")
    total = sum(timings.values())
    print("time: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()) + f"; total {total:.0f} s")
    if args.experiment == "all":
        print(f"wrote {atomic_write_text(out / 'run_time.md', run_time_report(timings, load_before, limit, args.jobs))}")
    return 0


def run_time_report(timings: dict[str, float], load_before: tuple[float, float, float], limits: dict[str, float],
                    jobs: int) -> str:
    """run_time.md: wall time per experiment, the machine, and how busy it was (load averages)."""
    from harmony_opt.report import machine_description
    total = sum(timings.values())
    lines = [f"| {k} | {v:.0f} |" for k, v in timings.items()]
    load_after = os.getloadavg()
    return ("# Run time of `python -m experiments all`\n\n| experiment | wall time (s) |\n|---|---|\n"
            + "\n".join(lines) + f"\n| total | {total:.0f} |\n\n"
            f"Planner time limits (work seconds): {', '.join(f'{k} {v:g}' for k, v in limits.items())}; compare "
            f"with {jobs} worker processes. Load average (1, 5, 15 min) before the "
            f"run: {', '.join(f'{x:.2f}' for x in load_before)}; after: {', '.join(f'{x:.2f}' for x in load_after)}"
            f" (the run itself keeps up to {max(jobs, 1)} cores busy).\n\nMachine: {machine_description()}\n")


def main(argv: list[str] | None = None, prog: str = "python -m experiments") -> int:
    """Parse ``argv`` and run; bad input is one line on stderr and exit 2, never a traceback."""
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    try:
        return run(build_parser(prog).parse_args(argv))
    except HarmonyOptError as e:
        if debug:
            traceback.print_exc()
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"{prog}: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
