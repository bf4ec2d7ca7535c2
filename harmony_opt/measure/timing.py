"""Robust timing of one measurement: warm-up, then the median of enough runs, outliers dropped.

A mean of three runs is at the mercy of one slow run: on a busy 2-core machine with two
intra-op threads, identical GPT-2 blocks measured 6.4 ms and 168 ms in consecutive layers
(another process held a core while the OpenMP team waited at its barriers). So every
time the profiler records (forward, backward, the CPU optimizer step) comes from
:func:`time_runs`: after ``warmup`` untimed runs it times ``repeats`` runs, drops the runs
more than ``MAD_K`` scaled median absolute deviations from the median, and keeps adding
runs (in batches, up to ``max_repeats``) until the median of the kept runs moves by less
than ``rel_tol`` from one batch to the next. CUDA events time each run on a GPU (device
time; one synchronization per batch, so the runs of a batch queue back to back), the wall
clock on the CPU.
"""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable

import torch

from ..core.errors import UsageError

#: Runs farther than this many scaled MADs (1.4826 x MAD: the standard deviation of a normal sample)
#: from the median are outliers.
MAD_K = 3.0
#: The MAD is taken as at least this share of the median, so that identical runs do not make every
#: other run an outlier.
_MAD_FLOOR = 0.01
#: A median that moves less than this share between batches is settled.
REL_TOL = 0.05


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds of one run (the median of the kept runs), how many runs were timed, how many were
    dropped as outliers, and whether the median settled before the cap."""

    seconds: float
    runs: int
    dropped: int
    settled: bool


def robust_median(samples: list[float], k: float = MAD_K) -> tuple[float, int]:
    """Median of ``samples`` after dropping those beyond ``k`` scaled MADs of their median; and how many
    were dropped."""
    if not samples:
        raise UsageError("robust_median needs at least one sample")
    med = statistics.median(samples)
    mad = statistics.median(abs(s - med) for s in samples)
    spread = k * max(1.4826 * mad, _MAD_FLOOR * abs(med))
    kept = [s for s in samples if abs(s - med) <= spread]
    return statistics.median(kept), len(samples) - len(kept)


def check_repeats(repeats: int, max_repeats: int | None, warmup: int) -> int:
    """The cap on runs (default 4 x ``repeats``), after checking the three counts."""
    cap = 4 * repeats if max_repeats is None else max_repeats
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1 or warmup < 0 or cap < repeats:
        raise UsageError(f"repeats must be >= 1, max_repeats >= repeats and warmup >= 0, got repeats={repeats}, "
                         f"max_repeats={max_repeats}, warmup={warmup}")
    return cap


def time_runs(fn: Callable[..., object], dev: torch.device | str = "cpu", *, repeats: int = 5,
              max_repeats: int | None = None, warmup: int = 1, rel_tol: float = REL_TOL,
              clock: Callable[[], float] = time.perf_counter,
              setup: Callable[[], object] | None = None) -> Timing:
    """Time ``fn`` as the module docstring says; ``clock`` is the CPU's wall clock (replaceable in tests).
    With ``setup``, each run is ``fn(setup())`` and only ``fn`` is timed: a backward needs a fresh graph
    from a forward that is not part of its time."""
    cap = check_repeats(repeats, max_repeats, warmup)
    dev = torch.device(dev)
    prepare, run = (setup, fn) if setup is not None else ((lambda: None), (lambda _: fn()))
    for _ in range(warmup):
        run(prepare())
    _sync(dev)
    samples = _batch(prepare, run, dev, repeats, clock)
    med, dropped = robust_median(samples)
    settled = dropped == 0 and max(samples) - min(samples) <= rel_tol * med   # tight from the start
    step = max(1, (repeats + 1) // 2)
    while not settled and len(samples) < cap:
        samples += _batch(prepare, run, dev, min(step, cap - len(samples)), clock)
        before, (med, dropped) = med, robust_median(samples)
        settled = abs(med - before) <= rel_tol * med
    return Timing(med, len(samples), dropped, settled)


def _batch(prepare, run, dev: torch.device, n: int, clock) -> list[float]:
    """Seconds of each of ``n`` runs of ``run(prepare())``, ``prepare`` untimed."""
    if dev.type == "cuda":
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for s, e in zip(starts, ends):
            arg = prepare()
            s.record()
            run(arg)
            e.record()
            del arg
        torch.cuda.synchronize(dev)
        return [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends)]
    out = []
    for _ in range(n):
        arg = prepare()
        t0 = clock()
        run(arg)
        out.append(clock() - t0)
        del arg
    return out


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
