"""Benchmark: is the planner's default its best? The default against each flag that changes the search.

`harmony-opt plan` without flags should find at least what any flag finds within the same budget.
For the six Table 1 cases
(D = 64, 4 GPUs, cap 9e9 bytes for bert_96 and gpt2_xl, 10 GiB otherwise), with the mode free
and with vPP fixed, each run plans under the same work budget:

* ``default``: no flag (any microbatch size, those dividing the minibatch first; per-pack options,
  gradients kept on the GPU where a chain allows it, Harmony's plan as warm start);
* ``even``: ``--even``, only microbatch sizes that divide the minibatch;
* ``no_handoff``: ``--no-gpu-handoff``;
* ``no_hint``: ``--no-hint``.

Columns: each run's simulated iteration time (default simulator), the ratio flag / default
(below 1: the flag found a faster plan than the default), and the default's gap to its
configuration's bound.

    python benchmarks/bench_defaults.py [--time-limit 10] [--processes 2] [--only vgg416]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd

from harmony_opt.core.bundled import load_profile
from harmony_opt.core.hardware import get_hardware
from harmony_opt.core.io import write_results
from harmony_opt.report import machine_description, markdown_table
from harmony_opt.solver_models.planner import PlannerOptions, plan

GiB = 2**30
MODELS = ("bert_large", "bert_96", "gpt2_medium", "gpt2_xl", "vgg416", "resnet1026")
FLAGS = {"default": {}, "even": {"uneven": False}, "no_handoff": {"gpu_handoff": False}, "no_hint": {"hint": False}}


def run_case(model: str, mode: str, time_limit: float, processes: int) -> dict:
    profile, hw = load_profile(model), get_hardware("1080ti-x4")
    cap = int(9e9 if model in ("bert_96", "gpt2_xl") else 10 * GiB)
    row = {"model": model, "batch": 64, "mode": mode, "gpus": 4}
    for name, kw in FLAGS.items():
        opts = PlannerOptions(mode=mode, gpus=4 if mode == "vPP" else None, time_limit=time_limit,
                              processes=processes, **kw)
        p = plan(profile, hw, 64, opts, memory_cap=cap)
        row[f"{name}_s"] = p.simulated_iteration_time_s
        if name == "default":
            row["default_config"] = f"{p.mode} x{p.gpus} u={p.microbatch_fwd}/{p.microbatch_bwd}"
            row["default_config_gap"] = (p.solver.get("configuration") or {}).get("gap")
        else:
            row[f"{name}_over_default"] = p.simulated_iteration_time_s / row["default_s"]
    return row


def report(df: pd.DataFrame, a) -> str:
    n = len(df)
    ratios = [c for c in df.columns if c.endswith("_over_default")]
    lost = {c: int((df[c] < 1 - 1e-9).sum()) for c in ratios}
    worst = {c: df[c].min() for c in ratios}
    lines = "".join(f"- `{c.removesuffix('_over_default')}` faster than the default in {lost[c]}/{n} cases "
                    f"(least ratio flag / default {worst[c]:.4f}).\n" for c in ratios)
    return (f"# The default against the planner's flags\n\n"
            f"Command: `python benchmarks/bench_defaults.py --time-limit {a.time_limit:g} --processes {a.processes}`. "
            f"Machine: {machine_description()}. The six Table 1 cases (D = 64, 4 GPUs), mode free (`auto`, 1 to 4 "
            f"GPUs) and vPP fixed on 4 GPUs; every run under the same work budget, judged by the default "
            f"simulator. A ratio below 1: the flag found a faster plan than the default.\n\n"
            f"{markdown_table(df)}\n## Summary\n\n{lines}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit", type=float, default=10.0)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--only", help="run one model only")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "defaults"))
    a = ap.parse_args(argv)
    rows = []
    for model in MODELS:
        if a.only and model != a.only:
            continue
        for mode in ("auto", "vPP"):
            row = run_case(model, mode, a.time_limit, a.processes)
            rows.append(row)
            print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
    df = pd.DataFrame(rows)
    page = report(df, a)
    if not a.only:          # one model's rows are printed, not saved
        write_results(a.out, df, page)
    print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
