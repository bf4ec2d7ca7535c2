"""Measure a layered model on the current device and produce a :class:`~harmony_opt.core.profile.Profile`.

::

    prof = profile_model(build_model("gpt2-tiny"), [1, 2, 4], device="cpu")
    prof.save("profiles/gpt2_tiny_cpu")

Each layer runs alone, as Harmony's profiler does, at every microbatch size, on the
input the previous layers produced (the model is never resident as a whole: on CUDA
one layer at a time is moved to the GPU and back). Per layer and size it records:

* FWD ``gpu_time_s``: forward with autograd off. BWD ``gpu_time_s``: recompute the
  forward with autograd on, then the backward (Harmony's convention). CUDA events on
  a GPU, the wall clock on the CPU; after ``warmup`` runs, the median of at least
  ``repeats`` and at most ``max_repeats`` runs, outliers dropped
  (:func:`~harmony_opt.measure.timing.time_runs`).
* ``peak_memory_bytes``: on CUDA, ``torch.cuda.max_memory_allocated`` while running
  the layer alone (W, B, X, Y, gradients, workspace), which counts every block as the
  caching allocator rounds it (to 512 bytes). On the CPU it is an analytic
  estimate, since the CPU allocator keeps no peak: FWD = params + buffers + input +
  output; BWD = that + gradients (= params) + saved activations + the input's gradient
  (what the runtime holds while a backward runs: its input, the output's gradient, the
  saved activations, dW and dX).
* ``input_bytes``: bytes of the layer's input tensor; ``saved_bytes``: bytes of the
  tensors autograd saves for the layer's backward (found with
  ``torch.autograd.graph.saved_tensors_hooks``, each storage counted once, parameters
  and buffers excluded), the cost of stashing instead of recomputing; ``saved_tensors``:
  how many tensors those are.
* per layer: parameter and buffer bytes, optimizer state (Adam 2 x params, SGD with
  momentum 1 x), exact; how many tensors each is in (``param_tensors``,
  ``buffer_tensors``, ``optimizer_state_tensors``), from which a plan for a GPU charges
  the allocator's rounding (``Profile.alloc_granularity``); and ``cpu_update_s``: the
  executor's ``torch.optim`` step of the layer's parameters on the CPU
  (``PackOptimizers.step_host``), where Harmony runs the optimizer, less the fixed cost of a
  step call (:func:`cpu_call_time`, timed beside every layer; the fastest of all,
  ``meta["cpu_update_call_s"]``, is taken off once every layer is done, so that a busy spell
  while the call is timed cannot leave a layer with parameters at 0). The executor makes one
  step call per pack, not per layer, so a pack's step is that call's cost
  (``Hardware.cpu_optimizer_call_s``, from ``harmony-opt probe``) plus its layers'
  ``cpu_update_s``; with the call in every layer's figure a pack of GPT-2 blocks on a 2-core
  CPU would be charged 0.13-0.2 ms per layer too much, against 0.2-0.3 ms of real work.

Everything runs with ``threads`` intra-op threads (default: what the executor's one rank
uses on this device, ``runtime.optim.host_threads``), recorded as ``meta["threads"]``: on
a CPU the thread count changes a layer's time several-fold, and a busy machine makes two
threads slower than one.

Measurements that :mod:`~harmony_opt.measure.flags` finds suspicious (a larger microbatch
faster than a smaller one, identical layers more than 2x apart) are measured once more after
every layer has been, on an input of the same shape, and the lower median is kept (other work
on the machine only ever adds time); what is still suspicious is recorded in
``meta["warnings"]``, one line each.

If a layer runs out of GPU memory at some size, that size and every larger one are
dropped for all layers (a profile needs the same sizes for every layer), with a
warning; if even the smallest size does not fit, profiling fails.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import platform
import statistics
import time
from typing import NamedTuple

import pandas as pd
import torch
from torch import nn
from tqdm import tqdm

from ..core.errors import InfeasibleError, UsageError, first_line
from ..core.hardware import usable_cores
from ..core.precision import autocast, check_precision, inner_view, low_dtype
from ..core.profile import Profile
from ..runtime.executor import is_stochastic, run_layer
from .decompose import LayeredModel
from .flags import layer_signature, profile_flags
from .timing import check_repeats, time_runs

log = logging.getLogger(__name__)

#: Optimizer state per parameter byte, by optimizer name (model.meta["optimizer"]).
OPTIMIZER_STATE_FACTOR = {"adam": 2, "sgd": 1}


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One layer at one microbatch size (bytes and seconds)."""

    fwd_time: float
    bwd_time: float
    fwd_peak: int
    bwd_peak: int
    input_bytes: int
    saved_bytes: int
    saved_storage_bytes: int = 0
    saved_input_bytes: int = 0
    saved_output_bytes: int = 0
    saved_tensors: int = 0
    cast_bytes: int = 0
    stash_fwd_time: float | None = None     # the forward that keeps its graph for a stashed backward
    stash_bwd_time: float | None = None     # the backward from that graph, without a recompute


