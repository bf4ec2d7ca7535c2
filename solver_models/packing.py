"""CP-SAT segment (path) model: the best forward and backward packs for one configuration.

One Boolean per candidate pack [i, j] that fits in memory (``arcs.py``), flow
conservation over layer boundaries for each phase, exactly one criterion pack [s, R-1]
that ends the backward path at s and the forward path at s, pack costs as constants,
and the objective of ``objective.py``. This segment formulation is what makes the
search fast: a running-sum formulation of the same packing (an integer "pack id" per
layer and memory sums per pack) stalls with a huge gap at a few hundred layers.

GPU symmetry is broken by construction: a pack's GPU is a function of its position
(round-robin in vPP, its own replica in vDP), so no two solutions differ only by a
permutation of identical GPUs.
"""
from __future__ import annotations

import dataclasses
import time
from collections import defaultdict

import numpy as np
from ortools.sat.python import cp_model

from .arcs import Arcs, Config
from .objective import SCALE, chain


@dataclasses.dataclass
class PackingResult:
    status: str
    objective: float | None      # seconds
    bound: float                 # seconds, CP-SAT's best bound on this configuration's objective
    packs_fwd: list
    packs_bwd: list
    wall_time: float
    solutions: int

    @property
    def gap(self) -> float:
        if self.objective is None or self.objective <= 0:
            return float("inf")
        return max(0.0, (self.objective - self.bound) / self.objective)


class _Progress(cp_model.CpSolverSolutionCallback):
    """Reports every improving solution with its objective and the current bound."""

    def __init__(self, report, label):
        super().__init__()
        self.report, self.label, self.count = report, label, 0

    def on_solution_callback(self):
        self.count += 1
        if self.report:
            self.report(f"  {self.label}: solution {self.count}: {self.objective_value / SCALE:.4f} s "
                        f"(bound {self.best_objective_bound / SCALE:.4f} s, {self.wall_time:.2f} s)")


def build(fwd: Arcs, bwd: Arcs, crit: Arcs, R: int, cfg: Config, hw, microbatches: tuple[int, int]):
    """The CP-SAT model and its variables: (model, xf, xb, xc)."""
    m = cp_model.CpModel()
    # [START variables]
    xf = [m.new_bool_var(f"f_{fwd.start[k]}_{fwd.end[k]}") for k in range(len(fwd))]
    xb = [m.new_bool_var(f"b_{bwd.start[k]}_{bwd.end[k]}") for k in range(len(bwd))]
    xc = [m.new_bool_var(f"c_{crit.start[k]}") for k in range(len(crit))]
    # [END variables]
    # [START constraints]
    m.add_exactly_one(xc)
    crit_at = {int(s): xc[k] for k, s in enumerate(crit.start)}
    for arcs, x in ((fwd, xf), (bwd, xb)):
        into, out = defaultdict(list), defaultdict(list)
        for k in range(len(arcs)):
            out[int(arcs.start[k])].append(x[k])
            into[int(arcs.end[k]) + 1].append(x[k])
        # flow: a path of packs from boundary 0 that stops where the criterion pack starts
        for v in range(R):
            src = 1 if v == 0 else sum(into[v])
            sink = crit_at.get(v, 0)
            m.add(src == sum(out[v]) + sink)
    # [END constraints]
    # [START objective]
    def ints(a):
        return [int(round(v * SCALE)) for v in a]
    task = {"f": ints(fwd.task + fwd.first_load), "b": ints(bwd.task + bwd.tail),
            "c": ints(crit.task + crit.first_load + crit.tail)}
    total_task = (sum(c * v for c, v in zip(task["f"], xf)) + sum(c * v for c, v in zip(task["b"], xb))
                  + sum(c * v for c, v in zip(task["c"], xc)))
    horizon = int(sum(max(0, c) for c in task["f"]) + sum(task["b"]) + sum(task["c"])) + 1
    n = cfg.gpus

    def linsum(attr):
        return sum(sum(c * v for c, v in zip(ints(getattr(a, attr)), x)) for a, x in ((fwd, xf), (bwd, xb), (crit, xc)))
    link_in, link_out = linsum("link_in"), linsum("link_out")
    horizon = max(horizon, int(sum(ints(fwd.link_in)) + sum(ints(bwd.link_in)) + sum(ints(crit.link_in))) * n,
                  int(sum(ints(fwd.link_out)) + sum(ints(bwd.link_out)) + sum(ints(crit.link_out))) * n)
    T = m.new_int_var(0, max(horizon, 1), "iteration_us")
    if chain(cfg):
        m.add(T >= total_task)
        if cfg.mode == "vDP" and n > 1 and hw.shared_host_link:
            # n replicas' transfers share one host link
            m.add(T >= n * link_in)
            m.add(T >= n * link_out)
    else:
        mf, mb = microbatches
        fill_f = m.new_int_var(0, horizon, "fill_fwd_us")
        fill_b = m.new_int_var(0, horizon, "fill_bwd_us")
        for arcs, x, fill, mm in ((fwd, xf, fill_f, mf), (bwd, xb, fill_b, mb), (crit, xc, fill_b, mb)):
            for k in range(len(arcs)):
                m.add(fill >= int(round((n - 1) * arcs.task[k] / mm * SCALE))).only_enforce_if(x[k])
        # T >= sum(task)/N + fills: multiply through by N to stay integral
        m.add(n * T >= total_task + n * (fill_f + fill_b))
        # the first microbatch must pass every pack in turn: T >= sum of hops (+ the tail)
        m.add(T >= linsum("hop") + sum(c * v for c, v in zip(ints(bwd.tail), xb))
              + sum(c * v for c, v in zip(ints(crit.tail + crit.first_load), xc))
              + sum(c * v for c, v in zip(ints(fwd.first_load), xf)))
        m.add(T >= link_in)
        m.add(T >= link_out)
    m.minimize(T)
    # [END objective]
    return m, xf, xb, xc


