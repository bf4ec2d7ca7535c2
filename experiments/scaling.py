"""Search time and plan quality as GPT-2 grows from 10B to 100B parameters (synthetic profiles).

    python -m experiments scaling [--time-limit S] [--models gpt2_10b,...] [--out DIR]

The server is the paper's with the host memory these models need
(harmony_opt.core.hardware.scaling_hardware).
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd

from harmony_opt.core.errors import HarmonyOptError
from harmony_opt.core.hardware import SCALING_HOST_MEMORY, scaling_hardware
from harmony_opt.core.units import fmt_bytes
from harmony_opt.measure.synthetic import GPT2_SCALING, gpt2_profile
from harmony_opt.planners.baselines import plan_harmony
from harmony_opt.planners.registry import get_planner

from .common import (COLORS, HARDWARE, LABELS, TABLE1_BATCH, TABLE1_GPUS, TABLE1_MODE, Section, num,
                     plan_columns, ratio, save_figure, solver_columns, solver_notes, write_table)

log = logging.getLogger("experiments.scaling")

SCALING_MODELS = ("gpt2_10b", "gpt2_20b", "gpt2_40b", "gpt2_70b", "gpt2_100b")


def scaling_row(name: str, time_limit: float, batch: int = TABLE1_BATCH, gpus: int = TABLE1_GPUS,
                mode: str = TABLE1_MODE, shape=None) -> dict:
    """Search time and plan quality of Harmony's search and ours on one synthetic GPT-2
    (``shape``: a :class:`~harmony_opt.measure.synthetic.GPT2Shape`, default the named one of the series)."""
    shape = shape or GPT2_SCALING[name]
    profile = gpt2_profile(shape, name=name)
    hw = scaling_hardware()
    cap = hw.gpu_memory_bytes
    R = profile.num_layers
    row = {"model": name, "params_B": shape.parameters() / 1e9, "layers": R, "batch": batch, "gpus": gpus,
           "mode": mode, "packings_log10": (R - 1) * math.log10(2)}
    t0 = time.perf_counter()
    try:
        hp = plan_harmony(profile, hw, batch, cap, mode=mode, gpus=gpus)
        row.update(harmony_configs=hp.stats.get("configs_evaluated"), harmony_time_s=hp.simulated_iteration_time_s)
    except HarmonyOptError as e:
        row.update(harmony_configs=0, harmony_time_s=float("nan"), harmony_note=str(e)[:100])
    row["harmony_search_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    op = get_planner("cp-sat")(profile, hw, batch, cap, mode=mode, gpus=gpus, time_limit=time_limit)
    row["ours_search_s"] = time.perf_counter() - t0
    row.update(time_limit_s=time_limit, ours_search_ratio=ratio(row["ours_search_s"], row["harmony_search_s"]),
               **plan_columns(op, "ours_"), ours_time_s=op.simulated_iteration_time_s,
               **solver_columns(op, "ours_"), lower_bound_s=num((op.solver or {}).get("lower_bound_s")))
    row["speedup"] = ratio(row["harmony_time_s"], row["ours_time_s"])
    row["ours_efficiency"] = ratio(row["lower_bound_s"], row["ours_time_s"])
    return row


def scaling(time_limit: float = 35.0, models=SCALING_MODELS) -> pd.DataFrame:
    rows = []
    for name in models:
        row = scaling_row(name, time_limit)
        log.info("scaling %s (%d layers): Harmony %.1f s search, ours %.1f s search; %.2f vs %.2f s/iter",
                 name, row["layers"], row["harmony_search_s"], row["ours_search_s"], row["harmony_time_s"],
                 row["ours_time_s"])
        rows.append(row)
    return pd.DataFrame(rows)


def write_scaling(df: pd.DataFrame, out_dir: Path, time_limit: float) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out_dir = Path(out_dir)
    notes = (f"Synthetic GPT-2 profiles (n_embd 4096, 32 heads, 50 to 500 blocks; harmony_opt.measure.synthetic, "
             f"calibrated on gpt2_xl's measured profile), minibatch {TABLE1_BATCH}, {TABLE1_MODE}, "
             f"{TABLE1_GPUS} GPUs, {HARDWARE} (10 GiB cap) with {fmt_bytes(SCALING_HOST_MEMORY)} of host memory "
             f"(GPT-2 20B to 100B keep 0.3 to 1.6 TiB there: weights, gradients, Adam state, stashed inputs; "
             f"harmony_opt.sim.host_memory). Search times in seconds, measured in one process "
             f"one after the other; our search has a time limit of {time_limit:g} work seconds and includes a "
             f"run of Harmony's search (its incumbent); `ours_search_ratio` = ours_search_s / harmony_search_s. "
             f"`packings_log10`: log10 of the ways to cut the layers into contiguous packs for one phase, "
             f"2^(layers-1): what an enumeration of packings would face; Harmony walks only its few heuristics "
             f"(`harmony_configs` candidates, each costing a simulation). `speedup` = harmony_time_s / "
             f"ours_time_s; `lower_bound_s`: the bound over all plans (harmony_opt.sim.bound), `ours_efficiency` = "
             f"lower_bound_s / ours_time_s. " + solver_notes("ours_"))
    cols = ["model", "params_B", "layers", "packings_log10", "harmony_configs", "harmony_search_s",
            "harmony_time_s", "ours_search_s", "ours_search_ratio", "ours_u_fwd", "ours_u_bwd", "ours_packs_fwd",
            "ours_packs_bwd", "ours_time_s", "speedup", "ours_found_by", "ours_fidelity", "ours_gap",
            "ours_config_status", "ours_config_proof", "ours_config_gap", "ours_timeline_gap", "lower_bound_s",
            "ours_efficiency"]
    paths = write_table(df, out_dir, "scaling", "Planner search time as GPT-2 grows",
                        [Section("", cols, notes)])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 4.8))
    a1.plot(df.layers, df.ours_search_s, "o-", color=COLORS["cp-sat"], label=LABELS["cp-sat"])
    a1.plot(df.layers, df.harmony_search_s, "s-", color=COLORS["harmony"], label=LABELS["harmony"])
    a1.set_yscale("log")
    a1.set_xlabel("layers (GPT-2 10B to 100B parameters)")
    a1.set_ylabel("search time (s, log)")
    a1.set_title("Search time")
    a1.axhline(time_limit, color=COLORS["cp-sat"], ls=":", lw=1, label=f"our time limit ({time_limit:g} work s)")
    top = float(np.nanmax([time_limit, df.ours_search_s.max(), df.harmony_search_s.max()]))
    a1.set_ylim(top=2.5 * top)      # room for the labels above the points and the limit
    a1.grid(alpha=0.3, which="both")
    a1.legend()
    for x, y, p in zip(df.layers, df.ours_search_s, df.params_B):
        a1.annotate(f"{p:.0f}B", (x, y), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=8)
    # iteration time over the lower bound: the two planners differ by a few %, which a plot of
    # seconds (270 to 2650) would hide
    a2.plot(df.layers, df.ours_time_s / df.lower_bound_s, "o-", color=COLORS["cp-sat"], label=LABELS["cp-sat"])
    a2.plot(df.layers, df.harmony_time_s / df.lower_bound_s, "s-", color=COLORS["harmony"], label=LABELS["harmony"])
    a2.axhline(1.0, color="black", ls="--", label=f"{LABELS['lower-bound']} (no plan below 1)")
    for x, y, t in zip(df.layers, df.ours_time_s / df.lower_bound_s, df.ours_time_s):
        a2.annotate(f"{t:.0f} s", (x, y), textcoords="offset points", xytext=(0, -14), ha="center", fontsize=8)
    a2.set_ylim(0.95, 1.05 * float(np.nanmax([(df.harmony_time_s / df.lower_bound_s).max(),
                                                (df.ours_time_s / df.lower_bound_s).max()])))
    a2.set_xlabel("layers (GPT-2 10B to 100B parameters)")
    a2.set_ylabel("simulated iteration time / lower bound (ratio)")
    a2.set_title(f"Plan quality (D={TABLE1_BATCH}, {TABLE1_MODE}, {TABLE1_GPUS} GPUs; labels: ours, s/iteration)")
    a2.grid(alpha=0.3)
    a2.legend()
    fig.suptitle("Scaling: synthetic GPT-2 profiles on 4 x 1080 Ti (10 GiB cap)")
    fig.tight_layout()
    paths.append(save_figure(fig, out_dir / "scaling.png"))
    return paths


if __name__ == "__main__":
    import sys

    from .cli import main
    sys.exit(main(["scaling", *sys.argv[1:]]))
