"""CP-SAT segment (path) model: the best forward and backward packs for one configuration.

One Boolean per candidate pack [i, j] that fits in memory (``arcs.py``), flow
conservation over layer boundaries for each phase, exactly one criterion pack [s, R-1]
that ends the backward path at s and the forward path at s, pack costs as constants,
and the objective of ``objective.py``. This segment formulation is what makes the
search fast: a running-sum formulation of the same packing (an integer "pack id" per
layer and memory sums per pack) stalls with a huge gap at a few hundred layers.

Per-pack options are parallel arcs (arcs.py): choosing a stash variant of a backward
pack sets the stash indicator of its layers, and a forward pack may only be chosen if its
working set plus the saved activations of its stashed layers fits (one linear
constraint per forward arc, only where it can bind).

Determinism: the search is limited in CP-SAT's deterministic time and, with several
workers, runs them interleaved, so the same inputs, seed and worker count give the same
packs on any machine load.

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

from .arcs import Arcs, Config, Phases
from .objective import SCALE, chain


Pack = tuple[int, int]


@dataclasses.dataclass
class Solution:
    packs_fwd: list
    packs_bwd: list
    options: list          # (recompute, gpu optimizer) per backward pack, aligned with packs_bwd


@dataclasses.dataclass
class PackingResult:
    status: str
    objective: float | None      # seconds
    bound: float                 # seconds, CP-SAT's best bound on this configuration's objective
    packs_fwd: list
    packs_bwd: list
    options: list                # (recompute, gpu optimizer) per backward pack
    wall_time: float
    solutions: int
    deterministic_time: float = 0.0
    earlier: list = dataclasses.field(default_factory=list)   # earlier incumbents (Solution), newest first

    @property
    def gap(self) -> float:
        if self.objective is None or self.objective <= 0:
            return float("inf")
        return max(0.0, (self.objective - self.bound) / self.objective)


def _pick(ph: Phases, value) -> Solution:
    """The packs of an assignment; ``value(phase, k)`` says whether arc k of a phase is chosen."""
    f = sorted((int(ph.fwd.start[k]), int(ph.fwd.end[k])) for k in range(len(ph.fwd)) if value("f", k))
    chosen = [ph.bwd.key(k) for k in range(len(ph.bwd)) if value("b", k)]
    chosen += [ph.crit.key(k) for k in range(len(ph.crit)) if value("c", k)]
    chosen.sort()
    return Solution(f, [(a, b) for a, b, _, _ in chosen], [(r, g) for _, _, r, g in chosen])


class _Progress(cp_model.CpSolverSolutionCallback):
    """Reports every improving solution with its objective and the current bound; keeps the last few."""

    KEEP = 3

    def __init__(self, report, label, ph: Phases, xs):
        super().__init__()
        self.report, self.label, self.count = report, label, 0
        self.ph, self.xs, self.kept = ph, xs, []

    def on_solution_callback(self):
        self.count += 1
        self.kept = ([_pick(self.ph, lambda p, k: self.boolean_value(self.xs[p][k]))] + self.kept)[: self.KEEP + 1]
        if self.report:
            self.report(f"  {self.label}: solution {self.count}: {self.objective_value / SCALE:.4f} s "
                        f"(bound {self.best_objective_bound / SCALE:.4f} s, {self.wall_time:.2f} s)")


def _ints(a) -> list[int]:
    return [int(round(v * SCALE)) for v in a]


def build(ph: Phases, R: int, cfg: Config, hw):
    """The CP-SAT model and its variables: (model, {"f": xf, "b": xb, "c": xc})."""
    fwd, bwd, crit = ph.fwd, ph.bwd, ph.crit
    m = cp_model.CpModel()
    # [START variables]
    xf = [m.new_bool_var(f"f_{fwd.start[k]}_{fwd.end[k]}") for k in range(len(fwd))]
    xb = [m.new_bool_var("b_%d_%d_%s%s" % (bwd.start[k], bwd.end[k], "r" if bwd.recompute[k] else "s",
                                            "g" if bwd.gpu_opt[k] else "c")) for k in range(len(bwd))]
    xc = [m.new_bool_var("c_%d_%s" % (crit.start[k], "g" if crit.gpu_opt[k] else "c")) for k in range(len(crit))]
    # [END variables]
    # [START constraints]
    m.add_exactly_one(xc)
    crit_at = defaultdict(list)
    for k, s in enumerate(crit.start):
        crit_at[int(s)].append(xc[k])
    for arcs, x in ((fwd, xf), (bwd, xb)):
        into, out = defaultdict(list), defaultdict(list)
        for k in range(len(arcs)):
            out[int(arcs.start[k])].append(x[k])
            into[int(arcs.end[k]) + 1].append(x[k])
        # flow: a path of packs from boundary 0 that stops where the criterion pack starts
        for v in range(R):
            src = 1 if v == 0 else sum(into[v])
            m.add(src == sum(out[v]) + sum(crit_at.get(v, [])))
    _stash_memory(m, ph, xf, xb)
    # [END constraints]
    # [START objective]
    task = {"f": _ints(fwd.task + fwd.first_load), "b": _ints(bwd.task + bwd.tail),
            "c": _ints(crit.task + crit.first_load + crit.tail)}
    total_task = (sum(c * v for c, v in zip(task["f"], xf)) + sum(c * v for c, v in zip(task["b"], xb))
                  + sum(c * v for c, v in zip(task["c"], xc)))
    horizon = int(sum(max(0, c) for c in task["f"]) + sum(task["b"]) + sum(task["c"])) + 1
    n = cfg.gpus

    def linsum(attr):
        return sum(sum(c * v for c, v in zip(_ints(getattr(a, attr)), x)) for a, x in ((fwd, xf), (bwd, xb), (crit, xc)))
    link_in, link_out = linsum("link_in"), linsum("link_out")
    horizon = max(horizon, int(sum(_ints(fwd.link_in)) + sum(_ints(bwd.link_in)) + sum(_ints(crit.link_in))) * n,
                  int(sum(_ints(fwd.link_out)) + sum(_ints(bwd.link_out)) + sum(_ints(crit.link_out))) * n)
    T = m.new_int_var(0, max(horizon, 1), "iteration_us")
    if chain(cfg):
        m.add(T >= total_task)
        if cfg.mode == "vDP" and n > 1 and hw.shared_host_link:
            # n replicas' transfers share one host link
            m.add(T >= n * link_in)
            m.add(T >= n * link_out)
    else:
        mf, mb = ph.microbatches
        fill_f = m.new_int_var(0, horizon, "fill_fwd_us")
        fill_b = m.new_int_var(0, horizon, "fill_bwd_us")
        for arcs, x, fill, mm in ((fwd, xf, fill_f, mf), (bwd, xb, fill_b, mb), (crit, xc, fill_b, mb)):
            for k in range(len(arcs)):
                m.add(fill >= int(round((n - 1) * arcs.task[k] / mm * SCALE))).only_enforce_if(x[k])
        # T >= sum(task)/N + fills: multiply through by N to stay integral
        m.add(n * T >= total_task + n * (fill_f + fill_b))
        # the first microbatch must pass every pack in turn: T >= sum of hops (+ the tail)
        m.add(T >= linsum("hop") + sum(c * v for c, v in zip(_ints(bwd.tail), xb))
              + sum(c * v for c, v in zip(_ints(crit.tail + crit.first_load), xc))
              + sum(c * v for c, v in zip(_ints(fwd.first_load), xf)))
        m.add(T >= link_in)
        m.add(T >= link_out)
    m.minimize(T)
    # [END objective]
    return m, {"f": xf, "b": xb, "c": xc}


def _stash_memory(m, ph: Phases, xf, xb) -> None:
    """A forward pack holds one microbatch of saved activations of its stashed layers until they leave."""
    stash = np.flatnonzero(~ph.bwd.recompute)
    if ph.saved_fwd is None or len(stash) == 0:
        return
    saved = np.round(ph.saved_fwd).astype(np.int64)
    covering = defaultdict(list)
    for k in stash:
        for layer in range(int(ph.bwd.start[k]), int(ph.bwd.end[k]) + 1):
            covering[layer].append(xb[k])
    stashed = {}
    for layer, arcs in covering.items():
        stashed[layer] = m.new_bool_var(f"stash_{layer}")
        m.add(stashed[layer] == sum(arcs))
    prefix = np.concatenate([[0], np.cumsum(saved)])
    for k in range(len(ph.fwd)):
        a, b = int(ph.fwd.start[k]), int(ph.fwd.end[k])
        slack = int(ph.cap - ph.fwd_mem[k])
        if prefix[b + 1] - prefix[a] <= slack:
            continue   # even stashing all its layers fits
        terms = [int(saved[l]) * stashed[l] for l in range(a, b + 1) if l in stashed]
        if terms:
            m.add(sum(terms) <= slack).only_enforce_if(xf[k])


def solve(ph: Phases, R: int, cfg: Config, hw, *, time_limit: float = 5.0, seed: int = 0, workers: int = 2,
          rel_gap: float = 1e-4, hint: Solution | None = None, report=None) -> PackingResult:
    """Solve one configuration; ``time_limit`` is in CP-SAT's deterministic seconds (reproducible)."""
    t0 = time.perf_counter()
    m, xs = build(ph, R, cfg, hw)
    if hint is not None:
        hf = {tuple(p) for p in hint.packs_fwd}
        hb = {(a, b, r, g) for (a, b), (r, g) in zip(hint.packs_bwd, hint.options)}
        for arcs, x in ((ph.fwd, xs["f"]), (ph.bwd, xs["b"]), (ph.crit, xs["c"])):
            for k in range(len(arcs)):
                chosen = (arcs.key(k)[:2] in hf) if arcs is ph.fwd else (arcs.key(k) in hb)
                m.add_hint(x[k], chosen)
    solver = cp_model.CpSolver()
    p = solver.parameters
    p.max_deterministic_time = float(time_limit)
    p.max_time_in_seconds = 4.0 * float(time_limit) + 5.0     # a guard only; the deterministic limit binds first
    p.num_workers = int(workers)
    p.interleave_search = int(workers) > 1
    p.random_seed = int(seed)
    p.relative_gap_limit = float(rel_gap)
    p.log_search_progress = False
    cb = _Progress(report, str(cfg), ph, xs)
    status = solver.solve(m, cb)
    name = solver.status_name(status)
    wall = time.perf_counter() - t0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return PackingResult(name, None, float("inf"), [], [], [], wall, cb.count, solver.deterministic_time)
    sol = _pick(ph, lambda p, k: solver.boolean_value(xs[p][k]))
    earlier = [s for s in cb.kept if (s.packs_fwd, s.packs_bwd, s.options) != (sol.packs_fwd, sol.packs_bwd,
                                                                                 sol.options)][: _Progress.KEEP]
    return PackingResult(name, solver.objective_value / SCALE, solver.best_objective_bound / SCALE,
                         sol.packs_fwd, sol.packs_bwd, sol.options, wall, cb.count, solver.deterministic_time,
                         earlier)


