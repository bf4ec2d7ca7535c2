"""Host memory of the executor: pinned buffers allocated once and reused every iteration.

Activations that pass through the host (a pack's output on its way to the next pack on
the same rank, a backward pack's stashed input, gradients between backward packs) live
in one buffer per (kind, boundary layer) holding every sample of the rank; a microbatch
is a row range of it. That is what makes re-batching between different forward and
backward microbatch sizes free: a producer writes its rows, a consumer reads its own.
The buffers are allocated on first use and reused as long as the shape stays the same.

Memory is pinned (page-locked) only when CUDA is available, so that copies to and from
the GPU are asynchronous; on a CPU-only machine pinning is impossible and useless.
Host memory shared between processes (the master weights in multi-GPU runs) cannot be
re-allocated as pinned memory, so :func:`pin_in_place` registers it with CUDA instead.
"""
from __future__ import annotations

import torch


def can_pin() -> bool:
    return torch.cuda.is_available()


def host_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized host tensor, pinned when CUDA is available."""
    return torch.empty(shape, dtype=dtype, pin_memory=can_pin())


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A (pinned) host copy of ``t``; asynchronous from a GPU, ordered on the current stream."""
    out = host_empty(t.shape, t.dtype)
    out.copy_(t, non_blocking=t.is_cuda)
    return out


def pin_in_place(t: torch.Tensor) -> bool:
    """Page-lock an existing host tensor's memory (e.g. shared memory) without copying it."""
    if not can_pin() or t.is_pinned() or t.numel() == 0:
        return False
    storage = t.untyped_storage()
    err = torch.cuda.cudart().cudaHostRegister(storage.data_ptr(), storage.nbytes(), 0)
    return int(err) == 0


class HostBuffers:
    """Named host buffers with one row per sample of the rank."""

    def __init__(self, samples: int):
        self.samples = samples
        self._bufs: dict[tuple, torch.Tensor] = {}

    def get(self, name: tuple) -> torch.Tensor:
        try:
            return self._bufs[name]
        except KeyError:
            raise KeyError(f"host buffer {'/'.join(map(str, name))} was never written") from None

    def for_rows(self, name: tuple, like: torch.Tensor) -> torch.Tensor:
        """The whole buffer ``name``, shaped like ``like`` with the rank's samples as rows."""
        shape = (self.samples,) + tuple(like.shape[1:])
        buf = self._bufs.get(name)
        if buf is None or buf.shape != shape or buf.dtype != like.dtype:
            buf = self._bufs[name] = host_empty(shape, like.dtype)
        return buf

    def stage(self, name: tuple, t: torch.Tensor) -> torch.Tensor:
        """Copy ``t`` (e.g. this iteration's data) into the persistent buffer ``name``."""
        buf = self._bufs.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = self._bufs[name] = host_empty(t.shape, t.dtype)
        buf.copy_(t)
        return buf
