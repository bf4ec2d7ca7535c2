"""Benchmark: the planner on small CPU-measured models, with and without solving vPP shape by shape.

A user who profiles a small model on a CPU gets profiles unlike the bundled ones: a dozen layers,
tiny blocks beside a large embedding and head. There the pipeline's packs are few and coarse, and
which GPU runs which layers is what sets the time; the local search, whose every move deals the
later packs to other GPUs, stops far from the model's optimum. Step 3's ``exact_shapes``
(solver_models/steps/improve.py) solves such configurations shape by shape (vpp_exact.py). This
plans each case twice under the same work budget, judged by the same simulator:

* ``default``: ``plan()`` as the CLI runs it;
* ``without``: ``PlannerOptions(shapes=False)``, the planner without ``exact_shapes`` (CP-SAT's
  position model and the local search on every vPP configuration, as before it existed).

Models, each profiled here first (``harmony-opt profile ... --device cpu --threads 1 -u 1,2,4,8``):
the Llama of ``benchmarks/models/llama-tiny`` (12 layers), ``gpt2-tiny`` and ``bert-tiny`` with 8
blocks (11 and 11 layers), ``resnet-tiny`` (11) and ``vgg-tiny`` (10). Each is planned for the
Harmony authors' server (``1080ti-x4``, minibatch 16) with vPP on 4 GPUs and with the mode free, at two
caps: 0.3 and 0.6 of the model's whole backward working set at microbatch 1 (at least its largest
layer). Columns: simulated iteration times and their ratio (below 1: the shapes made the plan
faster), the gap `plan` reports for its chosen configuration and over every configuration searched,
and the search's wall seconds.

    OMP_NUM_THREADS=1 python benchmarks/bench_small_models.py [--time-limit 10] [--processes 2] [--keep DIR]

``--keep DIR`` saves each profile to DIR/NAME; ``--profiles DIR`` plans those instead of profiling
again (CPU profiles differ from run to run: that replays one).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd

from harmony_opt.core.bundled import load_profile
from harmony_opt.core.hardware import get_hardware
from harmony_opt.core.io import write_results
from harmony_opt.measure.models import resolve_model
from harmony_opt.measure.profiler import profile_model
from harmony_opt.report import machine_description, markdown_table
from harmony_opt.solver_models.planner import PlannerOptions, plan

ROOT = Path(__file__).resolve().parent.parent
MODELS = (("llama-tiny", str(ROOT / "benchmarks" / "models" / "llama-tiny"), {}),
          ("gpt2-tiny x8", "gpt2-tiny", {"n_layer": 8}),
          ("bert-tiny x8", "bert-tiny", {"num_layers": 8}),
          ("resnet-tiny", "resnet-tiny", {}),
          ("vgg-tiny", "vgg-tiny", {}))
CAPS = (0.3, 0.6)
BATCH = 16


def cap_of(profile, share: float) -> int:
    """``share`` of the whole backward working set at microbatch 1, at least 1.2 times the largest
    layer's need at microbatch 1."""
    full = int(profile.costs("BWD", 1).pack_memory(0, profile.num_layers - 1))
    single = max(int(profile.costs(ph, 1).memory.max()) for ph in ("FWD", "BWD"))
    return max(int(1.2 * single), int(full * share))


def run(profile, hw, cap, mode, time_limit, processes, shapes: bool) -> dict:
    opts = PlannerOptions(mode=mode, gpus=4 if mode == "vPP" else None, time_limit=time_limit, processes=processes,
                          shapes=shapes)
    p = plan(profile, hw, BATCH, opts, memory_cap=cap)
    s = p.solver
    conf = s.get("configuration") or {}
    return {"s": p.simulated_iteration_time_s, "config": f"{p.mode} x{p.gpus} u={p.microbatch_fwd}/{p.microbatch_bwd}",
            "config_gap": conf.get("gap"), "space_gap": s.get("gap"), "search_s": p.search_time_s}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "small_models"))
    ap.add_argument("--keep", help="save each profile to KEEP/NAME")
    ap.add_argument("--profiles", help="plan the profiles saved by --keep in this folder instead of profiling")
    ap.add_argument("--only", help="the models whose name starts with this")
    a = ap.parse_args(argv)
    hw = get_hardware("1080ti-x4")
    t0 = time.perf_counter()
    rows = []
    for label, name, overrides in MODELS:
        if a.only and not label.startswith(a.only):
            continue
        folder = label.replace(" ", "_")
        if a.profiles:
            profile = load_profile(str(Path(a.profiles) / folder))
        else:
            print(f"profiling {label} ...", flush=True)
            profile = profile_model(resolve_model(name, **overrides), [1, 2, 4, 8], "cpu", threads=1, progress=False)
            if a.keep:
                profile.save(Path(a.keep) / folder)
        for share in CAPS:
            cap = cap_of(profile, share)
            for mode in ("vPP", "auto"):
                row = {"model": label, "layers": profile.num_layers, "cap_MB": round(cap / 1e6, 1), "mode": mode}
                for name_, shapes in (("default", True), ("without", False)):
                    for k, v in run(profile, hw, cap, mode, a.time_limit, a.processes, shapes).items():
                        row[f"{name_}_{k}"] = v
                row["default_over_without"] = row["default_s"] / row["without_s"]
                print(row, flush=True)
                rows.append(row)
    df = pd.DataFrame(rows)
    n = len(df)
    faster = int((df.default_over_without < 1 - 1e-9).sum())
    slower = int((df.default_over_without > 1 + 1e-9).sum())
    page = (f"# Small CPU-measured models, with and without solving vPP shape by shape\n\n"
            f"Command: `OMP_NUM_THREADS=1 python benchmarks/bench_small_models.py --time-limit {a.time_limit:g} "
            f"--processes {a.processes}` ({time.perf_counter() - t0:.0f} s). Machine: {machine_description()}. "
            f"Profiles measured on this machine's CPU (1 thread, microbatch 1, 2, 4, 8), planned for 1080ti-x4 at "
            f"minibatch {BATCH}; `default`: `plan()`; `without`: `PlannerOptions(shapes=False)`; both "
            f"judged by the default simulator under the same work budget. Ratios below 1: the shapes found a "
            f"faster plan. Gaps: what `plan` reports for its chosen configuration and over every configuration "
            f"searched.\n\n{markdown_table(df)}\n## Summary\n\n"
            f"- The default faster in {faster}/{n} cases, slower in {slower}/{n}; the median ratio "
            f"{df.default_over_without.median():.4f}, the least {df.default_over_without.min():.4f}.\n"
            f"- Chosen configuration's gap, median: {df.default_config_gap.median():.2%} with the shapes, "
            f"{df.without_config_gap.median():.2%} without; at most {df.default_config_gap.max():.2%} and "
            f"{df.without_config_gap.max():.2%}.\n"
            f"- Gap over every configuration searched, median: {df.default_space_gap.median():.2%} with, "
            f"{df.without_space_gap.median():.2%} without.\n"
            f"- Search wall seconds, median: {df.default_search_s.median():.2f} with, "
            f"{df.without_search_s.median():.2f} without.\n")
    write_results(a.out, df, page)
    print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
