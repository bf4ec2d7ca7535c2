"""Benchmark: the CPU optimizer step alone and beside the work a training step runs with it.

The executor steps the optimizer of CPU-updated packs on a worker thread while the main
thread issues GPU kernels and the copy streams move weights and gradients over the host
link. This times one Adam step over a GPT-2 XL block's parameters (30.7 M, in 12 tensors)
for three implementations (``torch.optim.Adam`` with the per-parameter loop, foreach, fused)
and three intra-op thread counts (every core, two fewer as ``runtime.optim.host_threads``
leaves on a GPU, half), each alone, beside pinned host<->GPU copies on two streams, beside a
thread issuing small kernels, and beside both. Each figure is the median of 5 steps.

    python benchmarks/bench_cpu_step.py        # needs CUDA; writes benchmarks/results/cpu_step.{md,json}
    python benchmarks/bench_cpu_step.py --whole 3   # GPT-2 XL's 48 blocks as the executor steps them,
                                                    # in 3 fresh processes per host memory layout

``--whole`` asks whether the step's speed differs from process to process (the GPU experiment
measured GPT-2 XL's CPU steps at 1.0x, 2.1-2.9x and 1.2-2.3x of the profiled time in different
runs): every block's parameters and gradients, one fused Adam per pack of 4 blocks (as the
executor makes one optimizer per pack), stepped on a worker thread with two cores fewer, the
parameters and gradients pinned (as the executor holds them) or pageable; writes
``cpu_step_whole.{md,json}``.

The per-parameter loop with every core collapses beside the other work (its OpenMP team
spins against the threads that issue GPU work), which is why the runtime steps fused with
two cores fewer.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

from harmony_opt.core.io import atomic_write_json, atomic_write_text

BLOCK = 30_700_000                     # parameters of one GPT-2 XL transformer block
IMPLS = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def _copies(stop: threading.Event, nbytes: int = 512 << 20) -> None:
    h, h2 = (torch.empty(nbytes // 4, pin_memory=True) for _ in range(2))
    d = torch.empty(nbytes // 4, device="cuda")
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    while not stop.is_set():
        with torch.cuda.stream(s1):
            d.copy_(h, non_blocking=True)
        with torch.cuda.stream(s2):
            h2.copy_(d, non_blocking=True)
        s1.synchronize()
        s2.synchronize()


def _kernels(stop: threading.Event) -> None:
    x = torch.randn(1024, 1024, device="cuda")
    while not stop.is_set():
        for _ in range(200):            # many small launches keep the issuing thread busy
            x = torch.tanh(x * 1.0001)
        torch.cuda.synchronize()


BESIDE = {"alone": (), "copies": (_copies,), "kernels": (_kernels,), "copies+kernels": (_copies, _kernels)}


def step_time(opt: torch.optim.Optimizer, beside, steps: int = 5) -> float:
    stop = threading.Event()
    threads = [threading.Thread(target=f, args=(stop,)) for f in beside]
    for t in threads:
        t.start()
    time.sleep(0.3)
    try:
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    finally:
        stop.set()
        for t in threads:
            t.join()
    return sorted(times)[len(times) // 2]


BLOCKS, PER_PACK = 48, 4              # GPT-2 XL's blocks; blocks per pack (optimizer)


def whole_model_once(layout: str, steps: int = 5) -> dict:
    """One process: every block's Adam step, pack by pack, on a worker thread (as runtime.executor)."""
    from concurrent.futures import ThreadPoolExecutor
    from harmony_opt.runtime.optim import host_threads, intra_op_threads

    t0 = time.perf_counter()
    pin = layout == "pinned"
    opts = []
    for _ in range(BLOCKS // PER_PACK):
        params = [torch.nn.Parameter(torch.empty(BLOCK // 12, pin_memory=pin).normal_())
                  for _ in range(12 * PER_PACK)]
        for p in params:
            p.grad = torch.empty(p.shape, pin_memory=pin).normal_()
        opts.append(torch.optim.Adam(params, lr=1e-4, fused=True))
    alloc_s = time.perf_counter() - t0
    threads = host_threads(1, "cuda")

    def iteration() -> float:
        with intra_op_threads(threads):
            t = time.perf_counter()
            for o in opts:
                o.step()
            return time.perf_counter() - t

    row = {"layout": layout, "threads": threads, "alloc_s": alloc_s}
    with ThreadPoolExecutor(max_workers=1) as pool:
        row["first_s"] = pool.submit(iteration).result()       # allocates the optimizer state
        for name, beside in (("alone", ()), ("copies+kernels", (_copies, _kernels))):
            stop = threading.Event()
            helpers = [threading.Thread(target=f, args=(stop,)) for f in beside]
            for h in helpers:
                h.start()
            time.sleep(0.3)
            times = [pool.submit(iteration).result() for _ in range(steps)]
            stop.set()
            for h in helpers:
                h.join()
            row[name] = sorted(times)[len(times) // 2]
            row[name + "_max"] = max(times)
    return row


def whole_model(processes: int, out: Path) -> int:
    import json
    import subprocess

    rows = []
    for trial in range(processes):
        for layout in ("pinned", "pageable"):
            res = subprocess.run([sys.executable, __file__, "--_one", layout], capture_output=True, text=True,
                                 check=False)
            if res.returncode:
                print(res.stderr[-2000:], file=sys.stderr)
                return 1
            row = {"process": trial + 1, **json.loads(res.stdout.strip().splitlines()[-1])}
            rows.append(row)
            print(row, flush=True)
    device = torch.cuda.get_device_name()
    cols = ("alloc_s", "first_s", "alone", "alone_max", "copies+kernels", "copies+kernels_max")
    atomic_write_json(out.with_suffix(".json"), {"device": device, "cores": len(os.sched_getaffinity(0)),
                                                 "torch": torch.__version__, "parameters": BLOCK * BLOCKS,
                                                 "rows": rows})
    lines = [f"# CPU Adam step over GPT-2 XL's {BLOCKS} blocks ({BLOCK * BLOCKS / 1e9:.2f} G parameters), "
             f"{BLOCKS // PER_PACK} fused optimizers, seconds", "",
             f"{device}, {len(os.sched_getaffinity(0))} cores, torch {torch.__version__}; "
             f"`python benchmarks/bench_cpu_step.py --whole {processes}`; each row a fresh process; "
             f"median (and max) of 5 iterations after a first that allocates the state.", "",
             "| process | layout | threads | " + " | ".join(cols) + " |", "|---|---|---|" + "---|" * len(cols)]
    lines += [f"| {r['process']} | {r['layout']} | {r['threads']} | " + " | ".join(f"{r[k]:.3f}" for k in cols)
              + " |" for r in rows]
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_step"))
    ap.add_argument("--whole", type=int, metavar="N", help="the whole-model step in N fresh processes per layout")
    ap.add_argument("--_one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cpu_step: needs CUDA (it times the step beside host<->GPU copies)", file=sys.stderr)
        return 2
    if args._one:
        import json
        print(json.dumps(whole_model_once(args._one)))
        return 0
    if args.whole:
        return whole_model(args.whole, Path(args.out + "_whole"))
    cores = len(os.sched_getaffinity(0))
    rows = []
    for threads in dict.fromkeys((cores, max(1, cores - 2), max(1, cores // 2))):
        torch.set_num_threads(threads)
        for impl, kw in IMPLS.items():
            params = [torch.nn.Parameter(torch.randn(BLOCK // 12)) for _ in range(12)]
            for p in params:
                p.grad = torch.randn_like(p)
            opt = torch.optim.Adam(params, lr=1e-4, **kw)
            opt.step()                  # allocates the state
            row = {"threads": threads, "implementation": impl}
            for name, beside in BESIDE.items():
                row[name] = step_time(opt, beside)
            rows.append(row)
            print(row, flush=True)
    device = torch.cuda.get_device_name()
    out = Path(args.out)
    atomic_write_json(out.with_suffix(".json"), {"device": device, "cores": cores, "torch": torch.__version__,
                                                 "parameters": BLOCK, "rows": rows})
    lines = [f"# CPU Adam step over one GPT-2 XL block ({BLOCK / 1e6:.1f} M parameters), seconds", "",
             f"{device}, {cores} cores, torch {torch.__version__}; `python benchmarks/bench_cpu_step.py`; "
             f"median of 5 steps.", "",
             "| threads | implementation | " + " | ".join(BESIDE) + " |", "|---|---|" + "---|" * len(BESIDE)]
    lines += [f"| {r['threads']} | {r['implementation']} | " + " | ".join(f"{r[k]:.4f}" for k in BESIDE) + " |"
              for r in rows]
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
