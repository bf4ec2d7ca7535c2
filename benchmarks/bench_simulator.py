"""Benchmark and exactness check: the default simulator against earlier revisions of itself.

Cases: Harmony's plan (``baselines.plan_harmony``, default cost model, 1080ti-x4 hardware)
for each of the six shipped profiles at D = 64 vPP on 4 GPUs and D = 32 vDP on 2 GPUs
(cap 9e9 bytes for bert_96 and gpt2_xl as in Harmony's run scripts, 10 GiB otherwise),
plus seeded random plans on the small profiles that exercise what Harmony's plans do not
(1-3 GPUs, prefetch off, uneven microbatches, stash and GPU-optimizer packs, naive
swapping, hardware without a GPU link, with two link slots or one link per GPU, tight
memory caps).

Each revision's ``harmony_opt`` is extracted with ``git archive`` into a temporary folder
and run in a worker process of its own (``--worker``); the workers of all revisions take
turns for ``--rounds`` rounds, so they share the machine's load, and each case's time is
the minimum over rounds and ``--repeat`` calls of ``simulate(..., with_timeline=False)``
(what the planners call). The ratio is the baseline's time over the current tree's.

Every case's full timeline (all events' start and end, bytes, memory curve, iteration
time, and the no-timeline summary) of the current tree is compared with each baseline's
for exact equality; ``--expect-identical REV`` makes the script fail (exit 1) when the
results of REV differ from the current tree's.

    .venv/bin/python benchmarks/bench_simulator.py --baseline 6c18a83 --expect-identical <rev>

writes ``benchmarks/results/simulator.md`` and ``simulator.csv``.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30
HARMONY_CASES = [(name, mode, n, d) for name in ("bert_96", "bert_large", "gpt2_medium", "gpt2_xl", "resnet1026",
                                                 "vgg416")
                 for mode, n, d in (("vPP", 4, 64), ("vDP", 2, 32))]
RANDOM_PROFILES = ("bert_large", "gpt2_medium")


def cap_of(name: str) -> int:
    return int(9e9) if name in ("bert_96", "gpt2_xl") else 10 * GiB


# -- cases (current tree) ------------------------------------------------------------------------
def harmony_cases() -> list[dict]:
    from harmony_opt import get_hardware
    from harmony_opt.planners.baselines import plan_harmony
    from harmony_opt.core.bundled import load_profile
    out = []
    for name, mode, n, d in HARMONY_CASES:
        cap = cap_of(name)
        hw = get_hardware("1080ti-x4", memory_cap=cap).with_gpus(n)
        plan = plan_harmony(load_profile(name), hw, d, cap, mode=mode, gpus=n)
        out.append({"name": f"{name} {mode} x{n} D={d}", "profile": name, "plan": plan.to_dict(),
                    "hardware": hw.to_dict(), "cap": cap})
    return out


def naive_case() -> dict:
    """A large plan of another shape: naive swapping (one layer per pack, every microbatch sweeps the
    model) of vgg416, D = 64, vDP on 4 GPUs, microbatch 16: 25 000 events."""
    from harmony_opt import get_hardware
    from harmony_opt.core.bundled import load_profile
    from harmony_opt.core.plan import Plan
    R = load_profile("vgg416").num_layers
    bwd = [(l, l) for l in range(R)]
    hw = get_hardware("1080ti-x4", memory_cap=10 * GiB)
    plan = Plan("naive-swap", "vDP", 4, 64, 16, 16, bwd[:-1], bwd, R, input_batch_grouping=False)
    return {"name": "naive-swap vgg416 vDP x4 D=64 u=16", "profile": "vgg416", "plan": plan.to_dict(),
            "hardware": hw.to_dict(), "cap": 10 * GiB}


def random_cases(k: int, seed: int) -> list[dict]:
    """Seeded random valid plans (the same list on every run)."""
    import dataclasses

    from harmony_opt import PlanError, get_hardware
    from harmony_opt.core.bundled import load_profile
    from harmony_opt.core.plan import PackOptions, Plan
    import harmony_opt.sim.simulator as simulator
    from harmony_opt.sim.simulator import tasks_of
    # a revision before the expansion was public names it _Expansion
    expansion = getattr(simulator, "Expansion", None) or getattr(simulator, "_Expansion")
    rng = random.Random(seed)
    out = []
    while len(out) < k:
        name = rng.choice(RANDOM_PROFILES)
        prof = load_profile(name)
        R = prof.num_layers
        mode, n = rng.choice(["vPP", "vDP"]), rng.randint(1, 3)
        batch = rng.choice([6, 8, 12, 16])
        share = batch if mode == "vPP" else batch // n
        hi = min(share, prof.size_range("BWD")[1])
        uf, ub = rng.randint(1, hi), rng.randint(1, hi)
        grouping = rng.random() < 0.8
        if not grouping:
            ub = uf
        cuts = sorted(rng.sample(range(1, R), rng.randint(0, min(8, R - 1))))
        bwd = list(zip([0] + cuts, [c - 1 for c in cuts] + [R - 1]))
        fwd_end = bwd[-1][0] - 1
        fcuts = sorted(rng.sample(range(1, fwd_end + 1), rng.randint(0, min(6, fwd_end)))) if fwd_end > 0 else []
        fwd = list(zip([0] + fcuts, [c - 1 for c in fcuts] + [fwd_end])) if fwd_end >= 0 else []
        opts = [PackOptions(recompute=rng.random() < 0.7, optimizer=rng.choice(["cpu", "cpu", "gpu"]))
                for _ in bwd]
        hw = get_hardware("1080ti-x4").with_gpus(n)
        if rng.random() < 0.3:
            hw = dataclasses.replace(hw, p2p_bandwidth=0.0)
        link = rng.random()
        if link < 0.15:         # two transfers per direction at once on the shared link
            hw = dataclasses.replace(hw, link_bandwidth=2 * hw.h2d_bandwidth)
        elif link < 0.3:        # one link per GPU
            hw = dataclasses.replace(hw, shared_host_link=False)
        try:
            plan = Plan("random", mode, n, batch, uf, ub, fwd, bwd, R, options=tuple(opts), allow_uneven=True,
                        prefetch=rng.random() < 0.7, input_batch_grouping=grouping)
            plan.check_against(prof, hw)
            need = max(expansion.task_memory(plan, prof, t) for t in tasks_of(plan) if t.kind != "U")
        except PlanError:
            continue
        cap = int(need * rng.choice([1.0, 1.3, 2.0, 100.0]))
        out.append({"name": f"random {len(out)} ({name})", "profile": name, "plan": plan.to_dict(),
                    "hardware": hw.to_dict(), "cap": cap})
    return out


# -- worker (runs in the tree under test) ----------------------------------------------------------
def worker(cases_path: str, out_path: str, repeat: int) -> None:
    from harmony_opt import Hardware
    from harmony_opt.core.bundled import load_profile
    from harmony_opt.core.io import atomic_write_bytes
    from harmony_opt.core.plan import Plan
    from harmony_opt.sim.simulator import simulate
    cases = json.loads(Path(cases_path).read_text())
    results, times = [], []
    for c in cases:
        prof, plan = load_profile(c["profile"]), Plan.from_dict(c["plan"])
        hw = Hardware.from_dict(c["hardware"])
        tl = simulate(plan, prof, hw, memory_cap=c["cap"])
        quick = simulate(plan, prof, hw, memory_cap=c["cap"], with_timeline=False)
        results.append({
            "iteration_time": tl.iteration_time, "quick_iteration_time": quick.iteration_time,
            "events": list(tl.events.itertuples(index=False, name=None)),
            "memory": list(tl.memory.itertuples(index=False, name=None)),
            "quick_meta": {k: quick.meta[k] for k in ("peak_memory", "bytes", "events")},
        })
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            simulate(plan, prof, hw, memory_cap=c["cap"], with_timeline=False)
            best = min(best, time.perf_counter() - t0)
        times.append(best)
    atomic_write_bytes(out_path, pickle.dumps({"results": results, "times": times}))


# -- driver ---------------------------------------------------------------------------------------
def extract(rev: str, into: Path) -> Path:
    """``harmony_opt`` of git revision ``rev`` (``WORKTREE``: the current files) under ``into``."""
    if rev == "WORKTREE":
        return ROOT
    into.mkdir(parents=True)
    tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "harmony_opt"], check=True,
                         capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar, check=True)
    return into


def run_worker(tree: Path, cases: Path, out: Path, repeat: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), HARMONY_OPT_PROFILES=str(ROOT / "profiles"))
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", str(cases), str(out), str(repeat)],
                   check=True, env=env, cwd=str(tree))
    return pickle.loads(out.read_bytes())


def differences(a: dict, b: dict) -> list[str]:
    """What differs between two workers' results for one case (empty: identical)."""
    out = []
    for k in ("iteration_time", "quick_iteration_time", "quick_meta"):
        if a[k] != b[k]:
            out.append(k)
    if a["events"] != b["events"]:
        out.append(f"events ({len(a['events'])} vs {len(b['events'])})")
    if a["memory"] != b["memory"]:
        out.append("memory curve")
    return out


