"""Messages between ranks: torch.distributed point-to-point and all-reduce.

Gloo (CPU) matches a receive to its send by tag, so one process group serves every
message. NCCL ignores tags and runs all operations of one communicator in issue order
on one stream, so a send blocked on its receive would block unrelated messages behind
it; each message channel (source, destination, class: act, stash or grad) therefore
gets its own two-rank group, and the compiler keeps sends and receives in the same
order on each channel (``validate_program`` checks it). A separate Gloo group carries
control traffic (losses, barriers, checkpoint gathering) whatever the data backend.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from harmony_opt.compile.program import Kind, Program, channel


def program_channels(program: Program) -> list[tuple[int, int, str]]:
    """Every (src, dst, class) channel the program uses, in a fixed order (groups are created in it)."""
    return sorted({channel(x, r) for r, ins in enumerate(program.ranks) for x in ins if x.kind is Kind.SEND})


class Comm:
    """The communication of one rank; ``None`` stands for it in single-rank runs."""

    def __init__(self, rank: int, world: int, backend: str, program: Program, timeout_s: float = 300.0):
        self.rank, self.world, self.backend = rank, world, backend
        self.local_rank = rank          # the GPU index: the rank, as the local launcher runs one machine
        self.ctrl = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.groups = {}
        if backend == "nccl":
            for ch in program_channels(program):
                self.groups[ch] = dist.new_group(ranks=sorted(ch[:2]), timeout=timedelta(seconds=timeout_s))

    def _group(self, src: int, dst: int, cls: str):
        return self.groups.get((src, dst, cls))

    def isend(self, t: torch.Tensor, peer: int, tag: int, cls: str):
        return dist.isend(t, dst=peer, tag=tag, group=self._group(self.rank, peer, cls))

    def irecv(self, t: torch.Tensor, peer: int, tag: int, cls: str):
        return dist.irecv(t, src=peer, tag=tag, group=self._group(peer, self.rank, cls))

    def all_reduce(self, tensors: list[torch.Tensor]) -> None:
        """Sum ``tensors`` over the ranks, in place. On Gloo (host tensors) they go as one flat buffer
        per dtype, as DDP buckets them: one call per tensor cost a GPT-2 block's 12 gradients 18 ms
        between two CPU ranks, one call 2.3 ms, and the simulator prices one all-reduce of the pack's
        bytes. On NCCL one call per tensor: a flat buffer would add device memory the plan does not count."""
        if self.backend != "gloo" or len(tensors) < 2 or any(t.device.type != "cpu" for t in tensors):
            for t in tensors:
                dist.all_reduce(t)
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])
            dist.all_reduce(flat)
            for t, part in zip(group, flat.split([t.numel() for t in group])):
                t.copy_(part.view_as(t))

    def sum_float(self, x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, group=self.ctrl)
        return float(t.item())

    def gather_objects(self, obj) -> list | None:
        out = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0, group=self.ctrl)
        return out

    def after_step(self, everything: bool) -> None:
        """Called by every rank after each step; the shared host memory of the local launcher already
        holds every update (runtime.launch keeps separate copies equal here)."""

    def barrier(self) -> None:
        dist.barrier(group=self.ctrl)

    @staticmethod
    def backend_in_use() -> str:
        """The backend of the default process group, as torch.distributed reports it."""
        return str(dist.get_backend())
