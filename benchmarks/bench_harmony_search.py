"""Benchmark: wall time of the Harmony-compatible search on the paper's Table 1 settings.

Runs ``harmony_search`` with Harmony's published run-script flags (FWD balanced_time + reuse,
BWD balanced_time, Top-1, rank_fit_normally; D = 64, vPP, N = 4; cap 9e9 bytes for bert_96
and gpt2_xl, 10 GiB for vgg416 and resnet1026), and writes
``benchmarks/results/harmony_search.csv`` and ``.md``.

"cold" loads the profile afresh, so per-size interpolation is included; "warm" is the
median of three more runs on the same profile object. Harmony's own scheduler took about
30 s for the vgg416 case (42 configurations); this re-implementation must stay under 3 s.

    python benchmarks/bench_harmony_search.py
"""
from __future__ import annotations

import logging
import statistics
import sys
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parent.parent

from harmony_opt.core.bundled import profiles_dir
from harmony_opt.harmony import harmony_search
from harmony_opt.core.io import atomic_write_text
from harmony_opt.core.profile import Profile

log = logging.getLogger("bench_harmony_search")

GiB = 2**30
#: (model, memory cap in bytes) of run_four_models__tab1.sh
CASES = (("bert_96", 9e9), ("gpt2_xl", 9e9), ("vgg416", 10 * GiB), ("resnet1026", 10 * GiB))
BATCH, GPUS, MODE = 64, 4, "vPP"
WARM_REPEATS = 3
#: Harmony's scheduler on the vgg416 case (reported by the task; not measurable here)
ORIGINAL_VGG416_S = 30.0


def run_case(model: str, cap: float) -> dict:
    profile = Profile.load(profiles_dir() / model)
    t0 = time.perf_counter()
    res = harmony_search(profile, BATCH, GPUS, MODE, cap, packing_fwd="published", packing_bwd="published",
                         topk=1, rank_fit_normally=True)
    cold = time.perf_counter() - t0
    warm = []
    for _ in range(WARM_REPEATS):
        t0 = time.perf_counter()
        harmony_search(profile, BATCH, GPUS, MODE, cap, packing_fwd="published", packing_bwd="published",
                       topk=1, rank_fit_normally=True)
        warm.append(time.perf_counter() - t0)
    b = res.best
    return {
        "model": model, "mode": MODE, "gpus": GPUS, "batch": BATCH, "cap_bytes": int(cap),
        "configs": res.configs_evaluated, "search_space": res.search_space,
        "search_s": round(cold, 3), "search_s_warm_median": round(statistics.median(warm), 3),
        "best_time_s": round(b.time, 6), "u_fwd": b.u_fwd, "packs_fwd": len(b.packs_fwd),
        "u_bwd": b.u_bwd, "packs_bwd": len(b.packs_bwd), "method_fwd": b.method_fwd,
        "method_bwd": b.method_bwd, "memory_mib": round(b.memory / 2**20),
    }


def to_markdown(df: pd.DataFrame) -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in df.itertuples(index=False)]
    vgg = df[df.model == "vgg416"].iloc[0]
    note = (f"\nHarmony-compatible search, Table 1 settings (D = {BATCH}, {MODE}, N = {GPUS}, published packing "
            f"methods, Top-1, rank_fit_normally). search_s: cold (profile loaded afresh); search_s_warm_median: "
            f"median of {WARM_REPEATS} more runs. vgg416: {vgg.search_s} s for {vgg.configs} configurations, "
            f"against about {ORIGINAL_VGG416_S:.0f} s in Harmony's original scheduler "
            f"({ORIGINAL_VGG416_S / vgg.search_s:.0f}x).\n")
    return "\n".join(lines) + "\n" + note


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    for model, cap in CASES:
        row = run_case(model, cap)
        log.info("%s: %d configs in %.3f s (warm %.3f s), best %.6f s", model, row["configs"], row["search_s"],
                 row["search_s_warm_median"], row["best_time_s"])
        rows.append(row)
    df = pd.DataFrame(rows)
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "harmony_search.csv", df.to_csv(index=False))
    atomic_write_text(out / "harmony_search.md", to_markdown(df))
    log.info("wrote %s and %s", out / "harmony_search.csv", out / "harmony_search.md")
    slow = df[df.search_s >= 3.0]
    if len(slow):
        log.error("over the 3 s budget: %s", ", ".join(slow.model))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
