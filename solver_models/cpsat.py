"""What the CP-SAT models share: solver parameters, hints, progress, the result.

OR-tools style (STYLE.md): parameters set explicitly (deterministic time limit, seed,
workers), the hint completed to a full solution so CP-SAT starts from it, every improving
solution reported with its objective and the bound, and the result branches on the status.
"""
from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from typing import Callable

import numpy as np
from ortools.sat.python import cp_model

from .tasks import B, F, TICKS_PER_S, Tasks


@dataclasses.dataclass
class SolveResult:
    status: str                      # OPTIMAL, FEASIBLE, INFEASIBLE, UNKNOWN, MODEL_INVALID
    objective: float | None          # s
    bound: float                     # s: CP-SAT's proven lower bound on the model's optimum
    sequence: list                   # task rows in chain order (timing.sequence_of)
    wall_time: float
    deterministic_time: float
    earlier: list = dataclasses.field(default_factory=list)   # earlier improving sequences, newest first
    variables: int = 0

    @property
    def gap(self) -> float | None:
        if self.objective is None or self.objective <= 0:
            return None
        return max(0.0, (self.objective - self.bound) / self.objective)


class Progress(cp_model.CpSolverSolutionCallback):
    """Reports every improving solution with its objective and the current bound; keeps the last few."""

    KEEP = 4

    def __init__(self, report, label: str, decode: Callable[[Callable], list], ticks_per_s: int = TICKS_PER_S):
        super().__init__()
        self.report, self.label, self.decode, self.rate = report, label, decode, ticks_per_s
        self.kept, self.count = [], 0

    def on_solution_callback(self):
        self.count += 1
        self.kept = ([self.decode(self.boolean_value)] + self.kept)[: self.KEEP]
        if self.report:
            self.report(f"  {self.label}: solution {self.count}: {self.objective_value / self.rate:.4f} s "
                        f"(bound {self.best_objective_bound / self.rate:.4f} s, {self.wall_time:.2f} s)")


#: Wall seconds a solve may run, per deterministic second of its limit and in all, before the guard
#: stops it: far above what any solve takes, so that the deterministic limit always binds first and
#: the same inputs give the same plan on a loaded machine too. A deterministic second of the
#: timeline model costs 0.4-11 wall seconds on an idle 2-core machine (budget.timeline_slowness) and
#: three times that with four other processes on it; a guard of 4x (as before) let the wall decide
#: there, and the same inputs gave different plans (tests/test_planner.py, test_same_seed_same_plan).
WALL_GUARD_PER_S = 60.0
WALL_GUARD_S = 60.0


def complete_hint(model: cp_model.CpModel, fixed: dict) -> bool:
    """Hint every variable of ``model``: fix the ``fixed`` Booleans ({var: value}) in a copy, solve
    it (the rest follows by propagation and a tiny search) and hint the whole solution. A
    partial hint of a model with many derived variables is often not completed by CP-SAT."""
    probe = model.clone()
    for var, value in fixed.items():
        probe.add(probe.get_bool_var_from_proto_index(var.index) == int(value))
    solver = cp_model.CpSolver()
    # deterministic, as every solve here (a wall-clock limit would make the hint, and so the plan,
    # depend on the machine's load); the wall limit is a guard only
    solver.parameters.max_deterministic_time = 5.0
    solver.parameters.max_time_in_seconds = WALL_GUARD_PER_S * 5.0 + WALL_GUARD_S
    solver.parameters.num_workers = 1
    if solver.solve(probe) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return False
    for i, value in enumerate(solver.response_proto.solution):
        model.add_hint(model.get_int_var_from_proto_index(i), value)
    return True


def solver(*, time_limit: float, seed: int, workers: int, rel_gap: float, wall_limit: float | None = None,
           **params) -> cp_model.CpSolver:
    """A solver set up the way every model here is solved: a deterministic time limit (same inputs,
    seed and workers, same answer), interleaved search when there are several workers, and no
    presolve; ``wall_limit``: wall-clock seconds at most (the answer then depends on the machine's
    speed where it binds); ``params``: further solver parameters by name."""
    s = cp_model.CpSolver()
    p = s.parameters
    p.max_deterministic_time = float(time_limit)
    p.max_time_in_seconds = WALL_GUARD_PER_S * float(time_limit) + WALL_GUARD_S   # a guard only (WALL_GUARD_PER_S)
    if wall_limit is not None:
        p.max_time_in_seconds = max(0.0, min(p.max_time_in_seconds, float(wall_limit)))
    p.num_workers = int(workers)
    p.interleave_search = int(workers) > 1
    p.random_seed = int(seed)
    p.relative_gap_limit = float(rel_gap)
    # the models are built tight already; CP-SAT's presolve (probing above all) costs more than it
    # gains on them and can spend the whole limit before the hinted solution is even reported
    p.cp_model_presolve = False
    for k, v in params.items():
        setattr(p, k, v)
    return s