def markdown(df) -> str:
    cols = list(df.columns)
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    rows += ["| " + " | ".join(str(v) for v in r) + " |" for r in df.itertuples(index=False, name=None)]
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", action="append", default=[], help="git revision to compare with (repeatable)")
    ap.add_argument("--expect-identical", action="append", default=[],
                    help="a baseline whose results must equal the current tree's exactly")
    ap.add_argument("--random", type=int, default=60, help="random plans besides Harmony's (default 60)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("-o", "--output", default=str(ROOT / "benchmarks" / "results" / "simulator"))
    args = ap.parse_args()
    from harmony_opt.core.io import atomic_write_text
    revs = list(dict.fromkeys(args.baseline + args.expect_identical))
    labels = {r: subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", r], check=True,
                                capture_output=True, text=True).stdout.strip() for r in revs}
    cases = harmony_cases() + [naive_case()] + random_cases(args.random, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cases_path = tmp / "cases.json"
        atomic_write_text(cases_path, json.dumps(cases))
        trees = {r: extract(r, tmp / f"rev{i}") for i, r in enumerate(revs)}
        trees["WORKTREE"] = ROOT
        runs: dict[str, list[dict]] = {r: [] for r in trees}
        for rnd in range(args.rounds):
            for r, tree in trees.items():
                runs[r].append(run_worker(tree, cases_path, tmp / f"out_{len(runs[r])}_{labels.get(r, r)}.pkl",
                                          args.repeat))
                print(f"round {rnd + 1}/{args.rounds}: {labels.get(r, 'current tree')} done", flush=True)
    cur = runs["WORKTREE"]
    best = {r: [min(run["times"][i] for run in rs) for i in range(len(cases))] for r, rs in runs.items()}
    failed = False
    rows, notes = [], []
    for r in revs:
        diff = {i: differences(runs[r][0]["results"][i], cur[0]["results"][i]) for i in range(len(cases))}
        diff = {i: d for i, d in diff.items() if d}
        same = not diff
        if r in args.expect_identical and not same:
            failed = True
        notes.append(f"- against {labels[r]}: results identical on {len(cases) - len(diff)} of {len(cases)} cases"
                     + ("" if same else f", DIFFERENT on {len(diff)}: " + "; ".join(
                         f"{cases[i]['name']}: {', '.join(d)} (T {runs[r][0]['results'][i]['iteration_time']:.6f} -> "
                         f"{cur[0]['results'][i]['iteration_time']:.6f} s)" for i, d in list(diff.items())[:12])
                        + (f"; and {len(diff) - 12} more" if len(diff) > 12 else "")))
    for i, c in enumerate(cases):
        ev = cur[0]["results"][i]["quick_meta"]["events"]
        row = {"case": c["name"], "events": ev, "current_ms": round(best["WORKTREE"][i] * 1e3, 3),
               "current_us_per_event": round(best["WORKTREE"][i] / ev * 1e6, 2)}
        for r in revs:
            row[f"{labels[r]}_ms"] = round(best[r][i] * 1e3, 3)
            row[f"speedup_vs_{labels[r]}"] = round(best[r][i] / best["WORKTREE"][i], 2)
        rows.append(row)
    import pandas as pd
    df = pd.DataFrame(rows)
    out = Path(args.output)
    atomic_write_text(out.with_suffix(".csv"), df.to_csv(index=False))
    harm = df.iloc[:len(HARMONY_CASES) + 1]
    lines = ["# Default simulator: speed and exactness against earlier revisions", "",
             f"`{' '.join(['benchmarks/bench_simulator.py'] + sys.argv[1:])}`; "
             f"{args.rounds} rounds x {args.repeat} calls per case, minimum taken; "
             f"`simulate(..., with_timeline=False)`; {len(cases)} cases "
             f"({len(HARMONY_CASES)} Harmony plans, one naive-swap plan, {len(cases) - len(HARMONY_CASES) - 1} "
             f"random plans).", ""]
    h = len(HARMONY_CASES)
    groups = (("Harmony's plans", range(h)), ("naive-swap plan", range(h, h + 1)),
              ("random plans", range(h + 1, len(cases))))

    def events(r, idx):
        return sum(runs[r][0]["results"][i]["quick_meta"]["events"] for i in idx)

    for r in revs:
        parts = []
        for name, idx in groups:
            tb, tc = sum(best[r][i] for i in idx), sum(best["WORKTREE"][i] for i in idx)
            eb, ec = events(r, idx), events("WORKTREE", idx)
            parts.append(f"{name}: {tb * 1e3:.1f} ms / {tc * 1e3:.1f} ms = **{tb / tc:.2f}x**"
                         + ("" if eb == ec else f" ({eb} / {ec} events: {tb / eb * 1e6:.1f} / {tc / ec * 1e6:.1f} "
                                                f"us per event = {tb / eb / (tc / ec):.2f}x)"))
        lines.append(f"- {labels[r]} / current: " + "; ".join(parts))
    lines += notes + ["", markdown(harm), "",
                      f"Random cases: see {out.with_suffix('.csv').name}.", ""]
    atomic_write_text(out.with_suffix(".md"), "\n".join(lines))
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--worker":
        sys.path.insert(0, os.getcwd())
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        sys.exit(main())