def profile_model(model: LayeredModel, microbatches: list[int], device: str = "cpu", *, repeats: int = 5,
                  max_repeats: int | None = None, warmup: int = 1, threads: int | None = None,
                  remeasure: bool = True, progress: bool = True, seed: int = 0, precision: str = "fp32") -> Profile:
    """Profile every layer of ``model`` at every size in ``microbatches`` on ``device`` ("cpu" or "cuda").

    ``repeats``/``max_repeats`` (default 4 x repeats): the fewest and most timed runs per measurement;
    ``threads``: intra-op threads (default: the executor's); ``remeasure``: measure flagged layers again;
    ``precision``: "fp32", or "bf16" to measure every forward and backward under bf16 autocast (with
    fp32 weights), as the runtime then runs them (recorded as ``meta["precision"]``).
    """
    precision = check_precision(precision)
    dev = resolve_device(device)
    sizes = check_sizes(microbatches)
    timing = dict(repeats=repeats, max_repeats=check_repeats(repeats, max_repeats, warmup), warmup=warmup)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise UsageError(f"threads must be a whole number >= 1, got {threads!r}")
    optimizer = str(model.meta.get("optimizer", "adam")).lower()
    if optimizer not in OPTIMIZER_STATE_FACTOR:
        raise UsageError(f"model {model.name}: optimizer {optimizer!r} is not one of "
                         f"{', '.join(OPTIMIZER_STATE_FACTOR)}")
    if any(p.is_meta for layer in model.layers for p in layer.parameters()):
        raise UsageError(f"model {model.name} was built on the meta device (shapes only); build it with real weights")
    if model.num_layers < 2:
        raise UsageError(f"model {model.name} has {model.num_layers} layer(s); it needs at least a body and a loss")

    from harmony_opt.runtime.buffers import keep_freed_memory
    from harmony_opt.runtime.optim import host_threads, intra_op_threads

    keep_freed_memory()         # freed memory kept for reuse, as the executor keeps it
    threads = threads or host_threads(1, dev.type, torch.get_num_threads())   # as the executor's one rank runs
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    with intra_op_threads(threads):
        layers, micro, signatures, skipped, remeasured, target, call = _profile_layers(
            model, sizes, dev, optimizer, timing, threads, remeasure, progress, seed, precision)
    meta = _meta(model, dev, optimizer, timing, skipped, threads, target)
    if precision != "fp32":
        meta["precision"] = precision
        if dev.type == "cpu":
            meta["peak_memory"] += "; FWD also holds autocast's bf16 weight copies (cast_bytes)"
    meta.update(layer_signatures=signatures, load_average=load, cores=usable_cores(), remeasured=remeasured,
                cpu_update_call_s=call)
    prof = Profile(model.name, layers, micro, meta)
    prof.meta["warnings"] = [f.text for f in profile_flags(prof)]
    for line in prof.meta["warnings"]:
        log.info("profile of %s: %s", model.name, line)   # the CLI prints them; callers read meta["warnings"]
    return prof


