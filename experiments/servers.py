"""Beyond one server: Harmony's search and ours on one paper server and on two (docs/scaling.md).

    python -m experiments servers [--time-limit S] [--out DIR]

Two servers are one 8-GPU Hardware (harmony_opt.core.hardware.two_server_hardware).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import pandas as pd

from harmony_opt.core.bundled import load_profile
from harmony_opt.core.errors import HarmonyOptError
from harmony_opt.core.hardware import two_server_hardware
from harmony_opt.planners.baselines import plan_harmony
from harmony_opt.planners.registry import get_planner
from harmony_opt.sim.bound import lower_bound
from harmony_opt.sim.simulator import simulate

from .common import TABLE1_BATCH, Section, plan_columns, solver_columns, solver_notes, write_table

log = logging.getLogger("experiments.servers")


def two_servers(time_limit: float = 10.0, model: str = "gpt2_xl", batch: int = TABLE1_BATCH) -> pd.DataFrame:
    """Harmony's search (vPP and vDP) and ours on one server and on two, all simulated."""
    profile = load_profile(model)
    rows = []
    for label, hw in two_server_hardware().items():
        cap = hw.gpu_memory_bytes
        lb = lower_bound(profile, hw, batch, cap)["bound_s"]
        runs = [(f"harmony {m}", plan_harmony, {"mode": m, "gpus": hw.gpus}) for m in ("vPP", "vDP")]
        runs.append(("ours", get_planner("cp-sat"), {"mode": "auto", "gpus": hw.gpus, "time_limit": time_limit}))
        for name, planner, kw in runs:
            t0 = time.perf_counter()
            try:
                p = planner(profile, hw, batch, cap, **kw)
            except HarmonyOptError as e:
                rows.append({"hardware": label, "planner": name, "note": str(e)[:80]})
                continue
            search = time.perf_counter() - t0
            tl = simulate(p, profile, hw)
            moved = tl.bytes_moved()
            rows.append({"hardware": label, "planner": name, **plan_columns(p, ""), "iteration_s": tl.iteration_time,
                         "samples_per_s": batch / tl.iteration_time, "swap_GB": (moved["h2d"] + moved["d2h"]) / 1e9,
                         "p2p_GB": moved["p2p"] / 1e9, "lower_bound_s": lb, "efficiency": lb / tl.iteration_time,
                         "search_s": search, **(solver_columns(p, "solver_") if p.solver else {})})
        log.info("two servers: %s done", label)
    return pd.DataFrame(rows)


def write_two_servers(df: pd.DataFrame, out_dir: Path, time_limit: float) -> list[Path]:
    notes = ("gpt2_xl, minibatch 64, memory cap 10 GiB per GPU, simulated with the default cost model. Two "
             "servers are one 8-GPU Hardware whose shared host link carries two transfers per direction (one per "
             "server's PCIe switch); GPU<->GPU traffic (vPP activations, vDP all-reduce) runs at one bandwidth "
             "for every pair, so the two variants bracket a real 4 + 4 split: PCIe P2P speed for every pair "
             "(optimistic) and 25 Gb/s Ethernet for every pair (pessimistic). Harmony's search in vPP and in vDP "
             "on every GPU; ours: the CP-SAT planner on every GPU, mode chosen, time limit "
             f"{time_limit:g} work seconds (its search includes Harmony's in both modes, its incumbent). "
             "swap_GB: host->GPU + GPU->host bytes per iteration; p2p_GB: GPU<->GPU bytes; efficiency = "
             "lower_bound_s / iteration_s. " + solver_notes("solver_") + " See docs/scaling.md for what this "
             "does not model.")
    cols = ["hardware", "planner", "mode", "gpus", "u_fwd", "u_bwd", "packs_fwd", "packs_bwd", "iteration_s",
            "samples_per_s", "swap_GB", "p2p_GB", "lower_bound_s", "efficiency", "search_s", "solver_fidelity",
            "solver_gap", "solver_config_status", "solver_config_proof", "solver_timeline_gap", "note"]
    return write_table(df, out_dir, "two_servers", "Beyond one server: two simulated 4-GPU servers",
                       [Section("", cols, notes)])


if __name__ == "__main__":
    import sys

    from .cli import main
    sys.exit(main(["servers", *sys.argv[1:]]))
