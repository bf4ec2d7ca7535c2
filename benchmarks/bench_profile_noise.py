"""Benchmark: how far apart identical layers are measured, profiler against profiler.

Profiles ``gpt2-tiny --set n_layer=6`` (six identical transformer blocks, layers 1-6) on the CPU
several times with each variant and reports the spread between the blocks: max / min of their
forward (and backward) time at each microbatch size, the worst size shown. A trustworthy profiler
gives the same block the same time, so the spread is near 1. Variants run interleaved (variant A
run 1, variant B run 1, ..., then run 2), so that a change in the machine's load hits all alike.

    python benchmarks/bench_profile_noise.py --runs 2 --baseline-tree /tmp/old   # writes results/profile_noise.*

``--baseline-tree DIR``: a directory holding an older ``harmony_opt`` package (runtime and
solver_models inside it, as installed) to run as the "before" variant; without it, only this
tree's variants run (defaults, and one intra-op thread); ``--after-tree DIR`` runs those from
such a copy too.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

from harmony_opt.core.io import atomic_write_json, atomic_write_text

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = range(1, 7)
SIZES = "1,2,4"


def _profile(out: Path, extra: list[str], pythonpath: str | None) -> float:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [sys.executable, "-m", "harmony_opt.cli", "profile", "gpt2-tiny", "--device", "cpu", "--set", "n_layer=6",
           "-u", SIZES, "-o", str(out), "--no-progress", *extra]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=tempfile.gettempdir(), stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def _spread(folder: Path) -> dict:
    mb = pd.read_csv(folder / "microbatch.csv")
    meta = json.loads((folder / "meta.json").read_text())
    out = {"threads": meta.get("threads", "unset"), "warnings": len(meta.get("warnings", []))}
    for ph in ("FWD", "BWD"):
        per = {}
        for u, g in mb[(mb.phase == ph) & mb.layer.isin(BLOCKS)].groupby("microbatch"):
            per[int(u)] = float(g.gpu_time_s.max() / g.gpu_time_s.min())
        out[f"{ph.lower()}_spread"] = max(per.values())
        out[f"{ph.lower()}_spread_by_size"] = per
        blocks = mb[(mb.phase == ph) & mb.layer.isin(BLOCKS) & (mb.microbatch == 1)].gpu_time_s
        out[f"{ph.lower()}_u1_ms"] = [round(float(t) * 1e3, 2) for t in blocks]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--baseline-tree", default=None)
    ap.add_argument("--after-tree", default=None, help="run the 'after' variants from this copy (default: installed)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "profile_noise"))
    args = ap.parse_args()
    variants = ([("before (mean of 3, threads as set)", [], args.baseline_tree)] if args.baseline_tree else []) + [
        ("after (defaults: median, executor's threads)", [], args.after_tree),
        ("after, --threads 1", ["--threads", "1"], args.after_tree)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for i, (name, extra, path) in enumerate(variants):
                folder = Path(tmp) / f"v{i}r{run}"
                load = os.getloadavg()[0]
                wall = _profile(folder, extra, path)
                rows.append({"variant": name, "run": run + 1, "load_1min": round(load, 1), "wall_s": round(wall, 1),
                             **_spread(folder)})
                print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    atomic_write_json(out.with_suffix(".json"), rows)
    lines = ["# Spread between identical blocks in a CPU profile", "",
             "`python benchmarks/bench_profile_noise.py " + " ".join(sys.argv[1:]) + "`: gpt2-tiny --set n_layer=6, "
             f"microbatch {SIZES}, on {os.cpu_count()} cores; spread = max / min of the six identical blocks' time "
             "at one size (worst size shown); load_1min = the load average as the run began.", "",
             "| variant | run | threads | load_1min | FWD spread | BWD spread | FWD ms at u=1 (blocks 1-6) | "
             "warnings | wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['run']} | {r['threads']} | {r['load_1min']} | {r['fwd_spread']:.1f}x | "
                     f"{r['bwd_spread']:.1f}x | {', '.join(map(str, r['fwd_u1_ms']))} | {r['warnings']} | "
                     f"{r['wall_s']} |")
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
