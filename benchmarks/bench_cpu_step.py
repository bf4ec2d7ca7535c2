"""Benchmark: the CPU optimizer step alone and beside the work a training step runs with it.

The executor steps the optimizer of CPU-updated packs on a worker thread while the main
thread issues GPU kernels and the copy streams move weights and gradients over the host
link. This times one Adam step over a GPT-2 XL block's parameters (30.7 M, in 12 tensors)
for three implementations (``torch.optim.Adam`` with the per-parameter loop, foreach, fused)
and three intra-op thread counts (every core, two fewer as ``runtime.optim.host_threads``
leaves on a GPU, half), each alone, beside pinned host<->GPU copies on two streams, beside a
thread issuing small kernels, and beside both. Each figure is the median of 5 steps.

    python benchmarks/bench_cpu_step.py        # needs CUDA; writes benchmarks/results/cpu_step.{md,json}

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
sys.path.insert(0, str(ROOT))

from harmony_opt.io import atomic_write_json, atomic_write_text  # noqa: E402

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_step"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cpu_step: needs CUDA (it times the step beside host<->GPU copies)", file=sys.stderr)
        return 2
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
