"""Benchmark: the CPU device's step time with freed host memory kept for reuse, against glibc's default.

The executor calls ``runtime.buffers.keep_freed_memory`` (glibc's ``mallopt``), as CUDA's caching
allocator keeps device memory; without it glibc maps every block above an adaptive threshold (at most
32 MB) fresh and unmaps it when freed, so each swap-in of a large tensor on the CPU device pays a page
fault per 4 KiB. The setting is process-wide and cannot be taken back, so each run is a fresh process,
``kept`` or ``default`` (the call made a no-op), and the runs go round the settings and plans.

Model: GPT-2 medium cut to 4 layers (the model of issue #42's measurement; its embedding is 206 MB),
batch 8, sequence 32, a cap twice its largest layer; our plan (``plan``) and Harmony's, made from a
profile and probe of this machine.

    OMP_NUM_THREADS=1 python benchmarks/bench_host_memory.py     # writes benchmarks/results/host_memory.{csv,md}

Run it on a quiet machine: every figure is a wall-clock time.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_fidelity as bf                                          # noqa: E402
from harmony_opt.core.io import write_results                        # noqa: E402
from harmony_opt.measure.models import build_model                   # noqa: E402
from harmony_opt.measure.probe import probe_hardware                 # noqa: E402
from harmony_opt.measure.profiler import profile_model               # noqa: E402
from harmony_opt.report import machine_description, markdown_table   # noqa: E402

MODEL, OVERRIDES = "gpt2-medium", {"n_layer": 4, "sequence_length": 32}
FACTOR, STEPS = 2.0, 5
PLANNERS = ("cp-sat", "harmony")


def _run(setting: str, plan, out) -> None:
    """One fresh process: build the model, train the plan for STEPS steps, report the median untraced step."""
    import harmony_opt.runtime.worker as worker

    if setting == "default":
        worker.keep_freed_memory = lambda: False
    torch.set_num_threads(1)
    out.put(bf.measure(build_model(MODEL, **OVERRIDES), plan, STEPS)[0])


def measure(setting: str, plan) -> float:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_run, args=(setting, plan, out))
    p.start()
    t = out.get()
    p.join()
    return t


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    started = time.perf_counter()
    torch.manual_seed(0)
    profile = profile_model(build_model(MODEL, **OVERRIDES), [8], "cpu", progress=False)
    hw = probe_hardware("cpu", threads=1).with_gpus(1)
    least = max(profile.costs("BWD", 8).pack_memory(i, i) for i in range(profile.num_layers))
    plans = {k: v for k, v in bf.make_plans(profile, hw, int(least * FACTOR)).items() if k in PLANNERS}
    times: dict = {(s, k): [] for s in ("kept", "default") for k in plans}
    for r in range(args.rounds):
        for (setting, name) in times:
            times[setting, name].append(measure(setting, plans[name]))
            print(f"  round {r + 1}: {name:8s} {setting:8s} {times[setting, name][-1] * 1e3:8.1f} ms", flush=True)
    rows = []
    for name in plans:
        kept, default = (statistics.median(times[s, name]) for s in ("kept", "default"))
        rows.append({"plan": name, "kept_ms": kept * 1e3, "default_ms": default * 1e3, "speedup": default / kept,
                     "kept_runs_ms": " ".join(f"{t * 1e3:.0f}" for t in times["kept", name]),
                     "default_runs_ms": " ".join(f"{t * 1e3:.0f}" for t in times["default", name])})
    df = pd.DataFrame(rows)
    head = (f"# CPU device: freed host memory kept against glibc's default\n\n"
            f"`OMP_NUM_THREADS=1 python benchmarks/bench_host_memory.py` ({time.perf_counter() - started:.0f} s); "
            f"{machine_description()}; {MODEL} with {OVERRIDES}, batch {bf.BATCH}, cap {FACTOR}x its largest layer "
            f"at microbatch 8; each figure the median over {args.rounds} fresh processes of the median step between "
            f"the first and the traced last of {STEPS}; runs interleaved across settings and plans.\n\n")
    md = head + markdown_table(df) + "\n"
    print(md)
    write_results(ROOT / "benchmarks" / "results" / "host_memory", df, md)


if __name__ == "__main__":
    main()
