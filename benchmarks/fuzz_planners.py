"""Soak the planners with random profiles and hardware (issue #7); the CI runs a few dozen.

Every example draws a profile of 1..--max-layers layers and a server (harmony_opt.fuzzing),
runs a planner on it (the next in turn, or all with --every-planner) and checks the contract: a plan that validates and simulates
under the memory cap, or InfeasibleError with an explanation. Prints the count and each
failure with the FuzzCase that replays it::

    .venv/bin/python benchmarks/fuzz_planners.py --examples 2000 --workers 2 \
        --out benchmarks/results/fuzz.md

Replay one failure: ``python -c "from harmony_opt.fuzzing import *; check_case(FuzzCase(...))"``.
Exit code 1 when any example failed.
"""
from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import signal
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from harmony_opt.fuzzing import PLANNER_NAMES, check_case, random_case  # noqa: E402
from harmony_opt.io import atomic_write_text  # noqa: E402


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def run_example(job: tuple) -> tuple[int, str, list[tuple[str, str, str]]]:
    """One example: (index, case repr, [(planner, outcome, detail)]); outcome plan|infeasible|FAIL|TIMEOUT."""
    i, seed, max_layers, large_fraction, time_limit, timeout, each = job
    case = random_case(np.random.default_rng([seed, i]), max_layers=max_layers, time_limit=time_limit,
                       large_fraction=large_fraction)
    results = []
    signal.signal(signal.SIGALRM, _alarm)
    for name in (PLANNER_NAMES if each else [PLANNER_NAMES[i % len(PLANNER_NAMES)]]):
        signal.alarm(timeout)
        try:
            results.append((name, check_case(case, [name])[name], ""))
        except _Timeout:
            results.append((name, "TIMEOUT", f"over {timeout} s"))
        except Exception as e:  # the contract: nothing but InfeasibleError may escape
            frames = traceback.extract_tb(e.__traceback__)
            where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-3:]))
            msg = str(e).splitlines()[0] if str(e) else ""
            results.append((name, "FAIL", f"{type(e).__name__}: {msg[:300]} [{where}]"))
        finally:
            signal.alarm(0)
    return i, repr(case), results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="processes (each CP-SAT solve uses one thread)")
    ap.add_argument("--max-layers", type=int, default=1200)
    ap.add_argument("--large-fraction", type=float, default=0.05, help="share of examples with 200..max layers")
    ap.add_argument("--time-limit", type=float, default=1.0, help="CP-SAT seconds per plan() call")
    ap.add_argument("--example-timeout", type=int, default=60, help="seconds per planner per example")
    ap.add_argument("--every-planner", action="store_true",
                    help="run all planners on every example (default: example i runs planner i mod 5)")
    ap.add_argument("--out", default=None, help="write a markdown summary here")
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    jobs = [(i, args.seed, args.max_layers, args.large_fraction, args.time_limit, args.example_timeout,
             args.every_planner)
            for i in range(args.examples)]
    counts = collections.Counter()
    failures = []
    done = 0
    with mp.get_context("fork").Pool(args.workers, maxtasksperchild=50) as pool:
        for i, case, results in pool.imap_unordered(run_example, jobs):
            done += 1
            for name, outcome, detail in results:
                counts[(name, outcome)] += 1
                if outcome in ("FAIL", "TIMEOUT"):
                    failures.append((i, name, outcome, detail, case))
                    print(f"{outcome} example {i} {name}: {detail}\n    {case}", flush=True)
            if done % 50 == 0:
                print(f"{done}/{args.examples} examples, {len(failures)} failures, "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
    wall = time.perf_counter() - t0
    n_fail = sum(1 for f in failures if f[2] == "FAIL")
    n_timeout = len(failures) - n_fail
    per = f"x {len(PLANNER_NAMES)} planners" if args.every_planner else "(one planner each, in turn)"
    print(f"{done} examples {per} in {wall:.0f} s: {n_fail} failures, "
          f"{n_timeout} timeouts")
    for name in PLANNER_NAMES:
        print(f"  {name:13s} " + ", ".join(f"{o} {counts[(name, o)]}"
                                          for o in ("plan", "infeasible", "FAIL", "TIMEOUT") if counts[(name, o)]))
    if args.out:
        cmd = " ".join(["benchmarks/fuzz_planners.py"] + (argv if argv is not None else sys.argv[1:]))
        lines = [f"# Planner fuzz soak", "", f"Command: `.venv/bin/python {cmd}`", "",
                 f"{done} examples (seed {args.seed}, 1..{args.max_layers} layers, {args.large_fraction:.0%} of them "
                 f"with 200 or more, CP-SAT time limit "
                 f"{args.time_limit} s, {args.workers} workers) {per} in {wall:.0f} s: "
                 f"**{n_fail} failures, {n_timeout} timeouts**.", "",
                 "| planner | plan | infeasible | FAIL | TIMEOUT |", "|---|---|---|---|---|"]
        for name in PLANNER_NAMES:
            lines.append(f"| {name} | " + " | ".join(str(counts[(name, o)])
                                                    for o in ("plan", "infeasible", "FAIL", "TIMEOUT")) + " |")
        if failures:
            lines += ["", "## Failures", ""]
            lines += [f"- example {i}, {name}: {outcome} {detail}  \n  `{case}`"
                      for i, name, outcome, detail, case in sorted(failures)]
        atomic_write_text(args.out, "\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
