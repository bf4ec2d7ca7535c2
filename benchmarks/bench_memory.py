"""Benchmark: does every plan that fits on paper fit at run time?

For each built-in tiny model, profiled here on the CPU (as ``harmony-opt profile`` does), each
cap from the least feasible one (the largest single layer's backward at microbatch 1) upward,
and each planner (our CP-SAT planner, Harmony's search judged by our simulator and by Harmony's
own, naive swapping, L2L, ZeRO-Offload), it plans, compiles against the model's real tensor
sizes, validates the program under the cap and trains ``--steps`` steps under the cap. Columns:

* ``result``: ``ok`` (trained), ``infeasible`` (the planner refused the request with the figures)
  or ``refused`` (a returned plan the compiler or the executor refused: the failure this guards);
* ``predicted_peak``: the simulator's peak of live device bytes (``simulate(...).peak_memory()``: the
  compiled program's, from the profile's sizes), ``measured_peak``: the executor's memory guard's peak
  of live device bytes over the run, both on the busiest GPU; ``ratio``: predicted / measured on the
  GPU where they differ most;
* ``task_peak``: the most the simulator reserves for its tasks (the planners' pack memory, workspace
  included), which decides when it lets a prefetch start.

    python benchmarks/bench_memory.py [--models gpt2-tiny,bert-tiny] [--steps 2] [--precision bf16]
                                      [--out benchmarks/results]   # memory.{csv,md} (memory_bf16.* in bf16)
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from pathlib import Path

import pandas as pd
import torch

from harmony_opt.planners.registry import get_planner
from harmony_opt.core.errors import HarmonyOptError, InfeasibleError
from harmony_opt.core.hardware import Hardware
from harmony_opt.core.io import atomic_write_text
from harmony_opt.measure.models import build_model
from harmony_opt.measure.profiler import profile_model
from harmony_opt.sim.simulator import simulate
from harmony_opt.training import train

MODELS = ("gpt2-tiny", "bert-tiny", "vgg-tiny", "resnet-tiny")
FACTORS = (1.0, 1.25, 1.5, 2.0, 3.0, 5.0)
PLANNERS = ("cp-sat", "harmony", "harmony/harmony-cost", "naive-swap", "l2l", "zero-offload")
BATCH = 8
HARDWARE = Hardware(name="cpu-bench", gpus=1, gpu_memory_bytes=2**30, host_memory_bytes=8 * 2**30,
                    pinned_memory_bytes=4 * 2**30, h2d_bandwidth=6e9, d2h_bandwidth=6e9, shared_host_link=True,
                    link_bandwidth=6e9, p2p_bandwidth=0.0, host_copy_bandwidth=6e9, cpu_optimizer_scale=1.0,
                    gpu_optimizer_bandwidth=1e10)


def make_plan(planner: str, prof, cap: int, time_limit: float):
    """``planner`` from the registry; "harmony/harmony-cost" is Harmony's search under its own cost model."""
    name, _, variant = planner.partition("/")
    kw = {"time_limit": time_limit, "processes": 1} if name == "cp-sat" else {}
    if variant == "harmony-cost":
        kw.update(mode="vPP", cost_model="harmony")
    return get_planner(name)(prof, HARDWARE, BATCH, cap, **kw)


def run(models, steps: int, time_limit: float, precision: str = "fp32") -> pd.DataFrame:
    rows = []
    for name in models:
        torch.manual_seed(0)
        prof = profile_model(build_model(name), [1, 2, 4, 8], "cpu", progress=False, precision=precision)
        least = int(max(prof.costs("BWD", 1).pack_memory(l, l) for l in range(prof.num_layers)))
        for f in FACTORS:
            cap = int(least * f)
            for planner in PLANNERS:
                row = {"model": name, "cap": cap, "cap_factor": f, "planner": planner}
                try:
                    with contextlib.redirect_stdout(io.StringIO()):
                        p = make_plan(planner, prof, cap, time_limit)
                except InfeasibleError as e:
                    rows.append({**row, "result": "infeasible", "note": str(e).split(";")[0][:120]})
                    continue
                tl = simulate(p.replace(cost_model="default"), prof, HARDWARE)
                row["task_peak"] = max(tl.meta["reserved_memory"].values())
                predicted = tl.peak_memory()
                row["predicted_peak"] = max(predicted.values())
                try:
                    res = train(build_model(name), p, steps=steps, progress=False, memory_cap=cap)
                except HarmonyOptError as e:
                    rows.append({**row, "result": "refused", "note": str(e).splitlines()[0][:160]})
                    print(rows[-1], flush=True)
                    continue
                row["measured_peak"] = max(res.peak_device_bytes)
                row["ratio"] = max((predicted[r] / m for r, m in enumerate(res.peak_device_bytes)),
                                   key=lambda x: abs(x - 1))
                rows.append({**row, "result": "ok"})
        print(f"{name}: {sum(r['model'] == name for r in rows)} cases", flush=True)
    return pd.DataFrame(rows)


def report(df: pd.DataFrame, command: str, seconds: float, precision: str = "fp32") -> str:
    ok = df[df.result == "ok"]
    counts = df.groupby(["planner", "result"]).size().unstack(fill_value=0)
    lines = [
        "# Plans that fit on paper, at run time", "",
        f"`{command}` ({seconds:.0f} s, this project's 2-core CPU machine; the device is the CPU; "
        f"{precision}).", "",
        f"**{(df.result == 'refused').sum()} of {len(df)} plans refused at run time**; "
        f"{len(ok)} trained, {(df.result == 'infeasible').sum()} requests refused by the planner with the figures.", "",
        f"Predicted (the simulator's, from the profile's sizes) over measured (the executor's guard) peak of "
        f"live device bytes, per GPU: min {ok.ratio.min():.3f}, median {ok.ratio.median():.3f}, max {ok.ratio.max():.3f}; "
        f"within 5 %: {(abs(ok.ratio - 1) <= 0.05).sum()} of {len(ok)}; never below 1 (the guard never stops a "
        f"validated plan): {(ok.ratio >= 1).all()}.", "",
        "```", counts.to_string(), "```", "",
        "Per model, predicted / measured peak:", "",
        "```", ok.groupby("model").ratio.agg(["min", "median", "max"]).round(3).to_string(), "```", "",
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--time-limit", type=float, default=2.0, help="work seconds per CP-SAT plan")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="profile and train in this precision (bf16: autocast, fp32 master weights)")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    t0 = time.perf_counter()
    df = run(models, args.steps, args.time_limit, args.precision)
    out = Path(args.out)
    stem = "memory" if args.precision == "fp32" else f"memory_{args.precision}"
    atomic_write_text(out / f"{stem}.csv", df.to_csv(index=False))
    command = " ".join(["python benchmarks/bench_memory.py", *(sys.argv[1:] if argv is None else argv)])
    atomic_write_text(out / f"{stem}.md", report(df, command, time.perf_counter() - t0, args.precision))
    print((out / f"{stem}.md").read_text())


if __name__ == "__main__":
    main()
