"""CP-SAT pipeline model for vPP: the best packs of one configuration, timed like the simulator.

In vPP the task at chain position j runs on GPU j mod N, so a task's timing depends on the
task N positions earlier (timing.py's recurrence), not only on its neighbour: a sum over
consecutive pairs (chain.py) does not describe it. This model places tasks at positions:

* one Boolean ``x[j, k]`` per (position j, candidate task k) that the layered graph can
  reach: the pack at position j starts where the one at j - 1 ended (flow conservation at
  every (position, boundary) node), forward packs ascend to the criterion pack's start s,
  backward packs descend from s to 0, exactly one criterion pack;
* per position, its task's constants as linear sums (``P1_j = sum_k x[j, k] * p_first_k``);
* the recurrence of timing.py as linear inequalities on integer start/end variables per
  position, with one Boolean per memory rule where some pair of candidates could break it;
* the shared link's capacity per phase: ``T = max(E_crit, link_F) + max(T_pipe - E_crit, link_B)``
  with E_crit the end of the criterion pack (timing.py).

Positions after the chain's end hold nothing, so their constants are 0 and they do not delay
T. The number of positions is bounded by the caller (``max_fwd``, ``max_bwd``), which bounds
how many packs a plan may have. The LP relaxation of this model is weak (fractional paths
spread a task's cost over positions), so the planner starts CP-SAT from a complete hint found
by local search on the same recurrence (search.py) and reports CP-SAT's bound as it is.
"""
from __future__ import annotations

import dataclasses
from collections import defaultdict

import numpy as np
from ortools.sat.python import cp_model

from . import cpsat
from .tasks import B, C, F, Tasks, TIME_COLUMNS, min_packs


@dataclasses.dataclass
class Layout:
    """Which (position, task row) pairs exist: the reachable part of the layered graph."""

    positions: int
    rows: list[np.ndarray]      # rows[j] = task rows that may sit at position j


def layout(tasks: Tasks, max_fwd: int, max_bwd: int, most: int | None = None) -> Layout | None:
    """Positions 0 .. max_fwd + max_bwd; keep (j, row) only if the row's start is reachable at j
    and the chain can still be completed from its end in the positions left. None once more than
    ``most`` (position, row) pairs are kept: the caller does not build models that large, and
    the rest of the layout would cost it up to a second on 1,000-layer models."""
    t, R = tasks.table, tasks.num_layers
    J = max_fwd + 1 + max_bwd
    min_b = min_packs(tasks, B)
    kind, s, e = t.kind, t.start, t.end
    reach_f = np.zeros(R + 1, bool)
    reach_f[0] = True
    reach_b = np.zeros(R + 1, bool)     # backward path at boundary v: layers 0..v-1 still to cover
    rows, size = [], 0
    for j in range(J):
        left = J - j - 1
        finish = np.where(s > 0, min_b[s], 0) <= left
        ok_f = (kind == F) & reach_f[s] & (j < max_fwd)
        ok_c = (kind == C) & reach_f[s] & (j <= max_fwd) & finish
        ok_b = (kind == B) & reach_b[np.minimum(e + 1, R)] & finish
        rows.append(np.flatnonzero(ok_f | ok_c | ok_b))
        size += len(rows[-1])
        if most is not None and size > most:
            return None
        reach_f = np.zeros(R + 1, bool)
        reach_f[e[ok_f] + 1] = True
        reach_b = np.zeros(R + 1, bool)
        reach_b[s[(ok_c | ok_b) & (s > 0)]] = True
    return Layout(J, rows)


