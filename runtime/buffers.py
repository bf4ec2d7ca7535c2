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

Pageable host memory is kept once freed (:func:`keep_freed_memory`), as CUDA's caching allocator
keeps device memory, so that the CPU device's swaps and the CPU optimizer do not pay the operating
system for fresh pages every step.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

import torch

#: glibc's mallopt parameters (malloc.h) and the largest value it takes (an int).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _INT_MAX = -1, -3, 2**31 - 1


@functools.cache
def keep_freed_memory() -> bool:
    """Make glibc keep freed host memory in the process for reuse (process-wide; idempotent);
    returns whether it could (False without glibc: nothing changes).

    By default glibc maps each block above an adaptive threshold (at most 32 MB) fresh from the
    operating system and unmaps it when freed, so every swap-in of a large tensor on the CPU device,
    and every large gradient, paid a page fault per 4 KiB page: copying 206 MB (GPT-2 medium's
    embedding) into fresh memory ran at 2.8 GB/s against 7.2 GB/s into kept memory on this project's
    2-core test machine, and the same pack's weights took 0.35-2.3x their simulated time, by whether
    the blocks happened to be reused. ``profile``, ``probe`` and the executor all call this, so that
    what is measured is what runs."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    # a glibc that caps the threshold (at half its largest heap) still takes the dynamic one's top
    mapped = any(libc.mallopt(_M_MMAP_THRESHOLD, v) for v in (_INT_MAX, 32 * 2**20))
    return bool(libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX)) and mapped


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
