"""Exact lower bounds for vPP plans of a given shape: a criterion start and numbers of packs.

``bounds.vpp_bound`` is cheap but loose where the criterion pack is large: taken per start s of the
criterion pack, it leaves 4-6 % below the best plans of the starts of a large loss pack on the
Table 1 profiles (benchmarks/results/vpp_starts.md). The position model of ``pipeline.py`` is exact
but weak, because its LP relaxation mixes chains of different lengths. With the shape fixed, that
is with the start s, the number f of forward packs and the number b of backward packs given, every
task's position and GPU is known, and the recurrence of timing.py becomes a small integer program
whose LP relaxation is far tighter: CP-SAT proves it in about a second per shape on bert_large.

The model here is that recurrence without the rules that couple two tasks' memory (a task waiting
for the memory of the task N positions earlier), with the position model's objective
(``cpsat.phase_objective``: each phase at least its traffic on the shared host link, each GPU's
issuing time where the host binds, the activation buffers within the host's memory): every plan of
the shape is at least its optimum, so the least over the shapes of a start bounds every plan of
that start. It needs every pack among the candidates (no coarsened
cuts), so it is offered for models of up to ``MAX_LAYERS`` layers.

``shape_bound`` solves one shape, ``start_bound`` every shape of a start. Both take a target: a
shape proven to need at least the target stops there, which is what proving a gap takes."""
from __future__ import annotations

import dataclasses
import math
from collections import defaultdict

import numpy as np
from ortools.linear_solver.python import model_builder as mb
from ortools.sat.python import cp_model

from . import cpsat
from .tasks import B, C, F, TIME_COLUMNS, Tasks, min_packs

#: the models whose candidate packs are every pack (tasks.candidate_cuts keeps every boundary up to 128
#: layers, tasks.MAX_ARCS_PER_START the 128 longest packs per start)
MAX_LAYERS = 128


@dataclasses.dataclass(frozen=True)
class ShapeResult:
    """What was proven of one shape (ticks): every plan of it needs at least ``bound``; ``proven``: the
    bound reaches the target or is the shape's optimum (not only the larger of CP-SAT's bound and the
    LP relaxation's, where CP-SAT's time ran out). A shape without a plan is proven to need the target."""

    fwd: int
    bwd: int
    bound: float
    proven: bool
    deterministic_time: float
    size: int = 0                   # the model's Booleans (what building it costs)
    sequence: tuple | None = None   # the best plan CP-SAT found below the target: task rows in position order


def check_exact(tasks: Tasks) -> None:
    """The bounds here cover every plan only where every pack is a candidate."""
    R = tasks.num_layers
    if tasks.cfg.mode != "vPP" or tasks.cfg.ranks < 2:
        raise ValueError("the shape bounds are for vPP configurations on two or more GPUs")
    if len(tasks.cuts) < R + 1 or tasks.per_start < R:
        raise ValueError(f"the shape bounds need every pack as a candidate ({R} layers: coarsened cuts); "
                         f"they are offered up to {MAX_LAYERS} layers")


def shapes(tasks: Tasks, s: int) -> list[tuple[int, int]]:
    """Every (forward packs, backward packs) a plan with the criterion pack starting at ``s`` may have."""
    if s == 0:
        return [(0, 0)]
    lo_f, lo_b = int(min_packs(tasks, F)[s]), int(min_packs(tasks, B)[s])
    return [(f, b) for f in range(lo_f, s + 1) for b in range(lo_b, s + 1)]


