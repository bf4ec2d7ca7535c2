"""Exact dynamic program for one chain (vDP or one GPU): the CP-SAT chain model's test oracle.

The chain objective (chain.py) is a sum of task loads and of gaps between consecutive tasks,
each gap a function of the two tasks only. So the best chain is a shortest path whose state
is the last task placed: walking the junctions in chain order (forward boundaries ascending,
then backward boundaries descending), the best cost of a chain ending with task b is the
minimum over the tasks a that can precede it of cost(a) + gap(a, b) + load(b).

The link floors (``T >= N * sum(h2d) / link`` and the forward queue, timing.py) are not sums
over pairs, and neither are the waits for the memory of the task two back (timing.two_back); the DP
leaves them out, so its optimum bounds CP-SAT's (which leaves out the last two too) and equals it
wherever the floors do not bind (the tests check both cases).
"""
from __future__ import annotations

import numpy as np

from .chain import nodes
from .tasks import F, Tasks
from .timing import chain_gap, evaluate


def pairs(tasks: Tasks) -> int:
    """How many (predecessor, task) pairs the DP weighs: its work."""
    into, out = nodes(tasks)
    return sum(len(into.get(key, ())) * len(v) for key, v in out.items())


def solve_chain(tasks: Tasks, relax_stash: bool = False, price: np.ndarray | None = None
                ) -> tuple[float, list[int]] | None:
    """(objective in seconds, task sequence) of the best chain, or None if no chain exists.

    Costs are integer ticks exactly as in the CP-SAT model. Stash variants are not handled (their
    memory couples forward packs to backward ones): call it on tasks built without them, or with
    ``relax_stash``, which leaves that coupling out: the optimum is then a lower bound on the
    model's over the plans with stash variants (its sequence may not fit). ``price``: ticks added to
    each task's cost (a Lagrangian multiplier times a resource it uses; the objective includes them)."""
    t = tasks.table
    if (~t.recompute).any() and not relax_stash:
        raise ValueError("the DP oracle does not handle stash variants; build the tasks with stash=False")
    c = tasks.ticks()
    load = c["load"] if price is None else c["load"] + price
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
                cost[k] = max(c["hop_in"][k], c["w_load"][k]) + load[k]
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
        best = total[arg, np.arange(len(outs))] + load[outs]
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
    return float(cost[end] + c["tail"][end] + c["upd"][end]) / tasks.ticks_per_s, seq[::-1]


def within_host(tasks: Tasks, first: tuple[float, list[int]] | None = None, afford=lambda: True, steps: int = 12,
                relax_stash: bool = False) -> tuple[float, list[int], float] | None:
    """(model value, sequence, bound) of the best chain found whose activation buffers fit the host
    memory left (``tasks.host_budget``), where the DP's optimum (``first``) may not: the DP on
    ``cost + lam * host`` per task, a Lagrangian relaxation of the budget, with lam doubled until its
    chain fits and then bisected; of the chains that fit, the best by the model. For every lam,
    DP(lam) - lam * budget bounds every chain that fits (prices rounded down), and so does the DP
    without prices. ``afford()`` is called before each DP and stops the search when it says no.
    None where even the chain of least host memory does not fit (or nothing fitting was found).
    With ``relax_stash`` (solve_chain) only the bound holds: a chain found may not fit the GPU."""
    host, budget = tasks.ticks()["host"], tasks.host_budget
    first = first or solve_chain(tasks, relax_stash)
    if first is None:
        return None
    if budget is None or host[first[1]].sum() <= budget:
        return evaluate(tasks, first[1]), first[1], first[0]
    bound, best = first[0], None

    def fits(lam):
        nonlocal bound, best
        r = solve_chain(tasks, relax_stash, price=np.floor(lam * host).astype(np.int64))
        if r is None:
            return False
        bound = max(bound, r[0] - lam * budget / tasks.ticks_per_s)
        if host[r[1]].sum() > budget:
            return False
        value = evaluate(tasks, r[1])
        if best is None or value < best[0]:
            best = (value, r[1])
        return True
    lo, hi = 0.0, first[0] * tasks.ticks_per_s / max(budget, 1) / 64          # ticks per MiB
    while True:
        if not afford():
            return None if best is None else (*best, bound)
        if fits(hi):
            break
        lo, hi = hi, 2 * hi
        if hi > 2**40:          # prices beyond every chain's time: none fits
            return None
    for _ in range(steps):
        if not afford():
            break
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return best[0], best[1], bound


def least_host(tasks: Tasks) -> int | None:
    """The least activation buffers (``host`` MiB) of any chain of ``tasks``, or None if there is no chain:
    the DP with each task's host memory priced above any chain's time."""
    c = tasks.ticks()
    dominant = int(sum(int(c[f].sum()) for f in ("load", "hop_in", "w_load", "tail", "upd"))) + 1
    r = solve_chain(tasks, relax_stash=True, price=c["host"] * dominant)
    return None if r is None else int(c["host"][r[1]].sum())
