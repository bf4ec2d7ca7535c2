"""Parameters shared by several layers (tied weights), updated once from the sum of their gradients.

A Hugging Face LM ties its LM head to the token embedding: after decomposition the embedding
layer and the head layer hold the same ``nn.Parameter``. Each layer still gets its own device
copy and its own dW (the executor runs layers with ``functional_call``), so without care the
packs holding the two layers would each step the shared weight with half of its gradient.

The rule here: the host master copy is the one tensor both layers hold; the optimizer state
lives with the *owner*, the copy whose pack's update comes last in the rank's program (for an
embedding and a head: the embedding's pack, since backward runs from the last pack to the
first). The other copies' packs leave the parameter out of their optimizers; their dW still
goes to host gradient buffers, and the owner's update sums every copy's buffer into one
gradient before its single step. Both layers read the updated master in the next iteration.

That is exact only when every copy's dW is in host memory before the owner's step: the packs
holding the copies must be updated on one rank, on the CPU, with each other copy's dW swap-out
before the owner's update in that rank's list. :func:`tie_schedule` checks this for a Program
and refuses any other shape with a :class:`ProgramError` saying what to change.
"""
from __future__ import annotations

import dataclasses

from torch import nn

from harmony_opt.core.errors import ProgramError
from harmony_opt.core.kinds import Tensor
from harmony_opt.compile.program import Kind, Program, Stream

Copy = tuple[int, str]      # (layer, parameter name within the layer)


def tied_groups(layers: list[nn.Module]) -> list[tuple[Copy, ...]]:
    """Groups of two or more (layer, name) that hold the same trainable ``nn.Parameter``, in layer order.

    Identity is the Parameter object (what ``tie_weights`` makes and what pickling to rank processes
    keeps); a parameter repeated inside one layer is one copy (``named_parameters`` lists it once)."""
    by_id: dict[int, list[Copy]] = {}
    for l, layer in enumerate(layers):
        for n, p in layer.named_parameters():
            if p.requires_grad:
                by_id.setdefault(id(p), []).append((l, n))
    return [tuple(g) for g in by_id.values() if len({l for l, _ in g}) > 1]


@dataclasses.dataclass
class Ties:
    """One rank's part of the rule: which copies it steps for whom, and what its owners' updates wait for."""

    others: dict[Copy, list[Copy]] = dataclasses.field(default_factory=dict)   # owner -> the other copies
    skip: set[Copy] = dataclasses.field(default_factory=set)                   # copies no optimizer steps
    waits: dict[int, list[int]] = dataclasses.field(default_factory=dict)      # owner's U id -> other dW swap-outs


def tie_schedule(program: Program, layers: list[nn.Module], rank: int | None = None) -> Ties:
    """Check that ``program`` can update every tied parameter of ``layers`` exactly; return ``rank``'s
    part (all ranks are checked; ``rank=None`` checks only)."""
    mine = Ties()
    for group in tied_groups(layers):
        where = [_update_of(program, l, group) for l, _ in group]        # (rank, index of U) per copy
        name = " and ".join(f"layer {l} {n!r}" for l, n in group)
        ranks = {r for r, _ in where}
        if len(ranks) > 1:
            packs = ", ".join(f"{_pack(program, r, i)} on rank {r}" for r, i in where)
            raise ProgramError(f"{name} are one tied parameter, but the packs holding them are updated on different "
                               f"ranks ({packs}); a tied parameter is updated once, on one rank: choose packs "
                               f"(or a rank count) that put them on the same rank, or untie the weights")
        r = ranks.pop()
        instrs = program.ranks[r]
        for (_, i), (l, n) in zip(where, group):
            if instrs[i].stream is not Stream.CPU:
                raise ProgramError(f"{name} are one tied parameter, but the pack {_pack(program, r, i)} holding "
                                   f"layer {l} steps its optimizer on the GPU; packs holding a tied parameter "
                                   f"need optimizer 'cpu'")
        last = max(i for _, i in where)
        owner = next(c for (_, i), c in zip(where, group) if i == last)
        waits = []
        for (_, i), (l, n) in zip(where, group):
            outs = [k for k, x in enumerate(instrs) if x.kind is Kind.SWAP_OUT and x.tensor is Tensor.DW
                    and x.layers[0] <= l <= x.layers[1]]
            late = [k for k in outs if k > last]
            if late:
                raise ProgramError(f"{name} are one tied parameter, but on rank {r} the gradient of layer {l} "
                                   f"({instrs[late[0]]}) reaches the host after the update of the owner's pack "
                                   f"({instrs[last]}); choose packs whose backward order allows one update")
            if (l, n) != owner:
                waits += [instrs[k].id for k in outs]
        if r == rank:
            mine.others[owner] = [c for c in group if c != owner]
            mine.skip |= {c for c in group if c != owner}
            mine.waits.setdefault(instrs[last].id, []).extend(waits)
    return mine


def _update_of(program: Program, layer: int, group) -> tuple[int, int]:
    hits = [(r, i) for r, instrs in enumerate(program.ranks) for i, x in enumerate(instrs)
            if x.kind is Kind.UPD and x.layers[0] <= layer <= x.layers[1]]
    if len(hits) != 1:
        raise ProgramError(f"layer {layer} holds a tied parameter ({group[0][1]!r}) but the program updates it "
                           f"{len(hits)} times per iteration; tied parameters need one update per layer")
    return hits[0]


def _pack(program: Program, rank: int, i: int) -> str:
    a, b = program.ranks[rank][i].layers
    return f"{a}-{b}"