def _profile_layers(model: LayeredModel, sizes: list[int], dev: torch.device, optimizer: str, timing: dict,
                    threads: int, remeasure: bool, progress: bool, seed: int, precision: str = "fp32"):
    """The two tables, the layers' signatures, the sizes skipped, the [layer, size] measured twice, the
    targets' bytes per sample and the fixed cost of a step call taken off the layers' steps."""
    gen = torch.Generator().manual_seed(seed)
    batches = {u: model.batch(u, gen) for u in sizes}
    acts = {u: x for u, (x, _) in batches.items()}
    skipped: list[str] = []
    static_rows, rows, signatures = [], [], []
    call = float("inf")
    kept_inputs: dict[tuple[str, int], torch.Tensor] = {}   # the first input of each signature, per size
    R = model.num_layers

    def on_device():
        return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()

    with on_device(), tqdm(total=R, disable=not progress, unit="layer", leave=False) as bar:
        for l, layer in enumerate(model.layers):
            bar.set_description_str(f"profiling layer {l + 1} of {R}")
            log.debug("profiling layer %d of %d", l + 1, R)
            static_rows.append(_static_row(l, layer, optimizer, timing, threads))
            call = min(call, cpu_call_time(optimizer, max(timing["repeats"], 5)))
            signatures.append(layer_signature(layer, acts[sizes[0]]))
            with _moved_to(layer, dev) as base:
                for u in list(sizes):
                    target = batches[u][1] if l == R - 1 else None
                    if remeasure:
                        kept_inputs.setdefault((signatures[-1], u), acts[u])
                    try:
                        m, out = _measure(layer, acts[u], target, dev, timing, base, precision, l > 0)
                    except _NotOneTensor as e:
                        what = ("the loss layer returns {}, not one tensor (the loss)" if l == R - 1 else
                                "returns {}, not one tensor: a layer hands one tensor to the next (wrap it in a "
                                "module that returns one, e.g. `out, _ = self.lstm(x)`)").format(e)
                        raise UsageError(f"model {model.name}: layer {l} ({type(layer).__name__}) {what}") from None
                    except torch.cuda.OutOfMemoryError:
                        if u == sizes[0]:
                            raise InfeasibleError(
                                f"layer {l} ({type(layer).__name__}) of {model.name} does not fit in {dev} memory "
                                f"even at microbatch {u}", layer=l, microbatch=u) from None
                        msg = (f"layer {l} ran out of {dev} memory at microbatch {u}; profiling sizes below {u} "
                               f"only (every layer needs the same sizes)")
                        log.warning(msg)
                        skipped.append(msg)
                        sizes = [s for s in sizes if s < u]
                        rows = [r for r in rows if r["microbatch"] < u]
                        break
                    except Exception as e:
                        _raise_if_the_models(e, model, l, layer, u, acts[u], target)
                        raise
                    rows.extend(_rows(l, u, m))
                    if precision != "fp32":
                        static_rows[-1].setdefault("cast_bytes", m.cast_bytes)
                    acts[u] = out
            bar.update(1)
    layers = pd.DataFrame(static_rows)
    # a layer's whole step less the call, the fastest seen over the run (a call timed in a busy spell
    # only would otherwise leave a small layer's real work at 0)
    layers["cpu_update_s"] = (layers["cpu_update_s"] - call).clip(lower=0.0)
    micro = pd.DataFrame(rows).sort_values(["phase", "microbatch", "layer"], ascending=[False, True, True])
    micro = micro.reset_index(drop=True)
    again: list[list[int]] = []
    if remeasure:
        draft = Profile(model.name, layers, micro, {"layer_signatures": signatures})
        suspects = sorted({s for f in profile_flags(draft) for s in f.suspects if s[1] in sizes})
        for l, u in suspects:
            layer, target = model.layers[l], (batches[u][1] if l == R - 1 else None)
            with on_device(), _moved_to(layer, dev) as base:
                m, _ = _measure(layer, kept_inputs[(signatures[l], u)], target, dev, timing, base, precision,
                                l > 0)
            for phase, t in (("FWD", m.fwd_time), ("BWD", m.bwd_time)):
                at = (micro.phase == phase) & (micro.microbatch == u) & (micro.layer == l)
                micro.loc[at, "gpu_time_s"] = micro.loc[at, "gpu_time_s"].clip(upper=t)   # the lower median
            again.append([l, u])
    return layers, micro, signatures, skipped, again, _target_bytes(batches), call


# -- inputs ------------------------------------------------------------------------------------

