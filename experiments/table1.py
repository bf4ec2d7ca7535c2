"""Table 1 of the paper: Harmony's schedule search and ours on its four models and settings.

    python -m experiments table1 [--time-limit S] [--models M,...] [--out DIR]

Timings are taken in this process, one search after the other, so ratios between the searches are fair.
"""
from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import pandas as pd

from harmony_opt.core.bundled import load_profile
from harmony_opt.core.errors import UsageError
from harmony_opt.core.hardware import get_hardware
from harmony_opt.harmony import harmony_search
from harmony_opt.planners.baselines import plan_harmony
from harmony_opt.planners.registry import get_planner

from .common import (HARDWARE, TABLE1_BATCH, TABLE1_CASES, TABLE1_GPUS, TABLE1_MODE, Section, num, plan_columns,
                     ratio, solver_columns, solver_notes, write_table)

log = logging.getLogger("experiments.table1")


def table1_row(model: str, cap: int, time_limit: float, batch: int = TABLE1_BATCH, gpus: int = TABLE1_GPUS,
               mode: str = TABLE1_MODE) -> dict:
    """Harmony's search and ours on one Table 1 case, in this process, one after the other.

    Three searches: Harmony's (its published packing methods), ours at Harmony's settings
    (``ours_*``: the same mode and GPUs, so the two searches face the same question) and ours
    with the mode, the GPU count and uneven microbatch splits free (``ours_free_*``). Every plan
    is judged by our simulator, so the speed-ups compare plans under one cost model;
    ``harmony_own_model_s`` is what Harmony's own simulator says of its best candidate, for
    comparison with the paper."""
    profile = load_profile(model)
    hw = get_hardware(HARDWARE, memory_cap=cap)
    t0 = time.perf_counter()
    hp = plan_harmony(profile, hw, batch, cap, mode=mode, gpus=gpus)
    h_search = time.perf_counter() - t0
    h_t = hp.simulated_iteration_time_s
    own = harmony_search(profile, batch, gpus, mode, cap, packing_fwd="published", packing_bwd="published",
                         topk=1, rank_fit_normally=True)
    row = {"model": model, "layers": profile.num_layers, "batch": batch, "gpus": gpus, "mode": mode,
           "cap_bytes": int(cap), "harmony_space": hp.stats.get("search_space"),
           "harmony_configs": hp.stats.get("configs_evaluated"), "harmony_search_s": h_search,
           **plan_columns(hp, "harmony_"),
           "harmony_methods": f"{hp.stats.get('method_fwd') or '-'}/{hp.stats.get('method_bwd')}",
           "harmony_time_s": h_t, "harmony_own_model_s": own.best.time}
    ours = get_planner("cp-sat")
    runs = (("ours_", {"mode": mode, "gpus": gpus, "time_limit": time_limit}),
            ("ours_free_", {"mode": "auto", "gpus": None, "uneven": True, "time_limit": time_limit}))
    for prefix, opts in runs:
        t0 = time.perf_counter()
        op = ours(profile, hw, batch, cap, **opts)
        search = time.perf_counter() - t0
        o_t = op.simulated_iteration_time_s
        row.update({f"{prefix}search_s": search, f"{prefix}search_ratio": ratio(search, h_search),
                    **plan_columns(op, prefix), f"{prefix}time_s": o_t, **solver_columns(op, prefix)})
        solver = op.solver or {}
        if prefix == "ours_":
            row["speedup"] = ratio(h_t, o_t)
            row["lower_bound_s"] = num(solver.get("lower_bound_s"))
            row["ours_efficiency"] = ratio(row["lower_bound_s"], o_t)
            if solver.get("harmony_time_s") is not None and not math.isclose(solver["harmony_time_s"], h_t,
                                                                             rel_tol=1e-9):
                log.warning("table1 %s: the planner's Harmony run gave %.6g s, ours %.6g s", model,
                            solver["harmony_time_s"], h_t)
        else:
            # the free planner's own reference: Harmony's search in both modes on every GPU
            row["harmony_any_mode_time_s"] = num(solver.get("harmony_time_s"))
            row["ours_free_speedup"] = ratio(h_t, o_t)
            row["ours_free_speedup_any_mode"] = ratio(row["harmony_any_mode_time_s"], o_t)
            row["ours_free_efficiency"] = ratio(row["lower_bound_s"], o_t)
    return row


def table1(time_limit: float = 20.0, models: list[str] | None = None) -> pd.DataFrame:
    """Table 1: one row per model (see :func:`table1_row`)."""
    rows = []
    for model, cap in TABLE1_CASES:
        if models and model not in models:
            continue
        r = table1_row(model, cap, time_limit)
        log.info("table1 %s: Harmony %.3f s/iter (%d configs, %.2f s search); ours %.3f s/iter (%.2f s search, "
                 "%.3fx); ours free %.3f s/iter (%s x%d, %.2f s search, %.3fx)", model, r["harmony_time_s"],
                 r["harmony_configs"], r["harmony_search_s"], r["ours_time_s"], r["ours_search_s"], r["speedup"],
                 r["ours_free_time_s"], r["ours_free_mode"], r["ours_free_gpus"], r["ours_free_search_s"],
                 r["ours_free_speedup"])
        rows.append(r)
    if not rows:
        raise UsageError(f"--models {','.join(models or [])!r}: none is a model of Table 1 "
                         f"({', '.join(m for m, _ in TABLE1_CASES)})")
    return pd.DataFrame(rows)