def build(tasks: Tasks, lay: Layout):
    """The CP-SAT model and its placement Booleans {(position, row): var}."""
    t = tasks.table
    d = tasks.ticks()
    cap = d["cap"]
    n = tasks.cfg.ranks
    J = lay.positions
    m = cp_model.CpModel()
    # [START variables]
    x = {(j, int(k)): m.new_bool_var(f"x_{j}_{'FCB'[t.kind[k]]}{t.start[k]}_{t.end[k]}")
         for j in range(J) for k in lay.rows[j]}
    # [END variables]
    # [START path constraints]
    out_f, in_f, out_b, in_b = (defaultdict(list) for _ in range(4))
    crits = []
    for (j, k), v in x.items():
        a, b, kind = int(t.start[k]), int(t.end[k]), t.kind[k]
        if kind == F:
            out_f[j, a].append(v)
            in_f[j + 1, b + 1].append(v)
        elif kind == C:
            out_f[j, a].append(v)
            crits.append(v)
            if a > 0:
                in_b[j + 1, a].append(v)
        else:
            out_b[j, b + 1].append(v)
            if a > 0:
                in_b[j + 1, a].append(v)
    m.add_exactly_one(crits)
    for key in sorted(set(out_f) | set(in_f)):     # sorted: the same model in every process
        m.add(sum(out_f.get(key, [])) == (1 if key == (0, 0) else sum(in_f.get(key, []))))
    if (0, 0) not in out_f:
        m.add_bool_or([])       # nothing can start the chain
    for key in sorted(set(out_b) | set(in_b)):
        m.add(sum(out_b.get(key, [])) == sum(in_b.get(key, [])))
    for j in range(J):          # one task per position (implied by the flow; stated for propagation)
        if len(lay.rows[j]) > 1:
            m.add_at_most_one(x[j, int(k)] for k in lay.rows[j])
    chosen = defaultdict(list)
    for (j, k), v in x.items():
        chosen[k].append(v)
    cpsat.stash_memory(m, tasks, chosen)
    # [END path constraints]

    # [START timing]
    def at(j, col):
        """The constant ``col`` of the task at position j (0 where none is)."""
        return sum(int(col[k]) * x[j, int(k)] for k in lay.rows[j] if col[k])

    P1, PL, LOAD, HOP, WL, TAIL, UPD = ([at(j, d[f]) for j in range(J)] for f in TIME_COLUMNS)
    MEM, WB = [at(j, d["mem"]) for j in range(J)], [at(j, d["wb"]) for j in range(J)]
    top = lambda col, j: int(col[lay.rows[j]].max(initial=0))  # noqa: E731
    horizon = J * sum(int(d[f].max(initial=0)) for f in TIME_COLUMNS) + 1
    horizon = max(horizon, int(d["link_in"].sum()), int(d["link_out"].sum())) + 1
    S = [m.new_int_var(0, horizon, f"S_{j}") for j in range(J)]
    E = [m.new_int_var(0, horizon, f"E_{j}") for j in range(J)]
    FREE = [m.new_int_var(0, horizon, f"FREE_{j}") for j in range(J)]
    T = m.new_int_var(0, horizon, "T")
    crit_at = {}                # position -> "the criterion pack is here" (where it can be)
    for j in range(J):
        here = [x[j, int(k)] for k in lay.rows[j] if t.kind[k] == C]
        if here:
            crit_at[j] = m.new_bool_var(f"criterion_at_{j}")
            m.add(crit_at[j] == sum(here))
    if tasks.pen_chain:         # the last microbatch but one (timing.py): L_j ends it
        PP = [at(j, d["p_pen"]) for j in range(J)]
        L = [m.new_int_var(0, horizon, f"L_{j}") for j in range(J)]
    for j in range(J):
        # S_j >= S_{j-1} + p_first_{j-1} + hop_j;  E_j >= S_j + load_j;  E_j >= E_{j-1} + hop_j + p_last_j
        m.add(S[j] >= (S[j - 1] + P1[j - 1] if j else 0) + HOP[j])
        m.add(E[j] >= S[j] + LOAD[j])
        if j:
            m.add(E[j] >= E[j - 1] + HOP[j] + PL[j])
        if tasks.pen_chain:
            m.add(L[j] >= S[j] + LOAD[j] - PL[j])
            if j:
                chained = m.add(L[j] >= L[j - 1] + HOP[j] + PP[j])
                if j in crit_at:        # not across the re-batching into the criterion pack
                    chained.only_enforce_if(~crit_at[j])
            m.add(E[j] >= L[j] + PL[j])
        if j >= n:
            q = j - n
            W = m.new_int_var(0, horizon, f"W_{j}")
            m.add(W >= S[q])                      # weights come in once q computes ...
            m.add(S[j] >= W + WL[j])
            m.add(S[j] >= E[q])                   # ... and the GPU is free after q
            if top(d["mem"], q) + top(d["wb"], j) > cap:
                pf = m.new_bool_var(f"prefetch_{j}")          # W_j >= FREE_q unless mem_q + wb_j <= cap
                m.add(MEM[q] + WB[j] <= cap).only_enforce_if(pf)
                m.add(W >= FREE[q]).only_enforce_if(~pf)
            if top(d["mem"], q) + top(d["mem"], j) > cap:
                ov = m.new_bool_var(f"overlap_{j}")           # S_j >= FREE_q unless mem_q + mem_j <= cap
                m.add(MEM[q] + MEM[j] <= cap).only_enforce_if(ov)
                m.add(S[j] >= FREE[q]).only_enforce_if(~ov)
        else:
            m.add(S[j] >= WL[j])
        m.add(FREE[j] >= E[j] + TAIL[j])
        m.add(T >= E[j])
        m.add(T >= FREE[j] + UPD[j])
    # T = max(E_crit, link_F) + max(T_pipe - E_crit, link_B): the forward phase ends with the
    # criterion pack, and each phase takes at least its own traffic on the shared link (timing.py).
    # E_crit is only bounded below: where link_F > E_crit the model may end the criterion pack up
    # to link_F, shortening T_pipe - E_crit, so an objective can be below what its packs are worth
    # (by at most link_F - E_crit); the planner re-evaluates every solution (timing.evaluate)
    e_crit = m.new_int_var(0, horizon, "E_crit")
    for j, c_j in crit_at.items():
        m.add(e_crit == E[j]).only_enforce_if(c_j)

    def amount(col, rows):
        return sum(int(col[k]) * v for (j, k), v in x.items() if rows[k] and col[k])
    per_rank = None
    if tasks.host_bound:        # each GPU's issuing time: the tasks at its positions j = r mod n
        issuing = d["issuing"]
        per_rank = [sum(int(issuing[k]) * v for (j, k), v in x.items() if j % n == r and issuing[k])
                    for r in range(n)]
        horizon = max(horizon, int(issuing.sum()) + 1)
    cpsat.phase_objective(m, tasks, amount, e_crit, T - e_crit, 3 * horizon, per_rank)
    # [END timing]
    return m, x


