"""What the runtime learns about a model from one sample, before any training step.

:func:`boundary_shapes` runs the chain once on a single sample (eval mode, no grad, so
no statistics change) and records the shape and dtype of every layer's input: a rank
receiving an activation or gradient allocates its buffer from them. It is also the check
that the model, the data and the plan fit together: a layer that fails on the data, or
returns something other than one batch-first tensor, is reported by name before any
step runs. :func:`measure_layer_bytes` prices every tensor of a Program the same way,
for the validator's memory check.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from harmony_opt.errors import DataError
from harmony_opt.program import LayerBytes

Shapes = list[tuple[tuple[int, ...], torch.dtype]]


@contextlib.contextmanager
def _eval(layers: list[nn.Module]):
    modes = [(m, m.training) for layer in layers for m in layer.modules()]
    try:
        for layer in layers:
            layer.eval()
        yield
    finally:
        for m, was in modes:
            m.training = was


def _describe(layer: int, module: nn.Module) -> str:
    return f"layer {layer} ({type(module).__name__})"


def boundary_shapes(layers: list[nn.Module], inputs: torch.Tensor, targets: torch.Tensor) -> Shapes:
    """(shape without the batch dimension, dtype) of each layer's input, from one sample."""
    R = len(layers)
    out: Shapes = []
    x = inputs[:1]
    with torch.no_grad(), _eval(layers):
        for l, layer in enumerate(layers):
            if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != 1:
                raise DataError(f"{_describe(l - 1, layers[l - 1])} returns {type(x).__name__} "
                                f"{tuple(getattr(x, 'shape', ()))} for one sample; every layer but the loss must "
                                f"return one tensor whose first dimension is the batch")
            out.append((tuple(x.shape[1:]), x.dtype))
            try:
                x = layer(x, targets[:1]) if l == R - 1 else layer(x)
            except Exception as e:
                raise DataError(f"{_describe(l, layer)} fails on the data: {type(e).__name__}: {e}") from None
    if not isinstance(x, torch.Tensor) or x.dim() != 0:
        raise DataError(f"the loss {_describe(R - 1, layers[-1])} returns {tuple(getattr(x, 'shape', ()))}, "
                        f"not a scalar: the last layer must return the mean loss of its microbatch")
    return out


def measure_layer_bytes(layers: list[nn.Module], inputs: torch.Tensor, targets: torch.Tensor,
                        optimizer_states: int = 2) -> LayerBytes:
    """Per-layer byte sizes from one sample: weights, buffers, optimizer state
    (``optimizer_states`` tensors the size of the weights: 2 for Adam), input and saved activations."""
    R = len(layers)
    inp, saved = [], []
    x = inputs[:1]
    with _eval(layers):
        for l, layer in enumerate(layers):
            inp.append(float(x.numel() * x.element_size()))
            seen: set[int] = {p.untyped_storage().data_ptr() for p in layer.parameters()}
            count = [0]

            def pack(t, seen=seen, count=count):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in seen:
                    seen.add(ptr)
                    count[0] += t.untyped_storage().nbytes()
                return t

            leaf = x.detach().requires_grad_(x.is_floating_point())
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                y = layer(leaf, targets[:1]) if l == R - 1 else layer(leaf)
            saved.append(float(count[0]))
            x = y.detach()
    wb = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers]
    return LayerBytes(weights=tuple(wb),
                      buffers=tuple(sum(b.numel() * b.element_size() for b in layer.buffers()) for layer in layers),
                      optimizer=tuple(optimizer_states * w for w in wb), input=tuple(inp), saved=tuple(saved),
                      target=float(targets[:1].numel() * targets.element_size()))