def shape_arcs(tasks: Tasks, s: int, f: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, positions) of every task that may sit at a position of the shape: forward packs in
    [0, s) at positions 0 .. f - 1, the criterion pack [s, R - 1] at f, backward packs at
    f + 1 .. f + b, each leaving room for the packs before and after it (one layer each at least)."""
    t = tasks.table
    a, e = t.start, t.end + 1
    rows, pos = [], []
    for k in range(f):
        ok = (t.kind == F) & (a >= k) & (s - e >= f - 1 - k) & ((a == 0) if k == 0 else True) \
            & ((e == s) if k == f - 1 else True)
        rows.append(np.flatnonzero(ok))
        pos.append(np.full(len(rows[-1]), k))
    crit = np.flatnonzero((t.kind == C) & (a == s))
    rows.append(crit)
    pos.append(np.full(len(crit), f))
    for k in range(b):
        ok = (t.kind == B) & (e <= s) & (s - e >= k) & (a >= b - 1 - k) & ((e == s) if k == 0 else True) \
            & ((a == 0) if k == b - 1 else True)
        rows.append(np.flatnonzero(ok))
        pos.append(np.full(len(rows[-1]), f + 1 + k))
    return np.concatenate(rows), np.concatenate(pos)


def shape_model(tasks: Tasks, s: int, f: int, b: int, below: int | None = None, relax: bool = False,
                arcs: tuple | None = None):
    """(model, T) of the shape's plans, T in ticks: a CP-SAT CpModel, or with ``relax`` its LP relaxation
    (a model_builder model for GLOP); ``below``: only plans with T < below (ticks); ``arcs``: the
    shape's ``shape_arcs``, where the caller has them."""
    t, d, n = tasks.table, tasks.ticks(), tasks.cfg.ranks
    rows, pos = shape_arcs(tasks, s, f, b) if arcs is None else arcs
    P = f + 1 + b
    if relax:
        m, weighted = mb.ModelBuilder(), mb.LinearExpr.weighted_sum
        x = [m.new_num_var(0, 1, f"x{i}") for i in range(len(rows))]
        new_int = m.new_num_var
    else:
        m, weighted = cp_model.CpModel(), cp_model.LinearExpr.weighted_sum
        x = [m.new_bool_var(f"x{i}") for i in range(len(rows))]
        new_int = m.new_int_var
    a, e = t.start[rows], t.end[rows] + 1
    # flow conservation: forward packs from boundary 0 up to s, the criterion pack, backward packs from s down to 0
    out, into = defaultdict(list), defaultdict(list)
    for i, p in enumerate(pos.tolist()):
        if p < f:
            out["F", int(a[i]), p].append(x[i])
            into["F", int(e[i]), p + 1].append(x[i])
        elif p > f:
            out["B", int(e[i]), p - f - 1].append(x[i])
            into["B", int(a[i]), p - f].append(x[i])
    crit = [x[i] for i in np.flatnonzero(pos == f)]
    m.add(sum(crit) == 1)
    if f:
        m.add(sum(out["F", 0, 0]) == 1)
    if b:
        m.add(sum(out["B", s, 0]) == 1)
    for key in sorted(set(out) | set(into)):       # sorted: the same model in every process
        phase, v, k = key
        if k == 0 or (phase == "F" and k == f) or (phase == "B" and k == b):
            continue
        m.add(sum(out.get(key, [])) == sum(into.get(key, [])))
    if f:
        m.add(sum(into["F", s, f]) == 1)
    if b:
        m.add(sum(into["B", 0, b]) == 1)

    at = [np.flatnonzero(pos == j) for j in range(P)]

    def col(j: int, name: str):
        """position j's task's column ``name`` (ticks), as a linear expression"""
        idx = at[j]
        c = d[name][rows[idx]]
        keep = np.flatnonzero(c)
        return weighted([x[i] for i in idx[keep]], c[keep].tolist()) if len(keep) else 0

    # without ``below``, a horizon no plan of P tasks passes: every term sums at most P tasks' columns
    horizon = P * sum(int(d[c].max()) for c in TIME_COLUMNS + ("link_in", "link_out", "issuing")) + 1
    top = max(int(below) - 1, 0) if below is not None else horizon
    S = [new_int(0, top, f"S{j}") for j in range(P)]
    E = [new_int(0, top, f"E{j}") for j in range(P)]
    end = new_int(0, top, "T_pipe")
    L = [new_int(0, top, f"L{j}") for j in range(P)] if tasks.pen_chain else None
    for j in range(P):
        hop, wl, load = col(j, "hop_in"), col(j, "w_load"), col(j, "load")
        if j == 0:
            m.add(S[0] >= hop)
        else:
            m.add(S[j] >= S[j - 1] + col(j - 1, "p_first") + hop)
        if j >= n:
            m.add(S[j] >= S[j - n] + wl)       # weights prefetched once the task N back computes
            m.add(S[j] >= E[j - n])            # the GPU is free
        else:
            m.add(S[j] >= wl)
        m.add(E[j] >= S[j] + load)
        if j:
            m.add(E[j] >= E[j - 1] + hop + col(j, "p_last"))
        if L is not None:       # the last microbatch but one (timing.py), not across the re-batching at f
            m.add(L[j] >= S[j] + load - col(j, "p_last"))
            if j and j != f:
                m.add(L[j] >= L[j - 1] + hop + col(j, "p_pen"))
            m.add(E[j] >= L[j] + col(j, "p_last"))
        m.add(end >= E[j] + col(j, "tail") + col(j, "upd"))

    def amount(c, mask):
        """the chosen tasks' sum of column ``c`` over the table rows in ``mask``"""
        idx = np.flatnonzero(mask[rows] & (c[rows] != 0))
        return weighted([x[i] for i in idx], c[rows[idx]].tolist()) if len(idx) else 0
    # the phases on the shared link, the host's issuing time per GPU and its memory, as the position model
    issuing = None
    if tasks.host_bound:        # the tasks at each GPU's positions j = g mod n
        cost = d["issuing"][rows]
        issuing = [weighted([x[i] for i in on], cost[on].tolist())
                   for on in (np.flatnonzero((pos % n == g) & (cost != 0)) for g in range(n))]
    T = cpsat.phase_objective(m, tasks, amount, E[f], end - E[f], top, issuing, new_var=new_int)
    return m, T


