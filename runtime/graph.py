"""A pack's autograd graph for one microbatch, kept between its forward and its backward.

A recompute (REC) builds the graph right before the backward; a pack with recompute off
builds it during the forward phase (FWD with tensor sA) and keeps it with every saved
tensor moved to host memory by ``saved_tensors_hooks``, until the backward swaps them
back in (swap-in sA). In both cases the graph keeps only what the backward needs:

* the gradient edge of the pack's output (not the output itself, whose memory the next
  pack's input frees);
* the leaves to differentiate against: the pack's input and its device weights;
* (offloaded graphs) the host copies of saved activations. Saved *weights* are not
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

from typing import Callable

import torch
from torch.autograd.graph import get_gradient_edge

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
                 saved_bytes: int = 0, saved: list[_Saved] | None = None):
        self.edge = get_gradient_edge(output) if output.requires_grad else None
        self.inputs = inputs            # autograd leaves: the pack's input, then its weights
        self.params = params            # (layer, name) of each weight leaf
        self.saved = saved              # None: the graph holds its saved tensors on the device
        self.saved_bytes = saved_bytes
        self.weights: Callable[[int, str], torch.Tensor] | None = None

    @property
    def device_bytes(self) -> int:
        if self.saved is None:
            return self.saved_bytes
        return sum(s.device.numel() * s.device.element_size() for s in self.saved if s.device is not None)

    def to_device(self, device: torch.device) -> None:
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

    def __init__(self, weights: dict[int, tuple[int, str]], device: torch.device):
        self.weights = weights          # storage data_ptr -> (layer, name)
        self.device = device            # where the pack computes: only what lives there moves out
        self.saved: list[_Saved] = []
        self.graph: PackGraph | None = None

    def pack(self, t: torch.Tensor):
        if t.device != self.device:
            return t
        ref = self.weights.get(t.untyped_storage().data_ptr())
        if ref is not None:
            return _ParamView(ref[0], ref[1], t)
        s = _Saved(host_copy(t.detach()))
        self.saved.append(s)
        return s

    def unpack(self, h):
        if isinstance(h, torch.Tensor):
            return h
        if isinstance(h, _ParamView):
            return self.graph.weights(h.layer, h.name).as_strided(h.size, h.stride, h.offset)
        if h.device is None:
            raise RuntimeError("a saved activation is used before it was swapped in (swap-in sA missing)")
        return h.device


class CountSaved:
    """``saved_tensors_hooks`` pair that only counts the bytes a recompute keeps on the device."""

    def __init__(self, exclude: set[int]):
        self.exclude = set(exclude)     # storages not to count: weights and the input
        self.bytes = 0

    def pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in self.exclude:
            self.exclude.add(st.data_ptr())
            self.bytes += st.nbytes()
        return t

    @staticmethod
    def unpack(t):
        return t
