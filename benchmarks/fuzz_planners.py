"""Soak the planners with random profiles and hardware (issue #7); the CI runs a few dozen.

Every example draws a profile of 1..--max-layers layers and a server (harmony_opt.fuzzing),
runs a planner on it (the next of --planners in turn, or all of them with --every-planner)
and checks the contract: a plan that validates and simulates under the memory cap, or
InfeasibleError with an explanation. Prints the count and each failure with the FuzzCase
that replays it::

    .venv/bin/python benchmarks/fuzz_planners.py --examples 2000 --workers 2 \
        --out benchmarks/results/fuzz.md
    .venv/bin/python benchmarks/fuzz_planners.py --examples 2000 --workers 1 \
        --planners harmony,naive-swap,l2l,zero-offload --out benchmarks/results/fuzz.md

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


import numpy as np

from harmony_opt.fuzzing import PLANNER_NAMES, check_case, random_case
from harmony_opt.core.io import atomic_write_text


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def run_example(job: tuple) -> tuple[int, str, list[tuple[str, str, str]]]:
    """One example: (index, case repr, [(planner, outcome, detail)]); outcome plan|infeasible|FAIL|TIMEOUT."""
    i, seed, max_layers, large_fraction, time_limit, timeout, each, planners = job
    case = random_case(np.random.default_rng([seed, i]), max_layers=max_layers, time_limit=time_limit,
                       large_fraction=large_fraction)
    results = []
    signal.signal(signal.SIGALRM, _alarm)
    for name in (planners if each else [planners[i % len(planners)]]):
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


def _code_state() -> str:
    """The commit the soak ran on, and which of its source files had uncommitted changes."""
    import subprocess
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "harmony_opt", "solver_models"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"
    changed = sorted(line[3:] for line in dirty if line.strip())
    return f"commit {head}" + (f" with uncommitted changes to {', '.join(changed)}" if changed else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="processes (each CP-SAT solve uses one thread)")
    ap.add_argument("--max-layers", type=int, default=1200)
    ap.add_argument("--large-fraction", type=float, default=0.05, help="share of examples with 200..max layers")
    ap.add_argument("--time-limit", type=float, default=1.0, help="CP-SAT seconds per plan() call")
    ap.add_argument("--example-timeout", type=int, default=60, help="seconds per planner per example")
    ap.add_argument("--planners", default=",".join(PLANNER_NAMES),
                    help=f"comma list of planners to soak (default: all, {','.join(PLANNER_NAMES)})")
    ap.add_argument("--every-planner", action="store_true",
                    help="run every planner on every example (default: example i runs planner i mod their number)")
    ap.add_argument("--out", default=None, help="write a markdown summary here")
    args = ap.parse_args(argv)
    planners = [x.strip() for x in args.planners.split(",") if x.strip()]
    unknown = sorted(set(planners) - set(PLANNER_NAMES))
    if not planners or unknown or len(set(planners)) != len(planners):
        ap.error(f"--planners {args.planners!r}: give distinct names among {', '.join(PLANNER_NAMES)}")
    if args.workers < 1 or args.examples < 0:
        ap.error("--workers must be >= 1 and --examples >= 0")

    # import every module a planner or the check uses before the workers fork, so that all examples run the
    # same code even when someone edits the tree during a soak of an hour
    import harmony_opt.planners.baselines, harmony_opt.harmony, harmony_opt.sim.simulator  # noqa: E401,F401
    from harmony_opt.planners.registry import PLANNERS
    for name in planners:
        PLANNERS[name].load()      # imports the planner's module (cp-sat's: harmony_opt.solver_models.planner)
    code = _code_state()
    t0 = time.perf_counter()
    jobs = [(i, args.seed, args.max_layers, args.large_fraction, args.time_limit, args.example_timeout,
             args.every_planner, planners)
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
    per = f"x {len(planners)} planners" if args.every_planner else "(one planner each, in turn)"
    print(f"{done} examples {per} in {wall:.0f} s: {n_fail} failures, "
          f"{n_timeout} timeouts")
    for name in planners:
        print(f"  {name:13s} " + ", ".join(f"{o} {counts[(name, o)]}"
                                          for o in ("plan", "infeasible", "FAIL", "TIMEOUT") if counts[(name, o)]))
    if args.out:
        cmd = " ".join(["benchmarks/fuzz_planners.py"] + (argv if argv is not None else sys.argv[1:]))
        lines = ["# Planner fuzz soak", "", f"Command: `.venv/bin/python {cmd}`", "",
                 f"{done} examples (seed {args.seed}, 1..{args.max_layers} layers, {args.large_fraction:.0%} of them "
                 f"with 200 or more, CP-SAT time limit "
                 f"{args.time_limit} s, {args.workers} worker{'s' if args.workers != 1 else ''}) {per} in {wall:.0f} s: "
                 f"**{n_fail} failures, {n_timeout} timeouts**.", "", f"Code: {code}.", "",
                 "| planner | plan | infeasible | FAIL | TIMEOUT |", "|---|---|---|---|---|"]
        for name in planners:
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
