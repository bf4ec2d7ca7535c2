"""Measure this machine and describe it as a :class:`~harmony_opt.core.hardware.Hardware`.

::

    hw = probe_hardware("cuda")       # pinned host<->GPU, GPU<->GPU, memory, optimizer speed
    hw.save("hardware.toml")

What is measured, and how:

* host->GPU and GPU->host: copies between a pinned host buffer and a GPU buffer,
  timed with CUDA events, ``repeats`` back-to-back copies per size (best of 3 runs);
  the bandwidth is the best over ``sizes`` (small copies are latency-bound, so the best is the
  sustained rate). With several GPUs, the same copy to every GPU at once gives the
  total the shared host link carries (``link_bandwidth``), and a copy from GPU 0
  to GPU 1 gives ``p2p_bandwidth``.
* usable GPU memory: the smallest free memory over the GPUs at probe time, less 5%
  for the allocator's fragmentation and kernel workspaces.
* host memory from ``os.sysconf``; up to 3/4 of it may be pinned.
* host memory copies (``host_copy_bandwidth``): a CPU tensor copy of the largest size
  (smaller ones run from the CPU caches).
* optimizer speed: an Adam step on the GPU gives ``gpu_optimizer_bandwidth`` (bytes of
  W + dW + state per second). The CPU's Adam speed is reported in the description;
  ``cpu_optimizer_scale`` stays 1 because a profile made on this machine already
  holds this CPU's ``cpu_update_s``.

Everything runs with ``threads`` intra-op threads (default: what the executor's one rank uses on
this device, ``runtime.optim.host_threads``), said in the description: a host copy is itself
multi-threaded (on a 2-core machine, 12.9 GB/s with two threads and 4.46 GB/s with one), so a
figure means little without its thread count.

Without CUDA (``device="cpu"``) the probe still runs, so that it is testable anywhere:
the "GPU" is the CPU, host<->device bandwidths are host memcpy bandwidths, the usable
memory is half of the memory available now, and the description says so.
"""
from __future__ import annotations

import datetime
import os
import re
import time

import torch

from ..core.errors import UsageError
from ..core.hardware import Hardware
from ..core.units import GB, MiB
from .profiler import device_name, resolve_device

DEFAULT_SIZES = (4 * MiB, 32 * MiB, 256 * MiB)
#: Share of free GPU memory the planner may use (the rest: fragmentation, workspaces).
GPU_MEMORY_USABLE = 0.95
#: Share of host memory that may be page-locked.
PINNABLE = 0.75
#: Parameters in the optimizer-throughput test (16 M floats = 64 MB of weights).
_OPTIMIZER_PARAMS = 1 << 24


def probe_hardware(device: str = "cuda", sizes: tuple[int, ...] = DEFAULT_SIZES, *, repeats: int = 5,
                   threads: int | None = None) -> Hardware:
    """Measure the machine (see the module docstring); ``device`` "cuda" or "cpu"; ``threads``: intra-op
    threads (default: the executor's)."""
    from harmony_opt.runtime.optim import host_threads, intra_op_threads

    dev = resolve_device(device)
    sizes = tuple(int(s) for s in sizes)
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise UsageError(f"threads must be a whole number >= 1, got {threads!r}")
    threads = threads or host_threads(1, dev.type, torch.get_num_threads())
    with intra_op_threads(threads):
        return _probe(dev, sizes, repeats, threads)