def solve(tasks: Tasks, *, max_fwd: int = 0, max_bwd: int = 0, layout_: Layout | None = None, time_limit: float = 5.0,
          seed: int = 0, workers: int = 1, rel_gap: float = 1e-3, hint: list[int] | None = None, report=None,
          label: str = "", wall_limit: float | None = None) -> cpsat.SolveResult:
    """Solve one vPP configuration with at most ``max_fwd`` forward and ``max_bwd`` backward packs
    (or on ``layout_``); ``time_limit`` is in CP-SAT's deterministic seconds (reproducible),
    ``wall_limit`` in wall-clock seconds (not reproducible where it binds)."""
    lay = layout_ or layout(tasks, max_fwd, max_bwd)
    m, x = build(tasks, lay)
    if hint is not None and len(hint) <= lay.positions:
        where = dict(enumerate(hint))
        if all((j, k) in x for j, k in where.items()):
            cpsat.complete_hint(m, {v: where.get(j) == k for (j, k), v in x.items()})

    def decode(value):
        return [k for j in range(lay.positions) for k in lay.rows[j] if value(x[j, int(k)])]
    return cpsat.run(m, lambda value: [int(k) for k in decode(value)], time_limit=time_limit, seed=seed,
                     workers=workers, rel_gap=rel_gap, report=report, label=label, variables=len(x),
                     wall_limit=wall_limit, ticks_per_s=tasks.ticks_per_s)
