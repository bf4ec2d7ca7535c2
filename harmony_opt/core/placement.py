"""Harmony's task order and placement (HARMONY_REFERENCE.md 5.1-5.2): the one rule that the task
graph (sim/taskgraph.py), the compiler (compile/compiler.py) and Harmony's own scheduler
(harmony/graph.py) all follow, so that what is simulated is what is compiled and run.

The order is the same in both modes: the forward packs ascending, then the backward packs from the
last to the first, each followed by the update of its weights. In vPP one list is dealt round-robin
over the GPUs; in vDP every GPU runs the whole list on its share of the minibatch.
"""
from __future__ import annotations

from typing import NamedTuple

from .kinds import TaskKind
from .plan import Plan


def vpp_rank(kind: TaskKind, k: int, n_fwd: int, gpus: int) -> int:
    """vPP's round robin: the k-th forward (from 0) on GPU ``k mod N``; the k-th backward, counted
    from the last pack, and its update on ``(nF + k) mod N``."""
    return k % gpus if kind is TaskKind.FWD else (n_fwd + k) % gpus


class Placement(NamedTuple):
    """A task of Harmony's order for one copy (vDP: every replica's list is the same, on its own GPU)."""

    kind: TaskKind
    index: int                  # position in the order
    pack: tuple[int, int]
    rank: int
    bwd_index: int = -1         # the pack's index in plan.packs_bwd (B and U)

    def __str__(self) -> str:
        return f"{self.kind.value}[{self.pack[0]}-{self.pack[1]}]@{self.rank}"


def placement(plan: Plan) -> list[Placement]:
    """Harmony's order and placement of one copy: FWD packs ascending, then BWD packs from last to
    first, each followed by its UPD. vPP: dealt by :func:`vpp_rank`; vDP: rank 0's copy (every rank
    runs the same list on its data share)."""
    n = plan.gpus if plan.mode == "vPP" else 1
    nf = len(plan.packs_fwd)
    out = [Placement(TaskKind.FWD, k, p, vpp_rank(TaskKind.FWD, k, nf, n)) for k, p in enumerate(plan.packs_fwd)]
    for k, bi in enumerate(reversed(range(len(plan.packs_bwd)))):
        rank = vpp_rank(TaskKind.BWD, k, nf, n)
        out.append(Placement(TaskKind.BWD, len(out), plan.packs_bwd[bi], rank, bi))
        out.append(Placement(TaskKind.UPD, len(out), plan.packs_bwd[bi], rank, bi))
    return out
