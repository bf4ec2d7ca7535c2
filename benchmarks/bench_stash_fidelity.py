"""Benchmark: how well the planner's model times plans with stashed packs, per mode.

Why it exists: in vPP the planner offers a layer's stash variant only where the shared host link
moves its saved activations out and back faster than the layer is recomputed
(tasks.stashable_layers). This measures the model against the default simulator on plans with
stashed packs, offered or not, to show what that rule rests on.

Plans: for the four stash-eligible shipped profiles (at most MAX_LAYERS_WITH_STASH layers)
at the benchmark's settings (D = 64 on 4 GPUs, D = 32 on 2 GPUs, caps as in
bench_planner.py), the three configurations of each mode with the lowest cheap bound; for
each, a plan without stash (local search in vPP, the DP in vDP), then that plan with the
stash variant on every backward pack, on those in the first third of the layers, on the rest,
on two seeded random 40 % subsets and on the packs whose layers all have it offered (where memory allows), every layer's stash variant built.
Columns: the model's time, the simulated time, error = (model - simulated) / simulated, and
``offered``: whether the planner offers every stashed layer's variant.

    python benchmarks/bench_stash_fidelity.py

writes ``benchmarks/results/stash_fidelity.md`` and ``stash_fidelity.csv``.
"""
from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent

from harmony_opt.core.bundled import load_profile
from harmony_opt.core.errors import PlanError
from harmony_opt.core.hardware import get_hardware
from harmony_opt.core.io import atomic_write_text
from harmony_opt.core.plan import PackOptions, Plan, data_shares, split_microbatches
from harmony_opt.report import machine_description, markdown_table
from harmony_opt.sim.simulator import simulate
from harmony_opt.solver_models import dp, search
from harmony_opt.solver_models.bounds import config_bound
from harmony_opt.solver_models.options import PlannerOptions, configurations
from harmony_opt.solver_models.tasks import B, build_tasks, candidate_cuts, stashable_layers
from harmony_opt.solver_models.timing import evaluate, packs_of

GiB = 2**30
CASES = [(m, 64, 4, int(9e9 if m in ("bert_96", "gpt2_xl") else 10 * GiB)) for m in
         ("bert_large", "bert_96", "gpt2_medium", "gpt2_xl")] + \
        [(m, 32, 2, 10 * GiB) for m in ("bert_large", "bert_96", "gpt2_medium", "gpt2_xl")]
VARIANTS = ("all", "first third", "the rest", "random", "random", "offered")


def base_plan(profile, hw, batch, cfg, cap):
    """(stash-variant tasks, a good sequence without stash) of ``cfg``, or None."""
    plain = build_tasks(profile, hw, batch, cfg, cap, stash=False, cuts=candidate_cuts(profile, cfg.u_bwd))
    if cfg.ranks == 1:
        r = dp.solve_chain(plain)
        seq = None if r is None else r[1]
    else:
        starts, _ = search.starts(plain, profile, None)
        seq = search.improve(plain, starts[0][1], 1500, seed=0)[1] if starts else None
    if seq is None:
        return None
    tasks = build_tasks(profile, hw, batch, cfg, cap, stash=True, cuts=plain.cuts,
                        stash_layers=np.ones(profile.num_layers, bool))
    idx = tasks.table.index()
    return tasks, [idx[plain.table.key(k)] for k in seq]


def with_stash(tasks, seq, variant, rng, ok):
    t, idx, third = tasks.table, tasks.table.index(), tasks.num_layers // 3
    out = list(seq)
    for i, k in enumerate(seq):
        if t.kind[k] != B:
            continue
        pick = {"all": True, "first third": t.start[k] < third, "the rest": t.start[k] >= third,
                "offered": ok[t.start[k]: t.end[k] + 1].all()}.get(variant, None)
        if pick is None:
            pick = rng.random() < 0.4
        key = (*t.key(k)[:3], False, t.key(k)[4])
        if pick and key in idx:
            out[i] = idx[key]
    return out


def main() -> int:
    rng, rows = random.Random(0), []
    for model, batch, gpus, cap in CASES:
        profile, hw = load_profile(model), get_hardware("1080ti-x4").with_gpus(gpus)
        for mode in ("vPP", "vDP"):
            cfgs = [c for c in configurations(profile, hw, batch, PlannerOptions(mode=mode, gpus=gpus, uneven=True))]
            every = np.ones(profile.num_layers, bool)
            cfgs.sort(key=lambda c: (config_bound(profile, hw, batch, c, cap, True, stash_layers=every), str(c)))
            for cfg in cfgs[:3]:
                share = batch if cfg.mode == "vPP" else max(data_shares(batch, cfg.gpus))
                base = base_plan(profile, hw, batch, cfg, cap)
                if base is None:
                    continue
                tasks, seq = base
                ok = stashable_layers(profile, hw, cfg, split_microbatches(share, cfg.u_fwd),
                                      split_microbatches(share, cfg.u_bwd))
                for variant in VARIANTS:
                    if variant == "offered" and ok.all():
                        continue            # a chain: every layer's variant is offered, as in "all"
                    s2 = with_stash(tasks, seq, variant, rng, ok)
                    value = evaluate(tasks, s2)
                    f, b, o = packs_of(tasks, s2)
                    stashed = sum(1 for r, _ in o if not r)
                    if not stashed or not np.isfinite(value):
                        continue
                    p = Plan("bench", cfg.mode, cfg.gpus, batch, cfg.u_fwd, cfg.u_bwd, f, b, tasks.num_layers,
                             options=tuple(PackOptions(r, "gpu" if g else "cpu") for r, g in o), allow_uneven=True,
                             memory_cap=cap)
                    try:
                        sim = simulate(p, profile, hw, with_timeline=False).iteration_time
                    except PlanError:
                        continue
                    offered = all(ok[a: e + 1].all() for (a, e), (r, _) in zip(b, o) if not r)
                    rows.append({"model": model, "batch": batch, "gpus": gpus, "mode": mode, "config": str(cfg),
                                 "stashed": variant, "stashed_packs": stashed, "backward_packs": len(o),
                                 "offered": offered, "model_s": value, "simulated_s": sim,
                                 "error": (value - sim) / sim})
                    print(f"{model} D={batch} {cfg} stash {variant}: model {value:.3f} s, simulated {sim:.3f} s",
                          flush=True)
    df = pd.DataFrame(rows)
    out = ROOT / "benchmarks" / "results"
    atomic_write_text(out / "stash_fidelity.csv", df.to_csv(index=False, float_format="%.6g"))
    summary = []
    for (mode, offered), g in df.groupby(["mode", "offered"]):
        err = g["error"].to_numpy()
        summary.append({"mode": mode, "offered": offered, "plans": len(g), "median_abs_error": float(np.median(np.abs(err))),
                        "mean_error": float(err.mean()), "model_below_simulator": float((err < 0).mean()),
                        "within_3pct": float((np.abs(err) <= 0.03).mean()),
                        "worst_below": float(err.min()), "worst_above": float(err.max())})
    text = ["# The model on plans with stashed packs", "",
            "Command: `python benchmarks/bench_stash_fidelity.py`; every plan in `stash_fidelity.csv`. "
            f"Machine: {machine_description()}.", "",
            "error = (model - simulated) / simulated. Negative: the model rates the plan faster than it plays.", "",
            markdown_table(pd.DataFrame(summary)), "", "## Every plan", "",
            markdown_table(df.drop(columns=["gpus"]))]
    atomic_write_text(out / "stash_fidelity.md", "\n".join(text) + "\n")
    print(pd.DataFrame(summary).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
