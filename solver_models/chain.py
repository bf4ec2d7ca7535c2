"""CP-SAT segment model for one chain (vDP, or one GPU): the best packs of one configuration.

When one GPU runs the whole chain of tasks (forward packs ascending, the criterion pack,
backward packs descending), the GPU is either computing or idle between two consecutive
tasks, so the iteration time is a sum over the chain::

    T = max(hop_0, w_load_0) + sum_k load_k + sum_{a -> b} gap(a, b) + tail_last + upd_last

where ``gap(a, b)`` (timing.chain_gap) is the idle time between task a and the next task
b: b's first input handed on from a, b's last input not hidden by its other microbatches,
b's weights prefetched while a computes, b's outputs queued behind a's gradients, and,
where a's memory and b's do not fit together, b's weights or working set waiting for a to
free its memory. The forward phase (through the criterion pack) and the backward phase each
take at least their traffic on the shared host link (all replicas' in vDP), so
``T = max(chain_F, link_F) + max(chain_B, link_B)``. The forward queue (timing.forward_queue) and
the waits for the memory of the task two back (timing.two_back) are left out, as the DP leaves them
out: the model is a relaxation where they bind, so its bound holds and
the planner re-rates every solution with timing.evaluate (the queue as constraints, one per forward
boundary, slowed the search: gpt2_xl D=16 on one GPU reached its 35.6 s solution after 1.5 s
of CP-SAT time instead of 0.4 s).

The gap depends only on the two tasks meeting at a layer boundary, so the model is the
segment (path) formulation: one Boolean per candidate task (tasks.py), flow conservation
over layer boundaries for the forward path (0 -> s) and the backward path (s -> 0), exactly
one criterion pack [s, R-1] joining them, and one idle-time variable per boundary node,
bounded below by the gap terms written with the node's in- and out-sums
(``IN(c) = sum over tasks ending at the node of x_k * c_k``; exactly one task enters and one
leaves a node on the path, none otherwise). Only the two memory rules are disjunctions, with
one Boolean each where some pair of tasks could break them. Everything else is linear, so
the LP relaxation is a shortest path with separable node costs and CP-SAT proves optimality
quickly; dp.py solves the same objective exactly as the test oracle.

Symmetry: none to break. The replicas of vDP are identical by construction (each runs the
same chain on its share), and a task's GPU is fixed by the mode.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
from ortools.sat.python import cp_model

from . import cpsat
from .tasks import B, C, F, TIME_COLUMNS, Tasks


def nodes(tasks: Tasks):
    """For every junction of two consecutive tasks: (tasks entering it, tasks leaving it).

    Keys ("F", v): forward boundary v (the task leaving is a forward or the criterion pack);
    ("B", v): backward boundary v (entering: the criterion or a backward pack starting at v;
    leaving: the backward pack ending at v - 1)."""
    t = tasks.table
    into, out = defaultdict(list), defaultdict(list)
    for k in range(len(t)):
        a, b, kind = int(t.start[k]), int(t.end[k]), int(t.kind[k])
        if kind == F:
            out["F", a].append(k)
            into["F", b + 1].append(k)
        elif kind == C:
            out["F", a].append(k)
            if a > 0:
                into["B", a].append(k)
        else:
            out["B", b + 1].append(k)
            if a > 0:
                into["B", a].append(k)
    return into, out


def build(tasks: Tasks):
    """The CP-SAT model: (model, x) with one Boolean per candidate task."""
    t = tasks.table
    m = cp_model.CpModel()
    # [START variables]
    x = [m.new_bool_var(f"x_{'FCB'[t.kind[k]]}{t.start[k]}_{t.end[k]}_{'r' if t.recompute[k] else 's'}"
                        f"{'g' if t.gpu_opt[k] else 'c'}") for k in range(len(t))]
    # [END variables]
    into, out = nodes(tasks)
    # [START path constraints]
    # exactly one criterion pack; a forward path 0 -> s and a backward path s -> 0 around it
    m.add_exactly_one(x[k] for k in np.flatnonzero(t.kind == C))
    for key in sorted(set(into) | set(out)):       # sorted: the same model in every process
        src = 1 if key == ("F", 0) else sum(x[k] for k in into.get(key, []))
        m.add(sum(x[k] for k in out.get(key, [])) == src)
    cpsat.stash_memory(m, tasks, {k: [xk] for k, xk in enumerate(x)})
    # [END path constraints]
    # [START objective]
    c = tasks.ticks()
    memcol, wbcol, cap = c["mem"], c["wb"], c["cap"]

    def s(ks, col):
        """sum_k x_k * col_k over ``ks`` (0 if no term)."""
        return sum(int(col[k]) * x[k] for k in ks if col[k])

    big = int(sum(int(c[f].max(initial=0)) for f in TIME_COLUMNS)) + 1
    gaps_f, gaps_b = [], []
    for key in sorted(set(into) | set(out)):
        ins, outs = into.get(key, []), out.get(key, [])
        gaps = gaps_f if key[0] == "F" else gaps_b
        if key == ("F", 0):
            # the chain's first task: its input and weights come in before anything computes
            g0 = m.new_int_var(0, big, "start")
            m.add(g0 >= s(outs, c["hop_in"]))
            m.add(g0 >= s(outs, c["w_load"]))
            gaps.append(g0)
            continue
        if not ins or not outs:
            continue
        g = m.new_int_var(0, big, f"gap_{key[0]}{key[1]}")
        # gap >= a's first output handed on, b's last input, b's weights prefetched while a computes
        m.add(g >= s(ins, c["p_first"] - c["load"]) + s(outs, c["hop_in"]))
        m.add(g >= s(outs, c["hop_in"] + c["p_last"] - c["load"]))
        m.add(g >= s(outs, c["w_load"]) - s(ins, c["load"]))
        m.add(g >= s(ins, c["tail"]) - s(outs, c["load"]))    # b's outputs queue behind a's gradients
        if int(memcol[ins].max()) + int(wbcol[outs].max()) > cap:
            pf = m.new_bool_var(f"prefetch_{key[0]}{key[1]}")      # b's weights fit beside a
            m.add(s(ins, memcol) + s(outs, wbcol) <= cap).only_enforce_if(pf)
            m.add(g >= s(ins, c["tail"]) + s(outs, c["w_load"])).only_enforce_if(~pf)
        if int(memcol[ins].max()) + int(memcol[outs].max()) > cap:
            ov = m.new_bool_var(f"overlap_{key[0]}{key[1]}")       # b's working set fits beside a
            m.add(s(ins, memcol) + s(outs, memcol) <= cap).only_enforce_if(ov)
            m.add(g >= s(ins, c["tail"])).only_enforce_if(~ov)
        gaps.append(g)
    rows = range(len(t))
    fwd_rows = [k for k in rows if t.kind[k] != B]
    bwd_rows = [k for k in rows if t.kind[k] == B]
    last = [k for k in rows if t.start[k] == 0 and t.kind[k] != F]
    chain_f = sum(gaps_f) + s(fwd_rows, c["load"])
    chain_b = sum(gaps_b) + s(bwd_rows, c["load"]) + s(last, c["tail"] + c["upd"])
    horizon = big * (len(gaps_f) + len(gaps_b) + 1) + int(c["load"].sum()) + 1
    horizon = max(horizon, int(c["link_in"].sum()), int(c["link_out"].sum())) * 2 + 1
    if tasks.host_bound:
        horizon = max(horizon, int(c["issuing"].sum()) + 1)
    cpsat.phase_objective(m, tasks, lambda col, mask: s(np.flatnonzero(mask), col), chain_f, chain_b, horizon)
    # [END objective]
    return m, x


def sequence(tasks: Tasks, chosen: set[int]) -> list[int]:
    """Chain order of a set of chosen tasks."""
    t = tasks.table
    ks = sorted(chosen)
    fwd = sorted((k for k in ks if t.kind[k] == F), key=lambda k: t.start[k])
    crit = [k for k in ks if t.kind[k] == C]
    bwd = sorted((k for k in ks if t.kind[k] == B), key=lambda k: -t.start[k])
    return fwd + crit + bwd


def solve(tasks: Tasks, *, time_limit: float = 5.0, seed: int = 0, workers: int = 1, rel_gap: float = 1e-3,
          hint: list[int] | None = None, report=None, label: str = "", wall_limit: float | None = None
          ) -> cpsat.SolveResult:
    """Solve one chain configuration; ``time_limit`` is in CP-SAT's deterministic seconds (reproducible),
    ``wall_limit`` in wall-clock seconds (not reproducible where it binds)."""
    m, x = build(tasks)
    if hint is not None:
        chosen = set(hint)
        cpsat.complete_hint(m, {xk: k in chosen for k, xk in enumerate(x)})

    def decode(value):
        return sequence(tasks, {k for k, xk in enumerate(x) if value(xk)})
    return cpsat.run(m, decode, time_limit=time_limit, seed=seed, workers=workers, rel_gap=rel_gap, report=report,
                     label=label, variables=len(x), wall_limit=wall_limit, ticks_per_s=tasks.ticks_per_s)