def resolve_device(device: str | torch.device) -> torch.device:
    """``cpu`` or ``cuda[:i]``; CUDA without a GPU is the user's error, said in one line."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"unknown device {device!r}; use cpu or cuda") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA GPU is available here (torch "
                             f"{torch.__version__}); use --device cpu")
        return torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
    if dev.type != "cpu":
        raise UsageError(f"unsupported device {device!r}; use cpu or cuda")
    return dev


def check_sizes(microbatches) -> list[int]:
    """Distinct positive microbatch sizes, ascending."""
    sizes = list(microbatches)
    if not sizes or any(isinstance(u, bool) or not isinstance(u, int) or u < 1 for u in sizes):
        raise UsageError(f"microbatch sizes must be whole numbers >= 1, got {sizes}")
    return sorted(set(sizes))


# -- one layer ---------------------------------------------------------------------------------

def _raise_if_the_models(error: Exception, model: LayeredModel, l: int, layer: nn.Module, u: int,
                         x: torch.Tensor, target: torch.Tensor | None) -> None:
    """Where measuring layer ``l`` failed because the layer itself fails on this input (its own
    forward raises as well, outside the measurement), a UsageError naming it: the model's code or
    its sizes, not the profiler (BatchNorm on one sample, say)."""
    try:
        with torch.no_grad():
            _call(layer, x.to(_device_of(layer)), None if target is None else target.to(_device_of(layer)))
    except Exception as again:
        raise UsageError(f"model {model.name}: layer {l} ({type(layer).__name__}) fails on a microbatch of {u}: "
                         f"{first_line(again)} (profile other sizes with -u, or fix the model)") from error


class _NotOneTensor(Exception):
    """A layer's forward returned something other than one tensor (what it returned, in words)."""