def _probe(dev: torch.device, sizes: tuple[int, ...], repeats: int, threads: int) -> Hardware:
    host_total = _host_memory()
    host_copy = _bandwidth(_cpu_copy, max(sizes), repeats)   # smaller copies stay in CPU caches
    cpu_adam = _optimizer_bandwidth(torch.device("cpu"), _OPTIMIZER_PARAMS)   # smaller: thread wake-ups dominate
    when = f"{datetime.date.today().isoformat()} with {threads} intra-op thread(s)"
    if dev.type == "cpu":
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        name = device_name(dev)
        return Hardware(
            name=f"probed-cpu-{_slug(name)}", gpus=1, gpu_memory_bytes=max(avail // 2, 1),
            host_memory_bytes=host_total, pinned_memory_bytes=int(host_total * PINNABLE),
            h2d_bandwidth=host_copy, d2h_bandwidth=host_copy, shared_host_link=True, link_bandwidth=host_copy,
            p2p_bandwidth=0.0, host_copy_bandwidth=host_copy, gpu_optimizer_bandwidth=cpu_adam,
            description=(f"probed {when} on {name} WITHOUT a GPU: the device is the CPU, host<->device bandwidths "
                         f"are host memcpy ({host_copy / GB:.1f} GB/s), usable memory is half the available memory; "
                         f"CPU Adam {cpu_adam / GB:.2f} GB/s"))
    gpus = torch.cuda.device_count()
    ids = list(range(gpus))
    h2d = max(_bandwidth(lambda n: _h2d_copy(n, 0), s, repeats) for s in sizes)
    d2h = max(_bandwidth(lambda n: _d2h_copy(n, 0), s, repeats) for s in sizes)
    link = max(_bandwidth(lambda n: _h2d_all(n, ids), s, repeats) for s in sizes) if gpus > 1 else h2d
    p2p = max(_bandwidth(lambda n: _p2p_copy(n, 0, 1), s, repeats) for s in sizes) if gpus > 1 else 0.0
    free = min(torch.cuda.mem_get_info(i)[0] for i in ids)
    name = device_name(dev)
    gpu_adam = _optimizer_bandwidth(dev, _OPTIMIZER_PARAMS)
    return Hardware(
        name=f"probed-{_slug(name)}-x{gpus}", gpus=gpus, gpu_memory_bytes=int(free * GPU_MEMORY_USABLE),
        host_memory_bytes=host_total, pinned_memory_bytes=int(host_total * PINNABLE),
        h2d_bandwidth=h2d, d2h_bandwidth=d2h, shared_host_link=True, link_bandwidth=link,
        p2p_bandwidth=p2p, host_copy_bandwidth=host_copy, gpu_optimizer_bandwidth=gpu_adam,
        description=(f"probed {when}: {gpus}x {name}; pinned host->GPU {h2d / GB:.1f} GB/s, GPU->host "
                     f"{d2h / GB:.1f} GB/s, all GPUs at once {link / GB:.1f} GB/s, GPU<->GPU {p2p / GB:.1f} GB/s; "
                     f"CPU Adam {cpu_adam / GB:.2f} GB/s"))


# -- transfers: each takes a size and returns a function that runs the copy `repeats` times ------
# and returns the seconds it took, so that the buffers are allocated outside the timing.

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


def _h2d_copy(n: int, gpu: int):
    host = torch.ones(n, dtype=torch.uint8).pin_memory()
    return _events_timed(torch.empty(n, dtype=torch.uint8, device=gpu), host, gpu), n


def _d2h_copy(n: int, gpu: int):
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    return _events_timed(host, torch.ones(n, dtype=torch.uint8, device=gpu), gpu), n


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


def _optimizer_bandwidth(dev: torch.device, numel: int, steps: int = 3) -> float:
    """Bytes of W + dW + Adam state (4 x the weights) an Adam step processes per second on ``dev``,
    built as the runtime's optimizer (with the caller's intra-op threads)."""
    from harmony_opt.runtime.optim import make_factory

    w = torch.zeros(numel, device=dev, requires_grad=True)
    w.grad = torch.full_like(w, 1e-3)
    opt = make_factory("adam", 1e-4)([w])
    opt.step()   # allocates the state
    _sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.step()
    _sync(dev)
    return 4 * w.numel() * w.element_size() * steps / (time.perf_counter() - t0)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:40] or "device"