def solve(fwd: Arcs, bwd: Arcs, crit: Arcs, R: int, cfg: Config, hw, microbatches: tuple[int, int], *,
          time_limit: float = 5.0, seed: int = 0, workers: int = 2, rel_gap: float = 1e-4,
          hint: tuple[list, list] | None = None, report=None) -> PackingResult:
    t0 = time.perf_counter()
    m, xf, xb, xc = build(fwd, bwd, crit, R, cfg, hw, microbatches)
    if hint is not None:
        hf, hb = {tuple(p) for p in hint[0]}, {tuple(p) for p in hint[1]}
        if hb and hf is not None:
            for arcs, x, chosen in ((fwd, xf, hf), (bwd, xb, hb), (crit, xc, hb)):
                for k in range(len(arcs)):
                    m.add_hint(x[k], (int(arcs.start[k]), int(arcs.end[k])) in chosen)
    solver = cp_model.CpSolver()
    p = solver.parameters
    p.max_time_in_seconds = float(time_limit)
    p.num_workers = int(workers)
    p.random_seed = int(seed)
    p.relative_gap_limit = float(rel_gap)
    p.log_search_progress = False
    cb = _Progress(report, str(cfg))
    status = solver.solve(m, cb)
    name = solver.status_name(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return PackingResult(name, None, float("inf"), [], [], time.perf_counter() - t0, cb.count)
    pick = lambda arcs, x: [(int(arcs.start[k]), int(arcs.end[k])) for k in range(len(arcs))  # noqa: E731
                            if solver.boolean_value(x[k])]
    packs_c = pick(crit, xc)
    packs_f = pick(fwd, xf)
    packs_b = pick(bwd, xb) + packs_c
    return PackingResult(name, solver.objective_value / SCALE, solver.best_objective_bound / SCALE,
                         sorted(packs_f), sorted(packs_b), time.perf_counter() - t0, cb.count)


def objective_of(fwd: Arcs, bwd: Arcs, crit: Arcs, cfg: Config, hw, microbatches, packs_f, packs_b) -> float:
    """Evaluate objective.py's formula for given packs (seconds); used for hints and checks."""
    def idx(arcs, packs):
        key = {(int(a), int(b)): k for k, (a, b) in enumerate(zip(arcs.start, arcs.end))}
        return [key[tuple(p)] for p in packs]
    kf, kb, kc = idx(fwd, packs_f), idx(bwd, packs_b[:-1]), idx(crit, packs_b[-1:])
    r = lambda v: np.round(v * SCALE)  # noqa: E731
    total = (r(fwd.task + fwd.first_load)[kf].sum() + r(bwd.task + bwd.tail)[kb].sum()
             + r(crit.task + crit.first_load + crit.tail)[kc].sum())
    def tot(attr):
        return sum(r(getattr(a, attr))[ks].sum() for a, ks in ((fwd, kf), (bwd, kb), (crit, kc))) / SCALE
    link_in, link_out = tot("link_in"), tot("link_out")
    n = cfg.gpus
    if chain(cfg):
        t = total / SCALE
        if cfg.mode == "vDP" and n > 1 and hw.shared_host_link:
            t = max(t, n * link_in, n * link_out)
        return float(t)
    mf, mb = microbatches
    fill_f = max([(n - 1) * fwd.task[k] / mf for k in kf], default=0.0)
    fill_b = max([(n - 1) * a.task[k] / mb for a, ks in ((bwd, kb), (crit, kc)) for k in ks], default=0.0)
    hops = tot("hop") + (r(bwd.tail)[kb].sum() + r(crit.tail + crit.first_load)[kc].sum()
                         + r(fwd.first_load)[kf].sum()) / SCALE
    return float(max(total / SCALE / n + fill_f + fill_b, hops, link_in, link_out))