def objective_of(ph: Phases, cfg: Config, hw, packs_f, packs_b, options=None) -> float:
    """Evaluate objective.py's formula for given packs (seconds); used for hints and checks.

    Raises KeyError when a pack is not one of the configuration's candidates."""
    fwd, bwd, crit = ph.fwd, ph.bwd, ph.crit
    options = options or [(True, False)] * len(packs_b)

    def idx(arcs, packs, opts):
        key = {arcs.key(k): k for k in range(len(arcs))}
        return [key[(int(p[0]), int(p[1]), bool(o[0]), bool(o[1]))] for p, o in zip(packs, opts)]
    kf = idx(fwd, packs_f, [(True, False)] * len(packs_f))
    kb, kc = idx(bwd, packs_b[:-1], options[:-1]), idx(crit, packs_b[-1:], options[-1:])
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
    mf, mb = ph.microbatches
    fill_f = max([(n - 1) * fwd.task[k] / mf for k in kf], default=0.0)
    fill_b = max([(n - 1) * a.task[k] / mb for a, ks in ((bwd, kb), (crit, kc)) for k in ks], default=0.0)
    hops = tot("hop") + (r(bwd.tail)[kb].sum() + r(crit.tail + crit.first_load)[kc].sum()
                         + r(fwd.first_load)[kf].sum()) / SCALE
    return float(max(total / SCALE / n + fill_f + fill_b, hops, link_in, link_out))
