"""Harmony's task graph (HARMONY_REFERENCE.md 3-4): the FWD/BWD/UPD tasks of a plan in Harmony's order,
their ranks, and the medium of every input and output, with the two vPP patches; and re-batching
between the forward's and the backward's microbatches."""
from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

import networkx as nx

from ..core.errors import PlanError
from ..core.kinds import Medium, TaskKind, Tensor
from ..core.placement import vpp_rank
from .packing import Packs, data_shares, split_microbatches


class Port(NamedTuple):
    """One input or output of a task: a tensor of layers first..last on a medium.

    ``peer`` is the index of the task on the other end (None for DAT and SHM).
    LOC ports name the BWD task that produced the gradient (or the UPD that consumes it).
    """

    tensor: Tensor
    first: int
    last: int
    medium: Medium
    peer: int | None = None


def compose_task_graph(mode: str, gpus: int, batch: int, num_layers: int, u_fwd: int, packs_fwd: Packs,
                       u_bwd: int, packs_bwd: Packs) -> nx.DiGraph:
    """Harmony's task graph for one candidate.

    Nodes are task indices with attributes ``kind`` (TaskKind), ``first``, ``last``,
    ``rank``, ``device`` ("GPU:n" / "CPU:n"), ``copy`` (vDP GPU copy), ``ubatchszs``,
    ``has_data``, ``has_criterion``, ``is_last_fwd``, ``inputs`` and ``outputs`` (tuples of
    :class:`Port`). An edge src -> dst exists for every input of dst that src provides;
    its ``ports`` attribute lists those inputs. ``G.graph`` holds the configuration,
    the per-copy microbatch lists and ``last_fwd_msg``.
    """
    R = num_layers
    vpp = mode == "vPP"
    shares = [batch] if vpp else data_shares(batch, gpus)
    fwd = tuple(tuple(p) for p in packs_fwd)
    bwd = tuple(tuple(p) for p in packs_bwd)
    last_fwd_msg = vpp and gpus > 1 and u_fwd != u_bwd and bool(fwd)
    G = nx.DiGraph(mode=mode, gpus=gpus, batch=batch, num_layers=R, u_fwd=u_fwd, u_bwd=u_bwd,
                   packs_fwd=fwd, packs_bwd=bwd, last_fwd_msg=last_fwd_msg,
                   ubatchszs_fwd=[split_microbatches(s, u_fwd) for s in shares],
                   ubatchszs_bwd=[split_microbatches(s, u_bwd) for s in shares])
    # Order: FWD packs ascending, then from the last BWD pack down, each BWD with its UPD (jit update).
    order = [(TaskKind.FWD, p) for p in fwd]
    for p in reversed(bwd):
        order += [(TaskKind.BWD, p), (TaskKind.UPD, p)]
    nF, per_copy = len(fwd), len(order)
    for n, share in enumerate(shares):
        base = n * per_copy
        ranks = [_rank(k, kind, nF, gpus) if vpp else n for k, (kind, _) in enumerate(order)]
        ub = {TaskKind.FWD: tuple(split_microbatches(share, u_fwd)),
              TaskKind.BWD: tuple(split_microbatches(share, u_bwd)), TaskKind.UPD: ()}
        fwd_of = {l: base + k for k, (kind, (a, b)) in enumerate(order) if kind is TaskKind.FWD
                  for l in range(a, b + 1)}
        bwd_first = {a: base + k for k, (kind, (a, _)) in enumerate(order) if kind is TaskKind.BWD}
        tasks = [_task_ports(k, kind, a, b, base, ranks, R, fwd_of, bwd_first)
                 for k, (kind, (a, b)) in enumerate(order)]
        if vpp:
            _pin_jit_weights(tasks, order, ranks, base, gpus)
            if last_fwd_msg:
                _last_fwd_to_msg(tasks, nF)
        for k, (kind, (a, b)) in enumerate(order):
            ins, outs = tasks[k]
            G.add_node(base + k, kind=kind, first=a, last=b, rank=ranks[k], copy=n,
                       device=f"{'CPU' if kind is TaskKind.UPD else 'GPU'}:{ranks[k]}",
                       ubatchszs=ub[kind], has_data=a == 0, has_criterion=b == R - 1,
                       is_last_fwd=kind is TaskKind.FWD and k == nF - 1,
                       inputs=tuple(ins), outputs=tuple(outs))
        for k in range(per_copy):
            for port in tasks[k][0]:
                if port.peer is not None:
                    if not G.has_edge(port.peer, base + k):
                        G.add_edge(port.peer, base + k, ports=[])
                    G.edges[port.peer, base + k]["ports"].append(port)
    return G


