"""A pack's autograd graph for one microbatch, kept between its forward and its backward.

A recompute (REC) builds the graph right before the backward; a pack with recompute off
builds it during the forward phase (FWD with tensor sA) and keeps it with every saved
tensor moved to host memory by ``saved_tensors_hooks``, until the backward swaps them
back in (swap-in sA). In both cases the graph keeps only what the backward needs:

* the gradient edge of the pack's output (not the output itself, whose memory the next
  pack's input frees);
* the leaves to differentiate against: the pack's input and its device weights;
* (offloaded graphs) the host copies of saved activations, made on the swap-out stream
  while the forward goes on (as the simulator plays them: beside compute, the memory of
  each held until its copy has read it), with an event the swap-in waits for. Saved *weights* are not
  copied: the hook records which parameter and view they are, and the unpack hook
  rebuilds the view from the weights swapped in for the backward, so a stashed pack
  holds no copy of its weights. Saved tensors that are not on the compute device stay
  as they are: attention's dropout seed and offset live on the CPU, and the backward
  reads them there (moved to the GPU, they crashed the process).

The leaves of an offloaded graph are freed with ``untyped_storage().resize_(0)`` (the
way FSDP frees parameters): autograd needs their shapes, not their data, to return
gradients for them.
"""
from __future__ import annotations

import time

from typing import Callable

import torch
from torch.autograd.graph import get_gradient_edge

from harmony_opt.core.units import alloc_bytes

from .buffers import host_copy


class _Saved:
    """A saved activation: a host copy, and a device copy while the backward needs it."""

    __slots__ = ("host", "device")

    def __init__(self, host: torch.Tensor):
        self.host, self.device = host, None


class _ParamView:
    """A saved view of a weight: which one, and the view's geometry."""

    __slots__ = ("layer", "name", "size", "stride", "offset")

    def __init__(self, layer, name, t: torch.Tensor):
        self.layer, self.name = layer, name
        self.size, self.stride, self.offset = t.size(), t.stride(), t.storage_offset()


class PackGraph:
    """Everything the backward of one pack on one microbatch needs (see module docstring)."""

    def __init__(self, output: torch.Tensor, inputs: list[torch.Tensor], params: list[tuple[int, str]],
                 saved_bytes: int = 0, saved: list[_Saved] | None = None, copied: torch.cuda.Event | None = None):
        self.edge = get_gradient_edge(output) if output.requires_grad else None
        self.inputs = inputs            # autograd leaves: the pack's input, then its weights
        self.params = params            # (layer, name) of each weight leaf
        self.saved = saved              # None: the graph holds its saved tensors on the device
        self.saved_bytes = saved_bytes
        self.copied = copied            # CUDA: the host copies of ``saved`` are complete after it
        self.weights: Callable[[int, str], torch.Tensor] | None = None

    @property
    def device_bytes(self) -> int:
        return self.alloc_bytes()

    def alloc_bytes(self, granularity: int = 1) -> int:
        """Device bytes the graph holds, each saved tensor rounded up to ``granularity`` (a recompute's
        graph was counted with its :class:`CountSaved`'s granularity)."""
        if self.saved is None:
            return self.saved_bytes
        return sum(alloc_bytes(s.device.numel() * s.device.element_size(), granularity)
                   for s in self.saved if s.device is not None)

    def to_device(self, device: torch.device) -> None:
        """Copy the saved activations back, on the current stream, after their copies out."""
        if self.copied is not None:
            torch.cuda.current_stream(device).wait_event(self.copied)
        for s in self.saved:
            s.device = torch.empty_like(s.host, device=device).copy_(s.host, non_blocking=True)

    def release(self) -> None:
        """Drop device copies (the graph itself goes with its last reference)."""
        if self.saved is not None:
            for s in self.saved:
                s.device = None

    def gradients(self, grad_output: torch.Tensor | None) -> list[torch.Tensor | None]:
        """Gradients of every leaf (None where the output does not depend on it)."""
        if self.edge is None:
            return [None] * len(self.inputs)
        wanted = [(i, t) for i, t in enumerate(self.inputs) if t.requires_grad]
        grads = torch.autograd.grad([self.edge], [t for _, t in wanted],
                                    grad_outputs=None if grad_output is None else [grad_output],
                                    allow_unused=True)
        out: list[torch.Tensor | None] = [None] * len(self.inputs)
        for (i, _), g in zip(wanted, grads):
            out[i] = g
        return out


class Offload:
    """``saved_tensors_hooks`` pair that moves saved activations to host and references weights."""

    def __init__(self, weights: dict[int, tuple[int, str]], device: torch.device,
                 out_stream: torch.cuda.Stream | None = None, timed: bool = False):
        self.weights = weights          # storage data_ptr -> (layer, name)
        self.device = device            # where the pack computes: only what lives there moves out
        self.out_stream = out_stream    # CUDA: where the copies to the host run (None: in line)
        self.timed = timed              # record when the copies start (``started``) for a trace
        self.started: torch.cuda.Event | None = None
        self.inline_s = 0.0             # traced copies run in line (the CPU device): their summed seconds
        self.saved: list[_Saved] = []
        self.graph: PackGraph | None = None

    def pack(self, t: torch.Tensor):
        if t.device != self.device:
            return t
        ref = self.weights.get(t.untyped_storage().data_ptr())
        if ref is not None:
            return _ParamView(ref[0], ref[1], t)
        s = _Saved(self._out(t.detach()))
        self.saved.append(s)
        return s

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        """The host copy of ``t``: on the CUDA swap-out stream once what computed ``t`` is done, so
        the forward does not wait for it; ``t``'s memory is reused only after the copy read it."""
        if self.out_stream is None or not t.is_cuda:
            if not self.timed:
                return host_copy(t)
            start = time.perf_counter()
            host = host_copy(t)
            self.inline_s += time.perf_counter() - start
            return host
        self.out_stream.wait_stream(torch.cuda.current_stream(t.device))
        if self.timed and self.started is None:
            self.started = torch.cuda.Event(enable_timing=True)
            self.started.record(self.out_stream)
        with torch.cuda.stream(self.out_stream):
            host = host_copy(t)
        t.record_stream(self.out_stream)
        return host

    def copied(self) -> torch.cuda.Event | None:
        """An event after every copy to the host made so far (None where they ran in line)."""
        if self.out_stream is None or not self.saved:
            return None
        ev = torch.cuda.Event(enable_timing=self.started is not None)
        ev.record(self.out_stream)
        return ev

    def unpack(self, h):
        if isinstance(h, torch.Tensor):
            return h
        if isinstance(h, _ParamView):
            return self.graph.weights(h.layer, h.name).as_strided(h.size, h.stride, h.offset)
        if h.device is None:
            raise RuntimeError("a saved activation is used before it was swapped in (swap-in sA missing)")
        return h.device


class CountSaved:
    """``saved_tensors_hooks`` pair that only counts the bytes a recompute keeps on the device, each
    storage rounded up to the allocator's ``granularity``."""

    def __init__(self, exclude: set[int], granularity: int = 1):
        self.exclude = set(exclude)     # storages not to count: weights and the input
        self.granularity = granularity
        self.bytes = 0

    def pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in self.exclude:
            self.exclude.add(st.data_ptr())
            self.bytes += alloc_bytes(st.nbytes(), self.granularity)
        return t

    @staticmethod
    def unpack(t):
        return t
