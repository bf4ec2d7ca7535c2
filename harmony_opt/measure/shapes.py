"""What the runtime needs to know about a model, measured from one sample before any training step.

:func:`boundary_shapes` runs the chain once on a single sample (eval mode, no grad, so
no statistics change) and records the shape and dtype of every layer's input: a rank
receiving an activation or gradient allocates its buffer from them. It is also the check
that the model, the data and the plan fit together: a layer that fails on the data, or
returns something other than one batch-first tensor, is reported by name before any
step runs. :func:`measure_layer_bytes` prices every tensor of a Program the same way,
for the validator's memory check. Both run under the precision's autocast
(:mod:`harmony_opt.core.precision`), as the executor runs the layers: with bf16, an input that a
layer returns in bf16 is received and priced as bf16.
"""
from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from ..compile.program import LayerBytes
from ..core.errors import DataError, UsageError, first_line
from ..core.precision import autocast
from ..core.units import alloc_bytes
from .profiler import saved_counts

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


@contextlib.contextmanager
def _as_in_training(layers: list[nn.Module]):
    """Train mode, as the executor runs the layers (dropout saves its masks, batch norm its batch
    statistics), leaving no trace: buffers (running statistics) and the random generator restored."""
    modes = [(m, m.training) for layer in layers for m in layer.modules()]
    kept = [(b, b.detach().clone()) for layer in layers for b in layer.buffers()]
    try:
        with torch.random.fork_rng(devices=[]):
            for layer in layers:
                layer.train()
            yield
    finally:
        with torch.no_grad():
            for b, v in kept:
                b.copy_(v)
        for m, was in modes:
            m.training = was


def _describe(layer: int, module: nn.Module) -> str:
    return f"layer {layer} ({type(module).__name__})"


def boundary_shapes(layers: list[nn.Module], inputs: torch.Tensor, targets: torch.Tensor,
                    precision: str = "fp32") -> Shapes:
    """(shape without the batch dimension, dtype) of each layer's input, from one sample."""
    R = len(layers)
    out: Shapes = []
    x = inputs[:1]
    with torch.no_grad(), _eval(layers), autocast(inputs.device.type, precision):
        for l, layer in enumerate(layers):
            if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != 1:
                raise DataError(f"{_describe(l - 1, layers[l - 1])} returns {type(x).__name__} "
                                f"{tuple(getattr(x, 'shape', ()))} for one sample; every layer but the loss must "
                                f"return one tensor whose first dimension is the batch")
            out.append((tuple(x.shape[1:]), x.dtype))
            try:
                x = layer(x, targets[:1]) if l == R - 1 else layer(x)
            except Exception as e:
                raise DataError(f"{_describe(l, layer)} fails on the data: {first_line(e)}") from None
    if not isinstance(x, torch.Tensor) or x.dim() != 0:
        raise DataError(f"the loss {_describe(R - 1, layers[-1])} returns {tuple(getattr(x, 'shape', ()))}, "
                        f"not a scalar: the last layer must return the mean loss of its microbatch")
    return out


