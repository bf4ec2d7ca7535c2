"""Exact dynamic program for the one-chain packing subproblem (the CP-SAT oracle in tests).

With one chain (N = 1 or vDP) and no shared-link constraint binding, the objective in
objective.py is a sum of per-pack constants, so the best packing is two shortest paths
over layer boundaries (forward packs 0 -> s, backward packs 0 -> s) plus the criterion
pack [s, R-1], minimized over s.
"""
from __future__ import annotations

import numpy as np

from .arcs import Arcs
from .objective import SCALE


def _shortest(arcs: Arcs, cost: np.ndarray, R: int) -> tuple[np.ndarray, np.ndarray]:
    """dist[v] = cheapest path of packs covering layers 0..v-1; pred[v] = the arc entering v."""
    dist = np.full(R + 1, np.inf)
    pred = np.full(R + 1, -1)
    dist[0] = 0.0
    order = np.lexsort((arcs.end, arcs.start))
    for k in order:  # arcs sorted by start: dist[start] is final when we reach it
        a, b = int(arcs.start[k]), int(arcs.end[k])
        c = dist[a] + cost[k]
        if c < dist[b + 1]:
            dist[b + 1], pred[b + 1] = c, k
    return dist, pred


def _path(arcs: Arcs, pred: np.ndarray, v: int) -> list[tuple[int, int]]:
    out = []
    while v > 0:
        k = int(pred[v])
        out.append((int(arcs.start[k]), int(arcs.end[k])))
        v = int(arcs.start[k])
    return out[::-1]


def solve_chain(fwd: Arcs, bwd: Arcs, crit: Arcs, R: int, integer: bool = True):
    """Minimum of sum(task) + first_load + tail; returns (objective, fwd packs, bwd packs) or None.

    ``integer`` rounds each arc's cost to microseconds exactly as the CP-SAT model does.
    """
    def cost(a: Arcs):
        c = a.task + a.first_load + a.tail
        return np.round(c * SCALE) if integer else c
    df, pf = _shortest(fwd, cost(fwd), R)
    db, pb = _shortest(bwd, cost(bwd), R)
    cc = cost(crit)
    best = None
    for k in range(len(crit)):
        s = int(crit.start[k])
        # the first pack overall is the criterion pack itself when s == 0
        total = cc[k] + (0.0 if s == 0 else df[s] + db[s])
        if s > 0 and crit.first_load[k] == 0 and not np.isfinite(total):
            continue
        if np.isfinite(total) and (best is None or total < best[0]):
            best = (total, s)
    if best is None:
        return None
    total, s = best
    packs_f = _path(fwd, pf, s) if s > 0 else []
    packs_b = (_path(bwd, pb, s) if s > 0 else []) + [(s, R - 1)]
    return (total / SCALE if integer else total), packs_f, packs_b