def _call(layer: nn.Module, x: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    return layer(x) if target is None else layer(x, target)


def as_executed(layer: nn.Module):
    """``layer`` as the executor runs it (``runtime.executor.run_layer``): a function of ``(x, target)``
    through ``functional_call`` over its weights and buffers, a layer with dropout under its seeded
    generators (both looked up here, once, as the executor does before it runs). The times are the
    executor's: called directly, a BERT-tiny block (microbatch 8, 2-core CPU) measured 0.62 ms of
    the 0.75 ms it takes there, and plans were simulated 1.4x too fast."""
    state = {**dict(layer.named_parameters()), **dict(layer.named_buffers())}
    key = "profile" if is_stochastic(layer) else None

    def run(x: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        if target is None:
            return run_layer(layer, state, (x,), key, x.device)
        return run_layer(layer, state, (x, target), None, x.device)
    return run


def _measure(layer, x_host, target_host, dev, timing: dict, base,
             precision: str = "fp32", input_grad: bool = True) -> tuple[Measurement, torch.Tensor | None]:
    """FWD and BWD of one layer (already on ``dev``) at one size, under ``precision``'s autocast
    (the forward, and the backward's recompute; its backward outside, as torch runs it).

    ``input_grad``: whether the backward computes the gradient of the input, as the executor does for
    every layer but the first (the data needs none: a CNN's first convolution took 2.7x as long with it).

    Returns the measurement and the layer's output on the host (``None`` for the loss).
    Device tensors are local, so they are freed when this returns; ``base`` is the
    device memory allocated before the layer was moved in, which the peak excludes.
    """
    x = x_host.to(dev)
    target = None if target_host is None else target_host.to(dev)
    call = as_executed(layer)

    def fwd():
        with torch.no_grad(), autocast(dev.type, precision):
            return call(x, target)

    for _ in range(timing["warmup"]):
        fwd()
    out, fwd_peak = _peak(fwd, dev, base)
    if not isinstance(out, torch.Tensor):
        raise _NotOneTensor(f"a {type(out).__name__}")
    fwd_time = time_runs(fwd, dev, **{**timing, "warmup": 0}).seconds
    out_host, out_bytes = out.to("cpu"), tensor_bytes(out)
    grad_out = None if target is not None else torch.ones_like(out)
    del out   # the backward's peak must not count the forward's output

    def bwd():
        xi = x.detach().requires_grad_(input_grad and x.is_floating_point())
        with autocast(dev.type, precision):
            y = call(inner_view(xi), target)
        if y.requires_grad:
            y.backward(grad_out)

    for _ in range(timing["warmup"]):
        bwd()
    layer.zero_grad(set_to_none=True)   # the peak run allocates the gradients, as a first backward does
    _, bwd_peak = _peak(bwd, dev, base)
    bwd_time = time_runs(bwd, dev, **{**timing, "warmup": 0}).seconds
    stash_fwd_time, stash_bwd_time = _stash_times(layer, x, target, grad_out, dev, timing, precision, input_grad)
    c = saved_counts(layer, x, target, precision=precision, input_grad=input_grad)
    saved, casts = c.saved, c.cast_bytes
    x_bytes = tensor_bytes(x)
    if dev.type == "cpu":
        w, b = _param_bytes(layer), _buffer_bytes(layer)
        fwd_peak = w + b + x_bytes + out_bytes + casts      # autocast's weight copies live through the forward
        bwd_peak = w + b + x_bytes + out_bytes + w + saved + (x_bytes if x.is_floating_point() else 0)   # + dX
    m = Measurement(fwd_time, bwd_time, fwd_peak, bwd_peak, x_bytes, saved, c.storage, c.of_input, c.of_output,
                    c.tensors, casts, stash_fwd_time, stash_bwd_time)
    return m, (None if target is not None else out_host)


def _stash_times(layer, x, target, grad_out, dev, timing: dict, precision: str,
                 input_grad: bool = True) -> tuple[float, float]:
    """(forward, backward) seconds of the layer on the stash path, through the executor's own hooks
    (``runtime.graph.Offload``): a forward that records its graph and hands each saved tensor to the
    hooks, which copy it to the host (on a GPU on a side stream, as the executor's swap-out stream; on
    the CPU in line, their time taken out: the plan times the copies as transfers); then a backward
    from that graph, its saved tensors back on the device, with no recompute. Measured, not derived:
    the graph, the hooks' work per saved tensor (19 in a GPT-2 block) and what the copies leave in the
    caches made gpt2-tiny's stashing forwards 1.2-1.5x its plain ones on a CPU, and the backward
    from a kept graph is not the recomputing backward less the plain forward (0.84-1.02x of it)."""
    from harmony_opt.runtime.graph import Offload

    params = dict(layer.named_parameters())
    ids = {p.untyped_storage().data_ptr(): (0, n) for n, p in params.items()}
    side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
    inline: list[float] = []
    call = as_executed(layer)

    def forward():
        hooks = Offload(ids, dev, side, timed=side is None)
        hooks.graph = _Weights(params)
        xi = x.detach().clone().requires_grad_(input_grad and x.is_floating_point())
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack), \
                autocast(dev.type, precision):
            y = call(inner_view(xi), target)
        inline.append(hooks.inline_s)
        return y, hooks

    def swapped_in():
        y, hooks = forward()
        if side is not None:
            torch.cuda.current_stream(dev).wait_stream(side)
        for saved in hooks.saved:       # as the executor's swap-in of sA: a fresh copy, just made
            saved.device = torch.empty_like(saved.host, device=dev).copy_(saved.host, non_blocking=True)
        return y

    def backward(y):
        if y.requires_grad:
            y.backward(grad_out)

    total = time_runs(forward, dev, **timing).seconds
    fwd = max(total - statistics.median(inline), 0.0)
    bwd = time_runs(backward, dev, **timing, setup=swapped_in).seconds
    layer.zero_grad(set_to_none=True)
    return fwd, bwd


class _Weights:
    """What a kept graph offers ``Offload``'s unpack hook: the layer's weights by name."""

    def __init__(self, params: dict):
        self.params = params

    def weights(self, _layer: int, name: str) -> torch.Tensor:
        return self.params[name]


def _rows(layer: int, u: int, m: Measurement) -> list[dict]:
    """The FWD and BWD rows of one layer at one size; ``stash_time_s`` is each phase's time on the stash
    path (``_stash_times``)."""
    return [{"phase": phase, "microbatch": u, "layer": layer, "gpu_time_s": t, "peak_memory_bytes": int(peak),
             "input_bytes": m.input_bytes, "saved_bytes": m.saved_bytes,
             "saved_storage_bytes": m.saved_storage_bytes, "saved_input_bytes": m.saved_input_bytes,
             "saved_output_bytes": m.saved_output_bytes, "saved_tensors": m.saved_tensors,
             **({} if stash is None else {"stash_time_s": stash})}
            for phase, t, peak, stash in (("FWD", m.fwd_time, m.fwd_peak, m.stash_fwd_time),
                                          ("BWD", m.bwd_time, m.bwd_peak, m.stash_bwd_time))]


def _peak(fn, dev: torch.device, base: int):
    """Run ``fn`` once; on CUDA also return the peak bytes allocated meanwhile, less ``base``
    (what was allocated before the layer was moved in): W, B, X, Y, gradients, workspace."""
    if dev.type != "cuda":
        return fn(), 0
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    result = fn()
    torch.cuda.synchronize(dev)
    return result, max(int(torch.cuda.max_memory_allocated(dev)) - base, 0)


def _allocated(dev: torch.device) -> int:
    return int(torch.cuda.memory_allocated(dev)) if dev.type == "cuda" else 0


@contextlib.contextmanager
def _moved_to(layer: nn.Module, dev: torch.device):
    """Run with ``layer`` alone on ``dev``; yields the device bytes allocated before it came in.
    Afterwards the layer is back where it was, without gradients, and the device cache is emptied."""
    home, base = _device_of(layer), _allocated(dev)
    layer.to(dev)
    try:
        yield base
    finally:
        layer.to(home)
        layer.zero_grad(set_to_none=True)
        _release(dev)


def _release(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()


def saved_bytes(layer: nn.Module, x: torch.Tensor, target: torch.Tensor | None = None) -> int:
    """Bytes of the activations autograd saves for ``layer``'s backward on input ``x`` (see saved_counts)."""
    return saved_counts(layer, x, target)[0]


class SavedCounts(NamedTuple):
    """What :func:`saved_counts` counts (see there)."""

    saved: int          # the larger of the next one and every saved tensor as often as saved
    storage: int        # each storage once
    of_input: int       # of those, the layer's input's
    of_output: int      # and its output's
    tensors: int        # how many tensors those bytes are in
    cast_bytes: int     # under bf16, autocast's weight copies among them (0 for fp32)


def saved_counts(layer: nn.Module, x: torch.Tensor, target: torch.Tensor | None = None, *,
                 precision: str = "fp32", input_grad: bool = True) -> SavedCounts:
    """Bytes of the activations autograd saves for ``layer``'s backward on input ``x``, counted three
    ways, for the three ways the runtime holds them: the larger of the next two (what a plan is
    priced with by default); each storage once (a recompute keeps the graph's tensors, views share
    their storage), every saved tensor as often as it is saved (a stashing pack copies each to
    the host and back); and how many of the storages' bytes are ``x``'s own (a recompute's graph
    shares them with the input the runtime holds anyway) and the output's (which the next layer
    of a pack may save as its input: one storage, counted by both layers); ``x`` needs a gradient
    where ``input_grad`` (every layer's input but the first's, as the executor runs them). The layer's own
    parameters (and, but for a stash's copies, buffers) are excluded: they are resident anyway.
    ``tensors`` is how many tensors those bytes are in (the more of the storages and the copies),
    each of which a rounding allocator holds separately.

    With ``precision="bf16"`` the layer runs under autocast, as the runtime runs it, and
    ``cast_bytes`` is the bytes of the bf16 weight copies autocast made and the graph saved (each
    once): they are part of the first two counts (and of ``tensors``), but a microbatch holds
    them once whatever its size. A saved storage is such a copy when it holds the bf16 rounding
    of an fp32 weight of as many elements (autocast saves it transposed, say, for a linear
    layer: a view of the copy).
    """
    params = {t.untyped_storage().data_ptr() for t in layer.parameters()}
    low = low_dtype(precision)
    by_numel: dict[int, list[torch.Tensor]] = {}
    for p in layer.parameters():
        if low is not None and p.dtype == torch.float32:
            by_numel.setdefault(p.numel(), []).append(p)
    casts: dict[int, int] = {}
    resident = params | {t.untyped_storage().data_ptr() for t in layer.buffers()}
    seen: dict[int, torch.Tensor] = {}
    copies = [0, 0]     # bytes, tensors

    def pack(t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in resident:
            # held here until the count is done, so that no storage is freed and its address reused
            # by a later one (which would then not be counted)
            seen[storage.data_ptr()] = t
        if storage.data_ptr() not in params:     # a stash copies saved buffers too, only weights stay put
            copies[0] += tensor_bytes(t)
            copies[1] += 1
        if t.dtype == low and storage.data_ptr() not in resident and storage.data_ptr() not in casts and \
                _is_cast(storage, low, by_numel):
            casts[storage.data_ptr()] = storage.nbytes()
        # the graph keeps nothing: it never runs backward. Handing ``t`` itself back would leak the
        # whole graph: a saved output references its own grad_fn, a cycle autograd frees only in a
        # backward (on a GPU, VGG-416's profile ran out of 80 GB by layer 25 that way).

    def unpack(_):
        raise RuntimeError("saved_bytes' graph is for counting only")

    leaf = x.detach().requires_grad_(input_grad and x.is_floating_point())
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack), \
            autocast(x.device.type, precision):
        y = _call(layer, inner_view(leaf), target)
    storages = sum(t.untyped_storage().nbytes() for t in seen.values())
    own, out = x.untyped_storage(), y.untyped_storage()
    of_input = own.nbytes() if own.data_ptr() in seen else 0
    of_output = out.nbytes() if out.data_ptr() in seen and out.data_ptr() != own.data_ptr() else 0
    del y
    count = max(len(seen), copies[1])
    seen.clear()    # the graph may hold the hooks, and they ``seen``: drop the tensors, or the cycle keeps them
    return SavedCounts(max(storages, copies[0]), storages, of_input, of_output, count, sum(casts.values()))


def _is_cast(storage, low: torch.dtype, by_numel: dict[int, list[torch.Tensor]]) -> bool:
    """Whether ``storage`` holds exactly the ``low``-precision rounding of one of the weights."""
    n = storage.nbytes() // low.itemsize
    if n not in by_numel:
        return False
    flat = torch.empty(0, dtype=low, device=storage.device).set_(storage, 0, (n,))
    return any(torch.equal(flat, p.detach().reshape(-1).to(low)) for p in by_numel[n])


def _target_bytes(batches: dict) -> float:
    """Bytes per sample of the targets (a program holds each microbatch's on the device)."""
    u, (_, y) = min(batches.items())
    return tensor_bytes(y) / u


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _param_bytes(layer: nn.Module) -> int:
    return sum(tensor_bytes(p) for p in layer.parameters())


def _buffer_bytes(layer: nn.Module) -> int:
    return sum(tensor_bytes(b) for b in layer.buffers())


def _device_of(layer: nn.Module) -> torch.device:
    t = next(iter((*layer.parameters(), *layer.buffers())), None)
    return t.device if t is not None else torch.device("cpu")


# -- per-layer (size-independent) quantities ---------------------------------------------------

def _static_row(l: int, layer: nn.Module, optimizer: str, timing: dict, threads: int | None = None) -> dict:
    """The layer's sizes, and its whole optimizer step (the caller takes off the fixed cost of a step
    call, charged once per pack through ``Hardware.cpu_optimizer_call_s``)."""
    trainable = [p for p in layer.parameters() if p.requires_grad]
    step = cpu_update_time(trainable, optimizer, timing["repeats"], threads, max_repeats=timing["max_repeats"])
    return {"layer": l, "param_bytes": _param_bytes(layer), "buffer_bytes": _buffer_bytes(layer),
            "optimizer_state_bytes": OPTIMIZER_STATE_FACTOR[optimizer] * sum(tensor_bytes(p) for p in trainable),
            "cpu_update_s": step if trainable else 0.0,
            # how many tensors those bytes are in: what a rounding allocator's padding is counted from
            "param_tensors": len(list(layer.parameters())), "buffer_tensors": len(list(layer.buffers())),
            "optimizer_state_tensors": OPTIMIZER_STATE_FACTOR[optimizer] * len(trainable)}


def cpu_update_time(params: list[torch.Tensor], optimizer: str, repeats: int = 5, threads: int | None = None, *,
                    max_repeats: int | None = None) -> float:
    """Seconds of one optimizer step over copies of ``params`` on the CPU (0 without params): the median
    of ``repeats`` to ``max_repeats`` steps, as :func:`~harmony_opt.measure.timing.time_runs` takes it.

    The step is the executor's (``PackOptimizers.step_host``: the gradients set from the host
    buffers, ``opt.step()``, the gradients dropped); the first one (which allocates the optimizer
    state) is not timed. Adam for "adam", SGD with momentum 0.9 for "sgd", built as the runtime
    builds them (``runtime.optim.make_factory``: fused where torch has it), with ``threads``
    intra-op threads (default: as set).
    """
    from harmony_opt.runtime.optim import intra_op_threads

    if not params:
        return 0.0
    step = _host_step([p.detach().to("cpu", copy=True) for p in params], optimizer)
    with intra_op_threads(threads):
        return time_runs(step, "cpu", repeats=repeats, max_repeats=max_repeats, warmup=1).seconds


def cpu_call_time(optimizer: str, repeats: int = 5, threads: int | None = None) -> float:
    """Seconds of the fixed cost of one optimizer step call on the CPU: the fastest of ``repeats`` steps
    over one one-element parameter, made as :func:`cpu_update_time` makes its step. The fastest, not
    the median: a layer's step (a median, so never below its own fastest run) always does more work
    than this one, so it stays above it once the call is taken off."""
    from harmony_opt.runtime.optim import intra_op_threads

    step = _host_step([torch.zeros(1)], optimizer)
    with intra_op_threads(threads):
        step()
        best = float("inf")
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            step()
            best = min(best, time.perf_counter() - t0)
    return best


class _Holder(nn.Module):
    def __init__(self, tensors: list[torch.Tensor]):
        super().__init__()
        self.p = nn.ParameterList(nn.Parameter(t) for t in tensors)


def _host_step(tensors: list[torch.Tensor], optimizer: str):
    """The executor's host step of a one-layer pack over ``tensors`` (stepped in place), gradients 1e-3."""
    from harmony_opt.runtime.optim import PackOptimizers, make_factory

    factory = make_factory("adam", 1e-4) if optimizer == "adam" else make_factory("sgd", 1e-3, momentum=0.9)
    optim = PackOptimizers([_Holder(tensors)], [(0, 0)], factory)
    for g in optim.grads.values():
        g.fill_(1e-3)
    return lambda: optim.step_host((0, 0))


# -- reporting ---------------------------------------------------------------------------------

def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return _cpu_model() or platform.processor() or platform.machine() or "CPU"


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _meta(model: LayeredModel, dev: torch.device, optimizer: str, timing: dict,
          skipped: list[str], threads: int, target_bytes: float = 0.0) -> dict:
    from harmony_opt.runtime.optim import fused_on_cpu

    from .. import __version__

    cpu = dev.type == "cpu"
    return {
        **{k: v for k, v in model.meta.items() if k != "optimizer"},
        "model": model.name,
        "device": device_name(dev),
        "device_type": dev.type,
        "dtype": model.meta.get("dtype", "float32"),
        "framework": f"PyTorch {torch.__version__}",
        "sequence_length": model.meta.get("sequence_length"),
        "optimizer": optimizer,
        "target_bytes_per_sample": target_bytes,
        "cpu_update": f"{'fused' if fused_on_cpu() else 'per-parameter'} torch.optim step, {threads} threads, "
                      f"less the fixed cost of a step call (cpu_update_call_s)",
        "timing": "wall clock (time.perf_counter)" if cpu else "CUDA events",
        "peak_memory": ("analytic estimate: FWD = params + buffers + input + output; "
                        "BWD = FWD + grads + saved + input grad"
                        if cpu else "torch.cuda.max_memory_allocated, layer alone"),
        "threads": threads,
        "repeats": timing["repeats"],
        "max_repeats": timing["max_repeats"],
        "warmup": timing["warmup"],
        "statistic": "median of the runs within 3 MADs of the median, repeated until it moves < 5%",
        "skipped": skipped,
        "tool": f"harmony-opt {__version__}",
        "format_version": 1,
    }