def path_bound(tasks: Tasks, s: int, f: int, b: int, arcs: tuple | None = None) -> float:
    """A bound on every plan of the shape (ticks) from the recurrence's paths, in about a millisecond
    where CP-SAT takes ten: for each GPU g and each of its positions k, the first microbatch passes the
    positions before g (``S_j >= S_{j-1} + p_first_{j-1} + hop_j``), GPU g runs its tasks g, g + N,
    .., k (``S_{j+N} >= E_j >= S_j + load_j``), the last microbatch passes every position after k
    (``E_j >= E_{j-1} + hop_j + p_last_j``), and the last task's tail and update follow; with the
    shape fixed each task's cost on a path is set by its position, so the least over the packings is
    a shortest path over (position, layer boundary), forward packs up to s, backward packs down from
    it. The largest over the paths; inf where the shape has no plan. ``arcs``: as shape_model's."""
    t, d, n = tasks.table, tasks.ticks(), tasks.cfg.ranks
    rows, pos = shape_arcs(tasks, s, f, b) if arcs is None else arcs
    P = f + 1 + b
    if not (pos == f).any():
        return math.inf
    hop, first, last, load = (d[c][rows].astype(float) for c in ("hop_in", "p_first", "p_last", "load"))
    ends = (d["tail"][rows] + d["upd"][rows]).astype(float)
    g = np.concatenate([np.full(len(range(k, P, n)), k) for k in range(min(n, P))])[:, None]
    k = np.concatenate([np.arange(k, P, n) for k in range(min(n, P))])[:, None]
    j = pos[None, :]
    cost = (np.where(j <= g, hop, 0.0) + np.where(j < g, first, 0.0)
            + np.where((j % n == g) & (j <= k), load, 0.0) + np.where(j > k, hop + last, 0.0)
            + np.where(j == P - 1, ends, 0.0))
    lo, hi = t.start[rows], t.end[rows] + 1

    def walk(positions, at, to, origin):
        """the least cost per path of packs at ``positions`` from boundary ``origin``, per boundary reached"""
        dist = np.full((s + 1, len(cost)), math.inf)
        dist[origin] = 0.0
        for q in positions:
            m = pos == q
            nd = np.full_like(dist, math.inf)
            np.minimum.at(nd, to[m], dist[at[m]] + cost[:, m].T)
            dist = nd
        return dist
    total = cost[:, pos == f].min(axis=1)
    if f:
        total = total + walk(range(f), lo, hi, 0)[s]
    if b:
        total = total + walk(range(f + 1, P), hi, lo, s)[0]
    return float(total.max())


#: Below this many Booleans a shape's model is solved without its LP, probing and symmetries: its
#: presolve and search decide it (a 12-layer Llama's shapes, about 200 Booleans: 120 proofs that no
#: plan beats the best in 1.36 s instead of 1.94 s, 213 solves in 3.7 s instead of 11.8 s); larger
#: ones need the LP (bert_large's, about 760: 40 proofs in 10 s with it, 28 s without, 4 unfinished)
SMALL_SHAPE = 400