def run(model: cp_model.CpModel, decode: Callable[[Callable], list], *, time_limit: float, seed: int, workers: int,
        rel_gap: float, report=None, label: str = "", variables: int = 0,
        wall_limit: float | None = None, ticks_per_s: int = TICKS_PER_S) -> SolveResult:
    """Solve ``model`` (minimizing, in ticks of 1/``ticks_per_s`` s: Tasks.ticks_per_s) under a
    deterministic time limit; ``decode(value)`` turns an assignment into a task sequence."""
    t0 = time.perf_counter()
    solver_ = solver(time_limit=time_limit, seed=seed, workers=workers, rel_gap=rel_gap, wall_limit=wall_limit)
    cb = Progress(report, label, decode, ticks_per_s)
    status = solver_.solve(model, cb)
    name = solver_.status_name(status)
    wall = time.perf_counter() - t0
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        bound = solver_.best_objective_bound / ticks_per_s if status == cp_model.UNKNOWN else float("inf")
        return SolveResult(name, None, bound, [], wall, solver_.deterministic_time, [], variables)
    seq = decode(solver_.boolean_value)
    return SolveResult(name, solver_.objective_value / ticks_per_s, solver_.best_objective_bound / ticks_per_s, seq,
                       wall, solver_.deterministic_time, [s for s in cb.kept if s != seq], variables)


def phase_objective(m: cp_model.CpModel, tasks: Tasks, amount: Callable, fwd, bwd, horizon: int,
                    issuing=None, new_var=None):
    """Minimize ``T = max(fwd, link_F) + max(bwd, link_B)`` (timing.py): the forward phase (through
    the criterion pack, ``fwd``) and the backward phase (``bwd``) each take at least their own
    traffic on the shared host link; and the activation buffers fit the host memory left.
    ``amount(col, rows)``: the model's sum of ``col`` over the chosen tasks among ``rows`` (a mask
    over the task table). Where ``tasks.host_bound``, ``T`` also covers each rank's issuing time
    (timing.issuing_floor): ``issuing``, one sum per rank; None: one rank, the chosen tasks' sum.
    ``new_var(lo, hi, name)``: how ``m`` makes a variable (CP-SAT's integers by default; a
    model_builder model's continuous ones for an LP relaxation, vpp_exact.py). Returns ``T``."""
    d = tasks.ticks()
    backward = d["backward"].astype(bool)
    every = np.ones(len(backward), bool)
    new_var = new_var or m.new_int_var
    P = new_var(0, horizon, "forward_phase")
    T = new_var(0, horizon, "iteration")
    m.add(P >= fwd)
    m.add(P >= amount(d["link_in"], ~backward))
    m.add(P >= amount(d["link_out_fwd"], every))
    m.add(T >= P + bwd)
    m.add(T >= P + amount(d["link_in"], backward))
    m.add(T >= P + amount(d["link_out"] - d["link_out_fwd"], every))
    if tasks.host_bound:
        for expr in issuing if issuing is not None else [amount(d["issuing"], every)]:
            m.add(T >= expr)
    if tasks.host_budget is not None:       # the activation buffers fit the host memory left (timing.host_fits)
        m.add(amount(d["host"], every) <= tasks.host_budget)
    m.minimize(T)
    return T


def stash_memory(m: cp_model.CpModel, tasks: Tasks, chosen: dict) -> None:
    """A forward pack holds one microbatch of the saved activations of its stashed layers until
    they leave (timing.stash_fits). ``chosen[row]`` lists the Booleans that place task ``row``
    (one in the chain model, one per position in the pipeline model). Per layer one stash
    indicator (the sum of the stash variants covering it); per forward pack, only where stashing
    could overflow it, ``sum(saved_l * stash_l) <= cap - mem`` when the pack is used."""
    t = tasks.table
    if tasks.saved_fwd is None:
        return
    cover = defaultdict(list)
    for k, vs in chosen.items():
        if t.kind[k] == B and not t.recompute[k]:
            for layer in range(int(t.start[k]), int(t.end[k]) + 1):
                cover[layer].extend(vs)
    if not cover:
        return
    saved = np.round(tasks.saved_fwd).astype(np.int64)
    stashed = {}
    for layer, vs in cover.items():
        stashed[layer] = m.new_bool_var(f"stash_{layer}")
        m.add(stashed[layer] == sum(vs))
    prefix = np.concatenate([[0], np.cumsum(saved)])
    for k, vs in chosen.items():
        if t.kind[k] != F:
            continue
        a, b = int(t.start[k]), int(t.end[k])
        slack = int(tasks.cap - t.mem[k])
        if prefix[b + 1] - prefix[a] <= slack:
            continue        # even stashing all its layers fits
        terms = [int(saved[layer]) * stashed[layer] for layer in range(a, b + 1) if layer in stashed]
        if not terms:
            continue
        if len(vs) == 1:
            used = vs[0]
        else:
            used = m.new_bool_var(f"used_{k}")
            m.add(used == sum(vs))
        m.add(sum(terms) <= slack).only_enforce_if(used)