def _rank(k: int, kind: TaskKind, nF: int, gpus: int) -> int:
    """vPP's placement (core.placement.vpp_rank) of the k-th task of Harmony's list, whose backward
    tasks are each followed by their update."""
    return vpp_rank(kind, k if kind is TaskKind.FWD else (k - nF - (kind is TaskKind.UPD)) // 2, nF, gpus)


def _task_ports(k, kind, a, b, base, ranks, R, fwd_of, bwd_first) -> tuple[list[Port], list[Port]]:
    """Inputs and outputs of task k (5.3): P2P to a task on another rank, else a local swap."""
    idx = base + k

    def near(j):
        return Medium.P2P if ranks[j] != ranks[k] else Medium.SWP

    ins: list[Port] = []
    outs: list[Port] = []
    if kind is TaskKind.FWD:
        ins.append(Port(Tensor.X, a, a, Medium.DAT) if a == 0 else Port(Tensor.X, a, a, near(k - 1), idx - 1))
        ins += [Port(Tensor.W, a, b, Medium.SHM), Port(Tensor.B, a, b, Medium.SHM)]
        outs.append(Port(Tensor.Y, b, b, near(k + 1), idx + 1))
        outs += [Port(Tensor.SX, l, l, Medium.MSG, bwd_first[l]) for l in range(a, b + 1) if l in bwd_first]
    elif kind is TaskKind.BWD:
        if b == R - 1:
            ins.append(Port(Tensor.X, a, a, Medium.DAT) if a == 0 else Port(Tensor.X, a, a, near(k - 1), idx - 1))
            ins.append(Port(Tensor.T, R - 1, R - 1, Medium.DAT))
        else:
            ins.append(Port(Tensor.DY, b, b, near(k - 2), idx - 2))
            ins.append(Port(Tensor.X, a, a, Medium.MSG, fwd_of[a]))
        ins += [Port(Tensor.W, a, b, Medium.SHM), Port(Tensor.B, a, b, Medium.SHM)]
        if a != 0:
            outs.append(Port(Tensor.DX, a, a, near(k + 2), idx + 2))
        outs += [Port(Tensor.DW, a, b, Medium.LOC, idx + 1), Port(Tensor.B, a, b, Medium.SHM)]
    else:
        ins += [Port(Tensor.DW, a, b, Medium.LOC, idx - 1), Port(Tensor.W, a, b, Medium.SHM),
                Port(Tensor.K, a, b, Medium.SHM)]
        outs += [Port(Tensor.W, a, b, Medium.SHM), Port(Tensor.K, a, b, Medium.SHM)]
    return ins, outs


def _pin_jit_weights(tasks, order, ranks, base, gpus) -> None:
    """vPP patch 1: on each GPU, W and B of layers shared by its last FWD and first BWD stay pinned.

    It changes media only; the simulator's estimate does not depend on it.
    """
    for g in range(gpus):
        f = [k for k, (kind, _) in enumerate(order) if kind is TaskKind.FWD and ranks[k] == g]
        w = [k for k, (kind, _) in enumerate(order) if kind is TaskKind.BWD and ranks[k] == g]
        if not f or not w:
            continue
        kf, kb = f[-1], w[0]
        (fa, fb), (ba, bb) = order[kf][1], order[kb][1]
        lo, hi = max(fa, ba), min(fb, bb)
        if lo > hi:
            continue
        ins_f, outs_f = tasks[kf]
        ins_b, _ = tasks[kb]
        for t in (Tensor.W, Tensor.B):
            outs_f.append(Port(t, lo, hi, Medium.PIN, base + kb))
            i = next(j for j, p in enumerate(ins_b) if p.tensor is t)
            pieces = ([Port(t, ba, lo - 1, Medium.SHM)] if lo > ba else []) + \
                [Port(t, lo, hi, Medium.PIN, base + kf)] + \
                ([Port(t, hi + 1, bb, Medium.SHM)] if hi < bb else [])
            ins_b[i:i + 1] = pieces


def _last_fwd_to_msg(tasks, nF) -> None:
    """vPP patch 2: P2P cannot re-batch, so the last FWD's Y goes to the loss BWD through MSG."""
    outs = tasks[nF - 1][1]
    ins = tasks[nF][0]
    for lst, t in ((outs, Tensor.Y), (ins, Tensor.X)):
        i = next(j for j, p in enumerate(lst) if p.tensor is t)
        if lst[i].medium is Medium.P2P:
            lst[i] = lst[i]._replace(medium=Medium.MSG)


def _port(ports: Iterable[Port], tensor: Tensor) -> Port | None:
    return next((p for p in ports if p.tensor is tensor), None)


class Rebatch(NamedTuple):
    """How FWD microbatches become BWD microbatches when u_fwd != u_bwd.

    ``targets[i]``: the (BWD index, BWD size) that FWD microbatch i completes;
    ``producer[j]``: the FWD microbatch that completes BWD microbatch j.
    """

    targets: tuple[tuple[tuple[int, int], ...], ...]
    producer: tuple[int, ...]


def rebatch(fwd_sizes: Sequence[int], bwd_sizes: Sequence[int], u_bwd: int) -> Rebatch:
    """Walk the FWD microbatches with a carried residual and cut them into BWD microbatches."""
    if sum(fwd_sizes) != sum(bwd_sizes):
        raise PlanError(f"re-batching needs equal totals, got FWD {sum(fwd_sizes)} and BWD {sum(bwd_sizes)}")
    targets, producer = [], []
    r = 0
    for i, u in enumerate(fwd_sizes):
        c = r + u
        chunks = split_microbatches(c, u_bwd) if c >= u_bwd else [c]
        r = 0
        done = []
        for j, chunk in enumerate(chunks):
            if len(producer) >= len(bwd_sizes):
                raise PlanError(f"re-batching FWD {list(fwd_sizes)} into BWD {list(bwd_sizes)} overruns")
            want = bwd_sizes[len(producer)]
            if chunk == want:
                done.append((len(producer), chunk))
                producer.append(i)
            elif chunk < want and j == len(chunks) - 1:
                r = chunk
            else:
                raise PlanError(f"re-batching FWD {list(fwd_sizes)} into BWD {list(bwd_sizes)}: chunk {chunk} "
                                f"does not match BWD microbatch {len(producer)} of size {want}")
        targets.append(tuple(done))
    if len(producer) != len(bwd_sizes):
        raise PlanError(f"re-batching FWD {list(fwd_sizes)} leaves BWD microbatches unfilled")
    return Rebatch(tuple(targets), tuple(producer))
