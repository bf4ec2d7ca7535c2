"""Measure this machine and describe it as a :class:`~harmony_opt.core.hardware.Hardware`.

::

    hw = probe_hardware("cuda")       # transfers, memory, optimizer, dispatch, overlap
    hw.save("hardware.toml")

The terms that decide a step's time are measured through the executor's own code
(:mod:`harmony_opt.runtime.executor`, :mod:`harmony_opt.runtime.optim`), so that a probed file
predicts a run before any calibration:

* transfers (``h2d_bandwidth`` + ``h2d_latency_s``, ``d2h_bandwidth`` + ``d2h_latency_s``): an
  :class:`~harmony_opt.runtime.executor.Executor` swaps a layer's weights in (its ``IW``
  instruction: per parameter a new device tensor and a copy from the pinned master) and out
  (``OW``: per parameter a copy into the host tensor, the path of dW and of activations too),
  for layers of 1, 4 and 16 parameters of ``sizes`` bytes in all, timed by the executor's tracer
  (CUDA events on the swap streams; on the CPU the handler's wall clock, where a "copy" is a new
  CPU tensor and a memcpy: page faults included); a swap-out runs after a matmul, as it follows
  compute in a program (:class:`_Compute`). Least squares per direction of time = c0 + bytes /
  bandwidth + tensors x per tensor, on relative residuals so that a small copy counts as much as a
  large one (:func:`fit_linear`, :func:`transfer_fit`); the latency is that of a one-tensor
  transfer (c0 + one tensor's cost), as an activation swap, the most frequent one, is. A weight
  swap moves each parameter separately, and costs (parameters - 1) x per tensor more than the
  latency + bytes / bandwidth charged for it: on 2 CPU cores 5-8 us per tensor, 0.1-0.2 ms for a
  GPT-2 pack of 24 parameters; the description gives the per-tensor cost, the worst point, and
  the line fitted over all points without the tensor count (whose latency then holds part of the
  weight swaps' per-tensor cost and overcharges every activation swap).
* CPU optimizer (``cpu_optimizer_call_s``): the executor's update instruction on the cpu stream
  (``PackOptimizers.step_host`` on the executor's worker thread) for packs of 1 to 8 layers of 4
  parameters, 16 B to 2 MiB per layer, fitted as time = per call + per tensor x tensors + per
  byte x bytes, with Adam (the profiler's default: the figure kept) and SGD with momentum 0.9 (in
  the description; on 2 CPU cores SGD's call costs about 0.7 x Adam's, its tensors and bytes half).
  The profiler's ``cpu_update_s`` of a layer is the same host step over the layer's parameters
  less the step over one one-element parameter (the fixed cost of a call, the fastest timed over
  the profile: :func:`harmony_opt.measure.profiler.cpu_call_time`), so that with
  ``cpu_optimizer_call_s`` = the fitted step over one one-element parameter (per call + one
  tensor)::

      step of pack a..b  =  cpu_optimizer_call_s  +  sum of cpu_update_s[l] for l in a..b

  Summing per-layer steps that each held the call's cost would count it once per layer: for
  GPT-2 blocks on a 2-core CPU 0.13-0.2 ms per layer against 0.2-0.3 ms of real work.
* dispatch (``issue_overhead_s``): a forward, a recompute and a backward instruction of a tiny pack
  (an 8x8 Linear and an MSE loss, a few hundred bytes) through the executor's dispatch
  (the device table, the saved-tensor hooks, ``autograd.grad``) less the same layers run as the
  profiler runs them (forward; forward with autograd and backward; each through ``functional_call``,
  as the executor runs a layer: that cost is in the profile's times), per instruction, the median
  of three rounds; the wall clock, synchronized on a GPU, where it is the host's launch cost.
* ``copy_overlap``: False on the CPU device, by construction: the executor runs every
  instruction of a rank in program order on one thread (only the optimizer steps go to a worker
  thread), so a swap never hides behind compute. On CUDA a host->GPU copy and a matmul are
  timed alone and together on two streams: True when together < 0.8 x alone summed.
* ``collective_bandwidth`` and ``collective_latency_s``: on the CPU device a Gloo all-reduce between
  two ranks on loopback, one tensor per call as ``runtime.comm`` reduces a pack's dW, fitted as
  latency + bytes / bandwidth over 4 KiB to 16 MiB (two process groups in two threads of this
  process, set up in milliseconds where a second process would take seconds to import torch). With
  two ranks the simulator's ring charge 2 (n - 1) / n x bytes is the bytes. On CUDA they are left
  None and 0 (the simulator then uses ``p2p_bandwidth``): NCCL needs a process per GPU.
* ``p2p_bandwidth`` and ``p2p_latency_s`` on the CPU device: a Gloo send between the same two ranks to a
  receive posted before it, the way the executor hands an activation to another rank, fitted as
  latency + bytes / bandwidth over 4 KiB to 16 MiB (on a 2-core VM about 80 us + bytes / 3 GB/s).
  So a plan of several ranks is simulated with the executor's route: rank to rank, not through host
  memory. Without Gloo it stays 0 and such plans are priced through host memory.
* with several GPUs, the same copy to every GPU at once gives the total the shared host link
  carries (``link_bandwidth``), and a copy from GPU 0 to GPU 1 ``p2p_bandwidth`` (best over sizes).
* usable GPU memory: the smallest free memory over the GPUs at probe time, less 5% for the
  allocator's fragmentation and kernel workspaces; host memory from ``os.sysconf``, up to 3/4 of
  it pinnable; host memory copies (``host_copy_bandwidth``): a CPU tensor copy of the largest size.
* the optimizer step on the GPU (``gpu_optimizer_bandwidth``, ``gpu_optimizer_call_s``,
  ``gpu_optimizer_tensor_s``): the executor's step of a pack on the device
  (``PackOptimizers.step_device``, Adam as the profiler builds it) for packs of 1 to 8 layers of
  4 parameters, 16 B to 2 MiB per layer and one of 16 Mi parameters, fitted as time = per call +
  per tensor x tensors + (3 W + 2 K) / bandwidth, the bytes the simulator charges (W and dW read, W
  written, the state read and written). On 2 CPU cores about 40 us per call and 8 us per tensor:
  a 16-tensor BERT block's step on the CPU device costs 0.17 ms more than its bytes;
  ``cpu_optimizer_scale`` and ``compute_scale`` stay 1: a profile made on this machine already
  holds its times (``harmony-opt calibrate`` fits them against a traced run).

Each timed figure is the fastest of ``repeats`` runs after a warm-up (the run least disturbed by
other work). Everything runs with ``threads`` intra-op threads (default: what the executor's one
rank uses on this device, ``runtime.optim.host_threads``), said in the description: a host copy
is itself multi-threaded (on a 2-core machine, 12.9 GB/s with two threads and 4.46 GB/s with
one), so a figure means little without its thread count.

Without CUDA (``device="cpu"``) the probe still runs, so that it is testable anywhere: the
"GPU" is the CPU, host<->device transfers are the executor's CPU swaps, the usable memory is half
of the memory available now, and the description says so.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import re
import statistics
import threading
import time

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..core.errors import UsageError
from ..core.hardware import Hardware
from ..core.kinds import Tensor
from ..core.units import GB, KiB, MiB, fmt_bytes
from .profiler import as_executed, device_name, resolve_device

#: Transfer sizes on a GPU; on the CPU device the largest is left out (a swap of 256 MiB on the CPU
#: spends a third of a second in page faults, and the probe would take a minute) and two small ones
#: are added: a microbatch's activations there are a few KiB, and the line over 64 KiB-16 MiB alone
#: put the fixed cost of a copy at 26-35 us in three probes, against 22-25 us with them and 14-18 us
#: traced for a copy of 8 KiB of vgg-tiny's activations.
DEFAULT_SIZES = (64 * KiB, 1 * MiB, 16 * MiB, 256 * MiB)
CPU_SIZES = (4 * KiB, 16 * KiB) + DEFAULT_SIZES[:3]
#: Share of free GPU memory the planner may use (the rest: fragmentation, workspaces).
GPU_MEMORY_USABLE = 0.95
#: Share of host memory that may be page-locked.
PINNABLE = 0.75
#: Parameters in the GPU optimizer-throughput test (16 M floats = 64 MB of weights).
_OPTIMIZER_PARAMS = 1 << 24
#: Parameters per layer of the transfer test: an activation is one tensor, a GPT-2 block twelve.
_TRANSFER_TENSORS = (1, 4, 16)
#: The optimizer test: packs of these many layers, of _UPDATE_TENSORS parameters each, at these
#: bytes per layer.
_UPDATE_PACKS = (1, 2, 4, 8)
_UPDATE_TENSORS = 4
_UPDATE_LAYER_BYTES = (16, 16 * KiB, 256 * KiB, 2 * MiB)
#: Largest all-reduce of the Gloo test.
_COLLECTIVE_MAX = 16 * MiB
#: copy_overlap: copy and compute overlap when together they take less than this share of the sum.
OVERLAP_SHARE = 0.8


def probe_hardware(device: str = "cuda", sizes: tuple[int, ...] | None = None, *, repeats: int = 5,
                   threads: int | None = None) -> Hardware:
    """Measure the machine (see the module docstring); ``device`` "cuda" or "cpu"; ``sizes``: transfer
    sizes in bytes (default DEFAULT_SIZES on a GPU, CPU_SIZES on the CPU); ``threads``: intra-op
    threads (default: the executor's)."""
    from harmony_opt.runtime.buffers import keep_freed_memory
    from harmony_opt.runtime.optim import host_threads, intra_op_threads

    dev = resolve_device(device)
    sizes = tuple(sorted(int(s) for s in (sizes or (CPU_SIZES if dev.type == "cpu" else DEFAULT_SIZES))))
    if not sizes or min(sizes) < 1 or isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise UsageError(f"probe needs at least one size >= 1 byte and repeats >= 1, got sizes {sizes!r}, "
                         f"repeats {repeats!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise UsageError(f"threads must be a whole number >= 1, got {threads!r}")
    threads = threads or host_threads(1, dev.type, torch.get_num_threads())
    keep_freed_memory()         # freed memory kept for reuse, as the executor keeps it
    with intra_op_threads(threads):
        return _probe(dev, sizes, repeats, threads)


def probe_summary(hw: Hardware) -> str:
    """The probed terms in one line, as ``harmony-opt probe`` prints them."""
    return (f"{hw.name}, {hw.gpus} device(s) of {fmt_bytes(hw.gpu_memory_bytes)} usable, "
            f"host->device {hw.h2d_latency_s * 1e6:.0f} us + {hw.h2d_bandwidth / 1e9:.1f} GB/s, device->host "
            f"{hw.d2h_latency_s * 1e6:.0f} us + {hw.d2h_bandwidth / 1e9:.1f} GB/s, "
            + (f"rank to rank {hw.p2p_latency_s * 1e6:.0f} us + {hw.p2p_bandwidth / 1e9:.1f} GB/s, "
               if hw.p2p_bandwidth > 0 else "")
            + (f"all-reduce {hw.collective_latency_s * 1e6:.0f} us + {hw.collective_bandwidth / 1e9:.2f} GB/s, "
               if hw.collective_bandwidth else "")
            + f"CPU optimizer {hw.cpu_optimizer_call_s * 1e6:.0f} us per call, device optimizer "
            f"{hw.gpu_optimizer_call_s * 1e6:.0f} us per call + {hw.gpu_optimizer_tensor_s * 1e6:.0f} us per tensor, "
            f"{hw.issue_overhead_s * 1e6:.0f} us "
            f"per compute instruction, copies {'beside' if hw.copy_overlap else 'in line with'} compute")


def _probe(dev: torch.device, sizes: tuple[int, ...], repeats: int, threads: int) -> Hardware:
    host_total = _host_memory()
    host_copy = _bandwidth(_cpu_copy, max(sizes), repeats)   # smaller copies stay in CPU caches
    moves = measure_transfers(dev, sizes, repeats)
    (h2d_lat, h2d), (d2h_lat, d2h) = (transfer_terms(moves[w]) for w in ("h2d", "d2h"))
    steps = {name: measure_cpu_optimizer(name, repeats) for name in ("adam", "sgd")}
    gpu_step = measure_gpu_optimizer(dev, repeats)
    gpu_terms = gpu_step_terms(gpu_step)
    call = max(call_cost(steps["adam"]), 0.0)
    # the median of three rounds: one round takes a few milliseconds, and one probe on this
    # project's shared 2-core machine measured 113 us where 12 others measured 37-52 us
    issue = max(statistics.median(measure_issue_overhead(dev, repeats) for _ in range(3)), 0.0)
    when = f"{datetime.date.today().isoformat()} with {threads} intra-op thread(s)"
    terms = (f"{_describe_transfers(moves)}; {_describe_steps(steps)}; {_describe_gpu_step(gpu_step, gpu_terms)}; "
             f"per compute instruction {issue * 1e6:.0f} us beyond the profiled kernels")
    if dev.type == "cpu":
        reduce_fit = measure_collective(sizes, repeats)
        reduce_lat, collective = latency_bandwidth(reduce_fit) if reduce_fit is not None else (0.0, None)
        handoff = measure_p2p(sizes, repeats)
        p2p_lat, p2p = latency_bandwidth(handoff) if handoff is not None else (0.0, 0.0)
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        name = device_name(dev)
        gloo = ("Gloo all-reduce between 2 ranks on loopback: not measured" if reduce_fit is None else
                f"Gloo all-reduce between 2 ranks on loopback {reduce_lat * 1e6:.0f} us + bytes / "
                f"{collective / GB:.2f} GB/s (worst point {reduce_fit.worst:.0%} off)")
        gloo += ("; Gloo send between 2 ranks: not measured (activations between ranks priced through host "
                 "memory)" if handoff is None else
                 f"; Gloo send between 2 ranks {p2p_lat * 1e6:.0f} us + bytes / {p2p / GB:.2f} GB/s "
                 f"(worst point {handoff.worst:.0%} off)")
        return Hardware(
            name=f"probed-cpu-{_slug(name)}", gpus=1, gpu_memory_bytes=max(avail // 2, 1),
            host_memory_bytes=host_total, pinned_memory_bytes=int(host_total * PINNABLE),
            h2d_bandwidth=h2d, d2h_bandwidth=d2h, shared_host_link=True, link_bandwidth=max(h2d, d2h),
            p2p_bandwidth=p2p, host_copy_bandwidth=host_copy,
            **gpu_terms,
            copy_overlap=False, h2d_latency_s=h2d_lat, d2h_latency_s=d2h_lat, p2p_latency_s=p2p_lat,
            cpu_optimizer_call_s=call,
            issue_overhead_s=issue, collective_bandwidth=collective, collective_latency_s=reduce_lat,
            description=(f"probed {when} on {name} WITHOUT a GPU: the device is the CPU, host<->device transfers "
                         f"are the executor's CPU swaps (a new tensor and a memcpy per parameter), run in "
                         f"program order on one thread (copy_overlap false), usable memory is half the "
                         f"available memory; host memcpy {host_copy / GB:.1f} GB/s; {terms}; {gloo}"))
    gpus = torch.cuda.device_count()
    ids = list(range(gpus))
    link = max(_bandwidth(lambda n: _h2d_all(n, ids), s, repeats) for s in sizes) if gpus > 1 else h2d
    p2p = max(_bandwidth(lambda n: _p2p_copy(n, 0, 1), s, repeats) for s in sizes) if gpus > 1 else 0.0
    overlap, together = measure_copy_overlap(dev, repeats)
    free = min(torch.cuda.mem_get_info(i)[0] for i in ids)
    name = device_name(dev)
    return Hardware(
        name=f"probed-{_slug(name)}-x{gpus}", gpus=gpus, gpu_memory_bytes=int(free * GPU_MEMORY_USABLE),
        host_memory_bytes=host_total, pinned_memory_bytes=int(host_total * PINNABLE),
        h2d_bandwidth=h2d, d2h_bandwidth=d2h, shared_host_link=True, link_bandwidth=max(link, h2d),
        p2p_bandwidth=p2p, host_copy_bandwidth=host_copy, **gpu_terms,
        copy_overlap=overlap, h2d_latency_s=h2d_lat, d2h_latency_s=d2h_lat, cpu_optimizer_call_s=call,
        issue_overhead_s=issue, collective_bandwidth=None,
        description=(f"probed {when}: {gpus}x {name}; {terms}; all GPUs at once {link / GB:.1f} GB/s, GPU<->GPU "
                     f"{p2p / GB:.1f} GB/s (all-reduce not measured: NCCL needs a process per GPU); a copy "
                     f"beside a matmul on two streams takes {together:.2f} x the two alone "
                     f"(copy_overlap {'true' if overlap else 'false'})"))


# -- fits ------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Fit:
    """``seconds = coef[0] + coef[1] * x[0] + coef[2] * x[1] + ...``, fitted to ``points`` ((x...), seconds)."""

    coef: tuple[float, ...]
    points: tuple[tuple[tuple[float, ...], float], ...]

    def predict(self, *x: float) -> float:
        return self.coef[0] + sum(c * v for c, v in zip(self.coef[1:], x))

    @property
    def worst(self) -> float:
        """The largest relative error of the fit over its points."""
        return max(abs(self.predict(*x) - t) / t for x, t in self.points)


def fit_linear(xs, seconds) -> Fit:
    """Least squares of ``seconds = c0 + c1 x1 + ...`` over relative residuals (each point weighted
    by 1 / seconds, so that a copy of a few KB counts as much as one of a few hundred MB);
    ``xs``: one number or one tuple of numbers per point."""
    rows = [tuple(float(v) for v in (x if isinstance(x, (tuple, list)) else (x,))) for x in xs]
    t = np.asarray([float(s) for s in seconds])
    if len(rows) != len(t) or not rows or len({len(r) for r in rows}) != 1:
        raise UsageError("fit_linear: give one row of the same length per time")
    if len(rows) < len(rows[0]) + 1 or not (t > 0).all():
        raise UsageError(f"fit_linear: needs at least {len(rows[0]) + 1} points with positive times, "
                         f"got {len(rows)}")
    a = np.column_stack([np.ones(len(rows)), np.asarray(rows)])
    coef, *_ = np.linalg.lstsq(a / t[:, None], np.ones(len(t)), rcond=None)
    return Fit(tuple(float(c) for c in coef), tuple(zip(rows, t.tolist())))


def latency_bandwidth(fit: Fit) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) as a Hardware holds them, from a fit of seconds over bytes, or over
    (bytes, tensors): then the latency is that of a one-tensor transfer. The latency is no lower than 0,
    and where noise made the slope flat or negative, the bandwidth is the best bytes / seconds of the
    fit's points."""
    latency = fit.coef[0] + (fit.coef[2] if len(fit.coef) > 2 else 0.0)
    per_byte = fit.coef[1]
    if not per_byte > 0:
        return max(latency, 0.0), max(x[0] / t for x, t in fit.points)
    return max(latency, 0.0), 1.0 / per_byte


def transfer_fit(points: list) -> Fit:
    """seconds = c0 + bytes / bandwidth + tensors x per tensor fitted to ``[((bytes, tensors), seconds), ...]``
    (over bytes alone where every point has the same tensor count)."""
    if len({x[1] for x, _ in points}) < 2:
        return fit_linear([x[0] for x, _ in points], [t for _, t in points])
    return fit_linear([x for x, _ in points], [t for _, t in points])


def transfer_terms(points: list) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of a direction's ``[((bytes, tensors), seconds), ...]``; with a single
    size latency and bandwidth cannot be told apart: no latency, and the best bytes / seconds."""
    if len({x[0] for x, _ in points}) < 2:
        return 0.0, max(x[0] / t for x, t in points)
    return latency_bandwidth(transfer_fit(points))


def call_cost(fit: Fit) -> float:
    """The fitted optimizer step over one one-element parameter: per call + one tensor (+ 4 bytes)."""
    return fit.predict(4.0, 1.0)


# -- the executor's code paths ------------------------------------------------------------------------

class _Weights(nn.Module):
    """A layer of ``count`` parameters of ``numel`` floats: what a swap of its weights moves."""

    def __init__(self, count: int, numel: int):
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.full((numel,), 1e-2)) for _ in range(count))

    def forward(self, x):
        return x


class _MSE(nn.Module):
    """The loss layer of the dispatch test."""

    def forward(self, y, target):
        return F.mse_loss(y, target)


def _ins(i: int, kind, layers: tuple[int, int], stream, tensor=None, u: int | None = None, waits=()):
    from harmony_opt.compile.program import Instr

    rows = {} if u is None else {"mb": 0, "offset": 0, "size": u}
    return Instr(id=i, kind=kind, layers=layers, stream=stream, tensor=tensor, waits_on=tuple(waits), **rows)


def _executor(layers: list[nn.Module], instrs: list, dev: torch.device, packs=(), factory=None, batch: int = 1,
              trace: bool = True):
    """An :class:`Executor` of one rank running ``instrs`` over ``layers`` (traced); the caller runs
    instructions one at a time through ``Executor._execute`` (the dispatch of every training
    iteration) and closes it."""
    from harmony_opt.compile.program import Program
    from harmony_opt.runtime.executor import Executor
    from harmony_opt.runtime.optim import PackOptimizers, make_factory

    program = Program(ranks=(tuple(instrs),), num_layers=len(layers), mode="probe", batch=batch,
                      samples=(batch,), sample_offsets=(0,))
    optim = PackOptimizers(layers, list(packs), factory or make_factory("sgd", 1e-3))
    return Executor(program, 0, layers, optim, [((1,), torch.float32)] * len(layers), device=dev, trace=trace)


class _Compute:
    """A host matmul, run untimed before a swap-out: in a program a swap-out follows the compute that made
    its tensor, which has evicted the caches the instructions before it warmed (a swap-in mostly follows
    other transfers: the next inputs are prefetched back to back). On the CPU, the executor's swap-out of
    16 KB timed right after the swap-in takes 30 us, after the matmul 55-80 us, and in a traced run of
    gpt2-tiny 65-90 us; its swap-ins there take 40-65 us, as right after another transfer."""

    def __init__(self):
        gen = torch.Generator().manual_seed(0)
        self.a, self.b = torch.randn(64, 512, generator=gen), torch.randn(512, 512, generator=gen)

    def __call__(self) -> None:
        torch.mm(self.a, self.b)


def _traced(ex, ids: list[int], dev: torch.device, before: dict | None = None) -> dict[int, float]:
    """Run instructions ``ids`` of the executor in order (``before[i]()`` untimed before instruction ``i``);
    seconds of each as the executor's tracer records them."""
    ex.tracer.begin()
    for i in ids:
        ins = ex.instrs[i]
        if before and i in before:
            before[i]()
        ex._execute(i, ins)
        if ins.id in ex._pending:     # a CPU update: it steps on the worker thread
            ex._wait(ins.id)
    ex.streams.finish(dev)
    ex.tracer.finish()
    rows = ex.tracer.result()["events"]
    by_name = {str(ex.instrs[i]): ex.instrs[i].id for i in ids}
    return {by_name[r[3]]: r[7] - r[6] for r in rows if r[3] in by_name}


def measure_transfers(dev: str | torch.device, sizes: tuple[int, ...], repeats: int = 5,
                      counts: tuple[int, ...] = _TRANSFER_TENSORS) -> dict[str, list]:
    """Seconds of the executor's weight swap-in (``h2d``) and swap-out (``d2h``) of a layer of ``count``
    parameters of ``size`` bytes in all, for each size and count: ``{direction: [((bytes, count),
    seconds), ...]}``, the fastest of ``repeats`` runs after a warm-up."""
    from harmony_opt.compile.program import Kind, Stream
    from harmony_opt.runtime.buffers import can_pin

    dev = torch.device(dev)
    rigs = []
    try:
        for size in sizes:
            for count in counts:
                numel = max(1, size // (4 * count))
                layer = _Weights(count, numel)
                if can_pin():     # as training.py pins the master weights
                    for p in layer.parameters():
                        p.data = p.data.pin_memory()
                instrs = [_ins(0, Kind.SWAP_IN, (0, 0), Stream.SWAP_IN, Tensor.W),
                          _ins(1, Kind.SWAP_OUT, (0, 0), Stream.SWAP_OUT, Tensor.W, waits=(0,)),
                          _ins(2, Kind.FREE, (0, 0), Stream.COMPUTE, Tensor.W, waits=(1,))]
                rigs.append(((4 * numel * count, count), _executor([layer], instrs, dev)))
        before = {1: _Compute()}
        runs = _interleaved([lambda ex=ex: _traced(ex, [0, 1, 2], dev, before) for _, ex in rigs], repeats)
    finally:
        for _, ex in rigs:
            ex.close()
    return {way: [(x, min(r[i] for r in rs)) for (x, _), rs in zip(rigs, runs)] for i, way in enumerate(("h2d", "d2h"))}


def _interleaved(fns: list, repeats: int) -> list[list]:
    """``repeats`` results of each function after one warm-up call, the functions taken in turn, so that a
    spell of other work on the machine slows one run of each rather than every run of one."""
    out = [[] for _ in fns]
    for k in range(repeats + 1):
        for i, fn in enumerate(fns):
            r = fn()
            if k:
                out[i].append(r)
    return out


def measure_cpu_optimizer(optimizer: str = "adam", repeats: int = 5, packs: tuple[int, ...] = _UPDATE_PACKS,
                          layer_bytes: tuple[int, ...] = _UPDATE_LAYER_BYTES) -> Fit:
    """The executor's CPU update of a pack (``PackOptimizers.step_host`` on its worker thread) for packs of
    ``packs`` layers of ``_UPDATE_TENSORS`` parameters and ``layer_bytes`` bytes each, fitted as
    seconds = per call + per byte x bytes + per tensor x tensors (x = (bytes, tensors));
    ``optimizer`` "adam" or "sgd" (momentum 0.9, as the profiler builds it)."""
    from harmony_opt.compile.program import Kind, Stream
    from harmony_opt.runtime.optim import make_factory

    if optimizer not in ("adam", "sgd"):
        raise UsageError(f"optimizer must be adam or sgd, got {optimizer!r}")
    factory = make_factory("adam", 1e-4) if optimizer == "adam" else make_factory("sgd", 1e-3, momentum=0.9)
    ranges, first = [], 0
    for n in packs:
        ranges.append((first, first + n - 1))
        first += n
    instrs = [_ins(i, Kind.UPD, r, Stream.CPU) for i, r in enumerate(ranges)]
    cpu, rigs = torch.device("cpu"), []
    try:
        for per_layer in layer_bytes:
            numel = max(1, per_layer // (4 * _UPDATE_TENSORS))
            ex = _executor([_Weights(_UPDATE_TENSORS, numel) for _ in range(first)], instrs, cpu, ranges, factory)
            for g in ex.optim.grads.values():
                g.fill_(1e-3)
            rigs.append((numel, ex))
        runs = _interleaved([lambda ex=ex: _traced(ex, list(range(len(instrs))), cpu) for _, ex in rigs], repeats)
    finally:
        for _, ex in rigs:
            ex.close()
    xs, ts = [], []
    for (numel, _), rs in zip(rigs, runs):
        for i, n in enumerate(packs):
            xs.append((4.0 * numel * _UPDATE_TENSORS * n, float(_UPDATE_TENSORS * n)))
            ts.append(min(r[i] for r in rs))
    return fit_linear(xs, ts)


def measure_issue_overhead(dev: str | torch.device, repeats: int = 5, width: int = 8, u: int = 1) -> float:
    """Seconds per compute instruction that the executor spends beyond the profiled kernels: a forward,
    a recompute and a backward of a pack of a ``width`` x ``width`` Linear and an MSE loss on ``u``
    samples through ``Executor._execute``, less the same layers timed as the profiler times them,
    divided by the three instructions."""
    from harmony_opt.compile.program import Kind, Stream

    dev = torch.device(dev)
    with torch.random.fork_rng(devices=[]):     # the caller's random state is left as it was
        torch.manual_seed(0)
        layers = [nn.Linear(width, width), _MSE()]
        x, target = torch.randn(u, width), torch.randn(u, width)
    C, I = Stream.COMPUTE, Stream.SWAP_IN
    instrs = [_ins(0, Kind.SWAP_IN, (0, 0), I, Tensor.X, u), _ins(1, Kind.SWAP_IN, (1, 1), I, Tensor.T, u),
              _ins(2, Kind.SWAP_IN, (0, 1), I, Tensor.W), _ins(3, Kind.SWAP_IN, (0, 1), I, Tensor.B),
              _ins(4, Kind.FWD, (0, 0), C, None, u, waits=(0, 2, 3)), _ins(5, Kind.FREE, (1, 1), C, Tensor.X, u),
              _ins(6, Kind.REC, (0, 1), C, None, u, waits=(1,)), _ins(7, Kind.BWD, (0, 1), C, None, u),
              _ins(8, Kind.FREE, (0, 1), C, Tensor.SA, u), _ins(9, Kind.FREE, (0, 1), C, Tensor.DW),
              _ins(10, Kind.FREE, (0, 1), C, Tensor.W), _ins(11, Kind.FREE, (0, 1), C, Tensor.B),
              _ins(12, Kind.FREE, (0, 0), C, Tensor.X, u), _ins(13, Kind.FREE, (1, 1), C, Tensor.T, u)]
    ex = _executor(layers, instrs, dev, batch=u, trace=False)
    ex.host.stage(("data",), x)
    ex.host.stage(("T",), target)
    ex._loss = torch.zeros((), dtype=torch.float64, device=dev)
    try:
        for i in range(4):
            ex._execute(i, instrs[i])
        timed = {4: [], 6: [], 7: []}
        for _ in range(repeats + 1):
            for i in range(4, 10):
                _sync(dev)
                t0 = time.perf_counter()
                ex._execute(i, instrs[i])
                _sync(dev)
                if i in timed:
                    timed[i].append(time.perf_counter() - t0)
        for i in range(10, 14):
            ex._execute(i, instrs[i])
    finally:
        ex.close()
    executor = sum(min(v[1:]) for v in timed.values())
    return (executor - _bare_kernels(layers, x, target, dev, repeats)) / 3


def _bare_kernels(layers: list[nn.Module], x: torch.Tensor, target: torch.Tensor, dev: torch.device,
                  repeats: int) -> float:
    """Forward of the first layer plus the backward (forward with autograd, then backward) of both, run
    as the profiler runs a layer alone; the fastest of ``repeats`` runs each."""
    layers = [layer.to(dev) for layer in layers]
    x, target = x.to(dev), target.to(dev)
    with torch.no_grad():
        y = layers[0](x)
    calls = [as_executed(layer) for layer in layers]

    def fwd():
        with torch.no_grad():
            return calls[0](x, None)

    def bwd(call, inp, tgt):
        def run():
            xi = inp.detach().requires_grad_(inp.is_floating_point())
            out = call(xi, tgt)
            out.backward(None if tgt is not None else torch.ones_like(out))
        return run

    return sum(_fastest(fn, dev, repeats) for fn in (fwd, bwd(calls[0], x, None), bwd(calls[1], y, target)))


def _fastest(fn, dev: torch.device, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_copy_overlap(dev: torch.device, repeats: int = 5, nbytes: int = 64 * MiB) -> tuple[bool, float]:
    """On CUDA: a pinned host->GPU copy of ``nbytes`` and matmuls of about the same time, alone and
    together on two streams; (together < OVERLAP_SHARE x alone summed, together / alone summed)."""
    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    a = torch.randn(2048, 2048, device=dev)
    s_copy, s_mm = torch.cuda.Stream(dev), torch.cuda.Stream(dev)

    def copy():
        with torch.cuda.stream(s_copy):
            dst.copy_(host, non_blocking=True)

    def matmuls(k):
        def run():
            with torch.cuda.stream(s_mm):
                for _ in range(k):
                    torch.mm(a, a)
        return run

    t_copy, t_mm = _fastest(copy, dev, repeats), _fastest(matmuls(1), dev, repeats)
    mm = matmuls(max(1, round(t_copy / max(t_mm, 1e-9))))
    alone = t_copy + _fastest(mm, dev, repeats)
    together = _fastest(lambda: (copy(), mm()), dev, repeats)
    return together < OVERLAP_SHARE * alone, together / alone


def _gloo_pair(setup_limit_s: float):
    """Two Gloo process groups of one two-rank world, in two threads of this process; None where Gloo
    is missing or takes over ``setup_limit_s`` to set up."""
    import torch.distributed as dist
    from datetime import timedelta

    if not dist.is_available() or not hasattr(dist, "ProcessGroupGloo"):
        return None
    store, groups = dist.HashStore(), [None, None]
    t0 = time.perf_counter()

    def make(rank):
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=setup_limit_s + 10))

    if not _both(make, setup_limit_s + 10) or time.perf_counter() - t0 > setup_limit_s:
        return None
    return groups


def measure_collective(sizes: tuple[int, ...], repeats: int = 5, setup_limit_s: float = 2.0) -> Fit | None:
    """seconds = latency + bytes / bandwidth of a Gloo all-reduce of one float tensor between two ranks
    on loopback (``runtime.comm`` reduces a pack's dW as one flat buffer), fitted over 4 KiB and
    ``sizes`` up to 16 MiB, each the fastest of ``repeats`` after a warm-up; None where Gloo is missing
    or takes over ``setup_limit_s`` to set up."""
    groups = _gloo_pair(setup_limit_s)
    if groups is None:
        return None
    points = []
    for nbytes in sorted({4 * KiB, *(max(4, min(s, _COLLECTIVE_MAX)) for s in sizes)}):
        times = [float("inf"), float("inf")]
        buffers = [torch.ones(nbytes // 4) for _ in range(2)]

        def run(rank):
            groups[rank].allreduce([buffers[rank]]).wait()
            for _ in range(repeats):
                start = time.perf_counter()
                groups[rank].allreduce([buffers[rank]]).wait()
                times[rank] = min(times[rank], time.perf_counter() - start)

        if not _both(run, 60):
            return None
        points.append(((nbytes // 4) * 4, max(times)))
    return fit_linear([b for b, _ in points], [t for _, t in points])


def measure_p2p(sizes: tuple[int, ...], repeats: int = 5, setup_limit_s: float = 2.0) -> Fit | None:
    """seconds = latency + bytes / bandwidth of a Gloo send to a receive posted before it, between two
    ranks on loopback (what ``runtime.comm`` does with an activation handed to another rank on the CPU
    device), fitted over 4 KiB and ``sizes`` up to 16 MiB, each the fastest of ``repeats`` after a
    warm-up; None where Gloo is missing or slow to set up."""
    groups = _gloo_pair(setup_limit_s)
    if groups is None:
        return None
    points = []
    for nbytes in sorted({4 * KiB, *(max(4, min(s, _COLLECTIVE_MAX)) for s in sizes)}):
        src, dst, best = torch.ones(nbytes // 4), torch.empty(nbytes // 4), [float("inf")]
        ready = [threading.Event() for _ in range(repeats + 1)]

        def run(rank):
            for i in range(repeats + 1):
                if rank == 1:
                    work = groups[1].recv([dst], 0, i)
                    ready[i].set()
                    start = time.perf_counter()
                    work.wait()
                    if i:
                        best[0] = min(best[0], time.perf_counter() - start)
                else:
                    ready[i].wait(10)
                    groups[0].send([src], 1, i).wait()

        if not _both(run, 60):
            return None
        points.append((nbytes, best[0]))
    return fit_linear([b for b, _ in points], [t for _, t in points])


def _both(fn, timeout: float) -> bool:
    """Run ``fn(0)`` and ``fn(1)`` on two threads; whether both finished within ``timeout`` seconds
    without an error."""
    errors = []

    def guarded(rank):
        try:
            fn(rank)
        except Exception as e:     # a Gloo that cannot bind loopback: the figure is left out
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(r,), daemon=True) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return not errors and not any(t.is_alive() for t in threads)


# -- the description ---------------------------------------------------------------------------------

def _describe_transfers(moves: dict[str, list]) -> str:
    parts = []
    for way, label in (("h2d", "host->device"), ("d2h", "device->host")):
        if len({x[0] for x, _ in moves[way]}) < 2:
            parts.append(f"{label} bytes / {transfer_terms(moves[way])[1] / GB:.2f} GB/s (one size: no latency)")
            continue
        fit = transfer_fit(moves[way])
        lat, bw = latency_bandwidth(fit)
        line = fit_linear([x[0] for x, _ in moves[way]], [t for _, t in moves[way]])
        more = f" + {fit.coef[2] * 1e6:.1f} us per further tensor" if len(fit.coef) > 2 else ""
        parts.append(f"{label} {lat * 1e6:.0f} us + bytes / {bw / GB:.2f} GB/s{more} (worst point {fit.worst:.0%} "
                     f"off; a line over all points without the tensor count: {max(line.coef[0], 0) * 1e6:.0f} us + "
                     f"bytes / {1 / line.coef[1] / GB if line.coef[1] > 0 else float('inf'):.2f} GB/s)")
    return "executor swaps " + ", ".join(parts)


def _describe_steps(steps: dict[str, Fit]) -> str:
    def one(name, f):
        bw = 1 / f.coef[1] if f.coef[1] > 0 else float("inf")
        return (f"{name} {call_cost(f) * 1e6:.0f} us per call of one tensor + {f.coef[2] * 1e6:.1f} us per further "
                f"tensor + bytes of W / "
                f"{bw / GB:.2f} GB/s (worst point {f.worst:.0%} off)")
    text = "CPU optimizer per pack (cpu_optimizer_call_s is Adam's) " + ", ".join(one(n, f) for n, f in steps.items())
    if {"adam", "sgd"} <= set(steps):
        text += f" (SGD's call {call_cost(steps['sgd']) / call_cost(steps['adam']):.2f} x Adam's)"
    return text


# -- bandwidths of plain copies: each takes a size and returns a function that runs the copy `repeats`
# times and returns the seconds it took, so that the buffers are allocated outside the timing.


def _bandwidth(make_copy, nbytes: int, repeats: int, trials: int = 3) -> float:
    """Bytes per second of ``repeats`` back-to-back copies of ``nbytes``, the best of ``trials``
    runs after one warm-up copy (the best run is the one least disturbed by other work)."""
    run, total_bytes = make_copy(nbytes)
    run(1)
    return total_bytes * repeats / min(run(repeats) for _ in range(trials))


def _cpu_copy(n: int):
    src, dst = torch.ones(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)

    def run(k: int) -> float:
        t0 = time.perf_counter()
        for _ in range(k):
            dst.copy_(src)
        return time.perf_counter() - t0

    return run, n


def _cuda_timed(pairs: list[tuple[torch.Tensor, torch.Tensor]], devices: list[int]):
    """Copy each (dst, src) pair ``k`` times, all pairs at once; wall time to the last GPU's sync
    (CUDA events of one GPU cannot time copies that run on several)."""
    def run(k: int) -> float:
        for d in devices:
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        for _ in range(k):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        for d in devices:
            torch.cuda.synchronize(d)
        return time.perf_counter() - t0

    return run


def _events_timed(dst: torch.Tensor, src: torch.Tensor, device: int):
    """Copy ``k`` times on the current stream of ``device``, timed with CUDA events."""
    def run(k: int) -> float:
        with torch.cuda.device(device):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(k):
                dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1e3

    return run


def _h2d_all(n: int, gpus: list[int]):
    pairs = [(torch.empty(n, dtype=torch.uint8, device=g), torch.ones(n, dtype=torch.uint8).pin_memory())
             for g in gpus]
    return _cuda_timed(pairs, gpus), n * len(gpus)


def _p2p_copy(n: int, a: int, b: int):
    src = torch.ones(n, dtype=torch.uint8, device=a)
    return _events_timed(torch.empty(n, dtype=torch.uint8, device=b), src, a), n


# -- memory and optimizer ------------------------------------------------------------------------

def _host_memory() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def measure_gpu_optimizer(dev: str | torch.device, repeats: int = 5, packs: tuple[int, ...] = _UPDATE_PACKS,
                          layer_bytes: tuple[int, ...] = _UPDATE_LAYER_BYTES,
                          large: int = _OPTIMIZER_PARAMS) -> Fit:
    """The executor's optimizer step of a pack on ``dev`` (``PackOptimizers.step_device`` over device
    weights, gradients and state, Adam as the profiler builds it) for packs of ``packs`` layers of
    ``_UPDATE_TENSORS`` parameters and ``layer_bytes`` bytes each, and one layer of one ``large``-float
    parameter (``large`` 0: none), as seconds = per call + per byte x (3 W + 2 K) + per tensor x tensors
    (x = (bytes, tensors)); the fastest of ``repeats`` runs after a warm-up step. The packs give the
    per call and per tensor costs (least squares, :func:`fit_linear`), the large step the per byte
    cost beyond them: the packs' bytes stay in the caches of a CPU device, whose step over 470 MB
    then runs at half their rate (on 2 CPU cores 16.8 ms against 8.8 ms from the packs' slope)."""
    from harmony_opt.runtime.optim import PackOptimizers, make_factory

    dev = torch.device(dev)
    factory = make_factory("adam", 1e-4)
    shapes = [(n, _UPDATE_TENSORS, max(1, b // (4 * _UPDATE_TENSORS))) for b in layer_bytes for n in packs]
    shapes += [(1, 1, int(large))] if large else []
    xs, ts = [], []
    for n, count, numel in shapes:
        layers = [_Weights(count, numel) for _ in range(n)]
        pack = (0, n - 1)
        opt = PackOptimizers(layers, [pack], factory)
        weights = {l: {k: p.detach().to(dev) for k, p in layers[l].named_parameters()} for l in range(n)}
        grads = {l: {k: torch.full_like(v, 1e-3) for k, v in weights[l].items()} for l in range(n)}
        state = opt.state_to_device(pack, dev)
        opt.step_device(pack, weights, grads, state)      # allocates the state
        state_bytes = sum(v.numel() * v.element_size() for st in state.values() for d in st.values()
                          for v in d.values())
        w = 4 * numel * count * n
        xs.append((3.0 * w + 2.0 * state_bytes, float(count * n)))
        ts.append(_fastest(lambda: opt.step_device(pack, weights, grads, state), dev, repeats))
    if not large:
        return fit_linear(xs, ts)
    c0, c1, c2 = fit_linear(xs[:-1], ts[:-1]).coef
    (nbytes, tensors), t = xs[-1], ts[-1]
    beyond = t - c0 - c2 * tensors
    return Fit((c0, beyond / nbytes if beyond > 0 else c1, c2), tuple(zip(xs, ts)))


def gpu_step_terms(fit: Fit) -> dict:
    """The Hardware fields of a :func:`measure_gpu_optimizer` fit: the bandwidth (of the fit's points,
    the best bytes per second where noise made the slope flat), and the per call and per tensor costs,
    each at least 0."""
    per_byte = fit.coef[1]
    bw = 1.0 / per_byte if per_byte > 0 else max(x[0] / t for x, t in fit.points)
    return {"gpu_optimizer_bandwidth": float(bw), "gpu_optimizer_call_s": max(fit.coef[0], 0.0),
            "gpu_optimizer_tensor_s": max(fit.coef[2], 0.0)}


def _describe_gpu_step(fit: Fit, t: dict) -> str:
    """The fit and the Hardware fields taken from it (``gpu_step_terms``), in words."""
    return (f"optimizer step on the device {t['gpu_optimizer_call_s'] * 1e6:.0f} us per call + "
            f"{t['gpu_optimizer_tensor_s'] * 1e6:.1f} us per tensor + bytes of 3 W + 2 K / "
            f"{t['gpu_optimizer_bandwidth'] / GB:.1f} GB/s (worst point {fit.worst:.0%} off)")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "device"