def shape_bound(tasks: Tasks, s: int, f: int, b: int, target: int, deterministic_limit: float = 5.0,
                lp: bool = True, arcs: tuple | None = None) -> ShapeResult:
    """At least what every plan of the shape takes (ticks), up to ``target``: proven to need at least
    ``target``, or the shape's optimum below it, or CP-SAT's bound where its time ran out (with
    ``lp``, or the LP relaxation's where higher); with the best plan found below the target. The
    plan leaves out the memory rules that couple two tasks: ``timing.evaluate`` rates it. ``arcs``:
    as shape_model's."""
    arcs = shape_arcs(tasks, s, f, b) if arcs is None else arcs
    m, _ = shape_model(tasks, s, f, b, below=target, arcs=arcs)
    size = len(arcs[0])
    solver = cp_model.CpSolver()
    p = solver.parameters
    p.num_workers = 1
    p.random_seed = 0
    p.max_deterministic_time = deterministic_limit
    if size < SMALL_SHAPE:
        p.linearization_level = p.cp_model_probing_level = p.symmetry_level = 0
    else:
        p.linearization_level = 2
    status = solver.solve(m)
    det = solver.deterministic_time
    if status == cp_model.INFEASIBLE:       # no plan of the shape ends before the target
        return ShapeResult(f, b, float(target), True, det, size)
    seq = _sequence(arcs, m, solver) if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None
    if status == cp_model.OPTIMAL:     # the model is integral: its values are whole ticks
        return ShapeResult(f, b, float(round(solver.objective_value)), True, det, size, seq)
    # out of time: CP-SAT's bound, or the LP relaxation's where higher (CP-SAT may stop before its root LP)
    bound = float(math.ceil(solver.best_objective_bound - 1e-6))
    if lp:
        bound = max(bound, lp_bound(tasks, s, f, b))
    if bound >= target:
        return ShapeResult(f, b, float(target), True, det, size, seq)
    return ShapeResult(f, b, bound, False, det, size, seq)


def _sequence(arcs: tuple, m: cp_model.CpModel, solver: cp_model.CpSolver) -> tuple:
    """The task rows CP-SAT chose, in position order (shape_model's first Booleans are the arcs')."""
    rows, pos = arcs
    chosen = [i for i in range(len(rows)) if solver.boolean_value(m.get_bool_var_from_proto_index(i))]
    return tuple(int(rows[i]) for i in sorted(chosen, key=lambda i: pos[i]))


#: GLOP's settings, tried in turn while it stops without an answer (ABNORMAL: the simplex lost its way
#: on some orders and scalings of the rows; gpt2_medium D=64 vPP x4 u=4/8, s = 25, (f, b) = (12, 14)
#: with the host-memory row: ABNORMAL by either simplex, 10.5364 s without the presolve)
LP_SETTINGS = ("", "use_dual_simplex: true", "use_preprocessing: false", "use_scaling: false")


def lp_bound(tasks: Tasks, s: int, f: int, b: int) -> float:
    """The LP relaxation of the shape's model (ticks, rounded up as the plans' times are whole ticks,
    after half a tick off for GLOP's tolerances); inf where the shape has no plan."""
    m, _ = shape_model(tasks, s, f, b, relax=True)
    for settings in LP_SETTINGS:
        solver = mb.Solver("GLOP")
        solver.set_solver_specific_parameters(settings)
        status = solver.solve(m)
        if status != mb.SolveStatus.ABNORMAL:
            break
    if status == mb.SolveStatus.INFEASIBLE:
        return math.inf
    if status != mb.SolveStatus.OPTIMAL:
        return 0.0
    return float(math.ceil(solver.objective_value - 0.5))


def start_bound(tasks: Tasks, s: int, target: int, deterministic_limit: float = 5.0) -> tuple[float, list]:
    """(the least over the shapes of start ``s`` of what ``shape_bound`` proves, ticks; each shape's
    ShapeResult). At least the target means every plan of the start is proven to need it."""
    check_exact(tasks)
    results = [shape_bound(tasks, s, f, b, target, deterministic_limit) for f, b in shapes(tasks, s)]
    return min((r.bound for r in results), default=float("inf")), results