def measure_layer_bytes(layers: list[nn.Module], inputs: torch.Tensor, targets: torch.Tensor,
                        optimizer_states: int = 2, granularity: int = 1, precision: str = "fp32") -> LayerBytes:
    """Per-layer byte sizes per sample: weights, buffers, optimizer state (``optimizer_states``
    tensors the size of the weights: 2 for Adam), input and saved activations, measured in train
    mode on one sample, or on two where a layer refuses one in training (batch norm over a
    vector), then halved. With ``granularity`` (512 for CUDA's caching allocator), what rounding
    each tensor up to it adds: exact for weights, buffers and optimizer state, and how many
    tensors each layer's saved activations are in. Under bf16, the weight copies autocast saves
    are counted once per microbatch (``saved_fixed``), not per sample, as a profile's
    ``cast_bytes`` are; with ``granularity`` they are among the saved tensors, rounded like them."""
    try:
        per, n = _per_sample(layers, inputs, targets, 1, precision), 1
    except Exception:
        if inputs.shape[0] < 2:
            raise
        per, n = _per_sample(layers, inputs, targets, 2, precision), 2
    inp, saved, storage, own, out, tensors, cast = per
    saved = [(v - c) / n for v, c in zip(saved, cast)]
    storage = [(v - c) / n for v, c in zip(storage, cast)]
    inp, own, out = ([v / n for v in col] for col in (inp, own, out))
    wb = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers]
    bb = [sum(b.numel() * b.element_size() for b in layer.buffers()) for layer in layers]
    pads = {}
    if granularity > 1:
        def pad(tensors, exact):
            return sum(alloc_bytes(t.numel() * t.element_size(), granularity) for t in tensors) - exact
        wp = [pad(layer.parameters(), w) for layer, w in zip(layers, wb)]
        pads = dict(granularity=granularity, weights_pad=tuple(wp),
                    buffers_pad=tuple(pad(layer.buffers(), b) for layer, b in zip(layers, bb)),
                    optimizer_pad=tuple(optimizer_states * p for p in wp), saved_tensors=tuple(int(v) for v in tensors))
    return LayerBytes(weights=tuple(wb), buffers=tuple(bb),
                      optimizer=tuple(optimizer_states * w for w in wb), input=tuple(inp), saved=tuple(saved),
                      target=float(targets[:1].numel() * targets.element_size()), saved_storage=tuple(storage),
                      saved_input=tuple(own), saved_output=tuple(out),
                      saved_fixed=tuple(cast) if any(cast) else (), **pads)


def _per_sample(layers: list[nn.Module], inputs: torch.Tensor, targets: torch.Tensor, n: int,
                precision: str = "fp32") -> list[list[float]]:
    """Input bytes and the six saved counts (profiler.saved_counts: four byte counts, the saved
    tensors, the weight copies' bytes) of every layer on ``n`` samples."""
    R = len(layers)
    cols: list[list[float]] = [[] for _ in range(7)]
    # copies, not views: a view of the minibatch would be priced as the minibatch's whole storage
    x, target = inputs[:n].clone(), targets[:n].clone()
    with _as_in_training(layers):
        for l, layer in enumerate(layers):
            cols[0].append(float(x.numel() * x.element_size()))
            for col, v in zip(cols[1:], saved_counts(layer, x, target if l == R - 1 else None, precision=precision)):
                col.append(float(v))
            with torch.no_grad(), autocast(x.device.type, precision):
                x = layer(x) if l < R - 1 else x
    return cols


def check_mean_loss(layers: list[nn.Module], inputs: torch.Tensor, targets: torch.Tensor) -> None:
    """Refuse a loss that does not average over its samples (``reduction="sum"``, say): the executor
    weights each microbatch's loss by its share of the minibatch, which gives the minibatch's
    gradient only for a mean. Checked on the first two samples: the loss of both must be the mean of
    each one's loss (eval mode, no grad, so nothing changes)."""
    loss = layers[-1]
    for m in loss.modules():
        if isinstance(getattr(m, "reduction", None), str) and m.reduction in ("sum", "none"):
            raise UsageError(f"the loss {_describe(len(layers) - 1, loss)} has reduction={m.reduction!r}: the "
                             f"loss layer must return the mean over its samples; use reduction='mean'")
    if inputs.shape[0] < 2:
        return
    with torch.no_grad(), _eval(layers), torch.random.fork_rng(devices=[]):
        x = inputs[:2]
        for layer in layers[:-1]:
            x = layer(x)
        both, one, two = (float(loss(x[s], targets[s])) for s in (slice(0, 2), slice(0, 1), slice(1, 2)))
    mean = (one + two) / 2
    if math.isfinite(both) and math.isfinite(mean) and abs(both - mean) > 1e-4 * max(abs(both), abs(mean)):
        raise UsageError(f"the loss {_describe(len(layers) - 1, loss)} of two samples is {both:.6g} but the mean "
                         f"of their own losses is {mean:.6g}: the loss layer must return the mean over its samples "
                         f"(e.g. reduction='mean', not 'sum'), or a split microbatch's gradient would differ")
