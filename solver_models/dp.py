"""Exact dynamic program for one chain (vDP or one GPU): the CP-SAT chain model's test oracle.

The chain objective (chain.py) is a sum of task loads and of gaps between consecutive tasks,
each gap a function of the two tasks only. So the best chain is a shortest path whose state
is the last task placed: walking the junctions in chain order (forward boundaries ascending,
then backward boundaries descending), the best cost of a chain ending with task b is the
minimum over the tasks a that can precede it of cost(a) + gap(a, b) + load(b).

The link floor ``T >= N * sum(h2d) / link`` is not a sum over pairs; the DP leaves it out, so
its optimum equals CP-SAT's wherever the floor does not bind (the tests check both cases).
"""
from __future__ import annotations

import numpy as np

from .chain import nodes
from .tasks import F, TICKS_PER_S, Tasks
from .timing import chain_gap


def pairs(tasks: Tasks) -> int:
    """How many (predecessor, task) pairs the DP weighs: its work."""
    into, out = nodes(tasks)
    return sum(len(into.get(key, ())) * len(v) for key, v in out.items())


def solve_chain(tasks: Tasks, relax_stash: bool = False) -> tuple[float, list[int]] | None:
    """(objective in seconds, task sequence) of the best chain, or None if no chain exists.

    Costs are integer ticks exactly as in the CP-SAT model. Stash variants are not handled (their
    memory couples forward packs to backward ones): call it on tasks built without them, or with
    ``relax_stash``, which leaves that coupling out: the optimum is then a lower bound on the
    model's over the plans with stash variants (its sequence may not fit)."""
    t = tasks.table
    if (~t.recompute).any() and not relax_stash:
        raise ValueError("the DP oracle does not handle stash variants; build the tasks with stash=False")
    c = tasks.ticks()
    mem, wb, cap = c["mem"], c["wb"], c["cap"]
    ok = t.mem <= tasks.cap
    into, out = nodes(tasks)
    R = tasks.num_layers
    INF = np.iinfo(np.int64).max // 4
    cost = np.full(len(t), INF, np.int64)
    pred = np.full(len(t), -1)
    order = [("F", v) for v in range(R + 1)] + [("B", v) for v in range(R, 0, -1)]
    for key in order:
        outs = [k for k in out.get(key, []) if ok[k]]
        if not outs:
            continue
        if key == ("F", 0):
            for k in outs:
                cost[k] = max(c["hop_in"][k], c["w_load"][k]) + c["load"][k]
            continue
        ins = np.array([k for k in into.get(key, []) if ok[k] and cost[k] < INF], int)
        if len(ins) == 0:
            continue
        outs = np.array(outs, int)
        a, b = ins[:, None], outs[None, :]
        gap = chain_gap(c["p_first"][a], c["load"][a], c["tail"][a], mem[a], c["hop_in"][b], c["p_last"][b],
                        c["load"][b], c["w_load"][b], wb[b], mem[b], cap)
        total = cost[a] + gap                       # [in, out]
        arg = np.argmin(total, axis=0)              # first minimum: the lowest-numbered predecessor
        best = total[arg, np.arange(len(outs))] + c["load"][outs]
        better = best < cost[outs]
        cost[outs[better]] = best[better]
        pred[outs[better]] = ins[arg[better]]
    last = [k for k in range(len(t)) if t.start[k] == 0 and t.kind[k] != F and cost[k] < INF]
    if not last:
        return None
    end = min(last, key=lambda k: (cost[k] + c["tail"][k] + c["upd"][k], k))
    seq = [end]
    while pred[seq[-1]] >= 0:
        seq.append(int(pred[seq[-1]]))
    return float(cost[end] + c["tail"][end] + c["upd"][end]) / TICKS_PER_S, seq[::-1]
