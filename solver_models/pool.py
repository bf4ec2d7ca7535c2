"""The planner's worker processes: forked from the planning process, each holding the search it was
forked from, so that steps can simulate and search in parallel to the same plan as one process."""
from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import sys


from harmony_opt.planners.baselines import played
from harmony_opt.core.plan import Plan

from .state import Search


FORKED: Search | None = None      # in a process of processes: the search it was forked from


def forked(S: Search) -> None:
    global FORKED
    FORKED = S


def play(plan_: Plan) -> tuple[float, int]:
    """``played`` of ``plan_`` in a process of processes."""
    return played(plan_, FORKED.profile, FORKED.hw, FORKED.opts.cost_model)


@contextlib.contextmanager
def processes(S: Search):
    """``S.opts.processes`` processes for Harmony's hint, the first solutions, the local search and the
    simulator's descent, forked from this one (so they start in milliseconds and hold the profile without
    unpickling it), as ``S.pool``; None for one process. The search is pure Python: only processes
    run two parts of it at once. Each step takes their results in the order one process would
    compute them, so the plan does not depend on ``processes``. Linux only (forking a process with
    threads is unsafe on macOS): elsewhere one process does it all, to the same plan."""
    if S.opts.processes <= 1 or not sys.platform.startswith("linux"):
        yield
        return
    S.pool = concurrent.futures.ProcessPoolExecutor(S.opts.processes, mp_context=multiprocessing.get_context("fork"),
                                                    initializer=forked, initargs=(S,))
    try:
        yield
    finally:
        S.pool.shutdown(wait=False, cancel_futures=True)   # a step that stopped early leaves no wait
        S.pool = None