#: the markdown tables of table1.md: Harmony's search, ours at its settings, ours with mode and GPUs free
TABLE1_HARMONY_MD = ["model", "layers", "harmony_space", "harmony_configs", "harmony_search_s", "harmony_u_fwd",
                     "harmony_u_bwd", "harmony_packs_fwd", "harmony_packs_bwd", "harmony_time_s",
                     "harmony_own_model_s"]
TABLE1_OURS_MD = ["model", "ours_search_s", "ours_search_ratio", "ours_u_fwd", "ours_u_bwd", "ours_packs_fwd",
                  "ours_packs_bwd", "ours_time_s", "speedup", "ours_model_s", "ours_fidelity", "ours_bound_s",
                  "ours_gap", "ours_config_status", "ours_config_proof", "ours_config_gap", "ours_timeline_gap",
                  "lower_bound_s", "ours_efficiency"]
TABLE1_FREE_MD = ["model", "ours_free_search_s", "ours_free_search_ratio", "ours_free_mode", "ours_free_gpus",
                  "ours_free_u_fwd", "ours_free_u_bwd", "ours_free_packs_fwd", "ours_free_packs_bwd",
                  "ours_free_time_s", "ours_free_speedup", "harmony_any_mode_time_s", "ours_free_speedup_any_mode",
                  "ours_free_fidelity", "ours_free_bound_s", "ours_free_gap", "ours_free_config_status",
                  "ours_free_config_proof", "ours_free_timeline_gap"]
#: what `python -m experiments table1` prints: the columns the issue asks for, and the free variant's
TABLE1_PRINT = ["model", "layers", "harmony_configs", "harmony_search_s", "harmony_time_s", "ours_search_s",
                "ours_time_s", "ours_bound_s", "ours_gap", "speedup", "ours_free_mode", "ours_free_gpus",
                "ours_free_search_s", "ours_free_time_s", "ours_free_speedup"]

def write_table1(df: pd.DataFrame, out_dir: Path, time_limit: float) -> list[Path]:
    harmony = (f"Settings of the paper's Table 1: minibatch {TABLE1_BATCH}, {TABLE1_MODE}, {TABLE1_GPUS} GPUs "
               f"({HARDWARE}), memory cap 9e9 bytes (bert_96, gpt2_xl) or 10 GiB (vgg416, resnet1026). Harmony's "
               "search with its published packing methods (forward balanced-by-time and reuse, backward "
               "balanced-by-time), every candidate judged by our simulator (default cost model): "
               "`harmony_space` is the grid of microbatch-size pairs it walks, `harmony_configs` the valid "
               "candidates it scores, `harmony_search_s` its search time, `harmony_time_s` its best plan's "
               "simulated iteration time and `harmony_own_model_s` that plan's time in Harmony's own simulator. "
               "Times in seconds.")
    ours = ("Our planner at the same settings (vPP, 4 GPUs, same caps), so its search answers the question "
            f"Harmony's does; time limit {time_limit:g} work seconds. `ours_search_s` is its wall time, which "
            "includes a run of Harmony's search (its incumbent and warm start); `ours_search_ratio` = "
            "ours_search_s / harmony_search_s. `ours_time_s`: the simulated iteration time of its plan, judged by "
            "the same simulator as Harmony's; `speedup` = harmony_time_s / ours_time_s (>= 1: the planner "
            "starts from Harmony's plan). `lower_bound_s`: the physical lower bound over all plans "
            "(harmony_opt.sim.bound), `ours_efficiency` = lower_bound_s / ours_time_s. " + solver_notes("ours_"))
    free = ("Our planner with the mode, the GPU count (1 to 4) and uneven microbatch splits free "
            f"(`PlannerOptions(mode=\"auto\", gpus=None, uneven=True)`, time limit {time_limit:g} work "
            "seconds), in the same process after the two searches above. `ours_free_speedup` = harmony_time_s "
            "(Harmony's vPP plan of the first table) / ours_free_time_s; `harmony_any_mode_time_s` is the best "
            "of Harmony's search in vPP and vDP on 4 GPUs (the free planner's incumbent) and "
            "`ours_free_speedup_any_mode` the speed-up over it. The other columns as above, named `ours_free_*`.")
    return write_table(df, out_dir, "table1", "Table 1: Harmony's schedule search vs the CP-SAT planner", [
        Section("Harmony's search", TABLE1_HARMONY_MD, harmony),
        Section("Ours at Harmony's settings", TABLE1_OURS_MD, ours),
        Section("Ours with the mode and GPU count free", TABLE1_FREE_MD, free)])


if __name__ == "__main__":
    import sys

    from .cli import main
    sys.exit(main(["table1", *sys.argv[1:]]))
