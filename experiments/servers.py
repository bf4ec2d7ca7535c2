"""Beyond one server: Harmony's search and ours on 1, 2 and 4 paper servers (docs/scaling.md).

    python -m experiments servers [--time-limit S] [--models gpt2_xl,bert_96] [--out DIR]

Each hardware is the paper's server replicated (harmony_opt.core.hardware.multi_server_hardware):
every server its own host link, host memory and pinned memory, 25 GbE or 100 Gb/s between them.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import pandas as pd

from harmony_opt.core.bundled import load_profile
from harmony_opt.core.errors import HarmonyOptError
from harmony_opt.core.hardware import INTER_SERVER_25GBE, INTER_SERVER_100G, multi_server_hardware
from harmony_opt.planners.baselines import plan_harmony
from harmony_opt.planners.registry import get_planner
from harmony_opt.sim.bound import lower_bound
from harmony_opt.sim.host_memory import host_memory_per_server
from harmony_opt.sim.simulator import simulate

from .common import COLORS, HARDWARE, TABLE1_BATCH, TABLE1_CASES, Section, plan_columns, save_figure, write_table

log = logging.getLogger("experiments.servers")

#: the models and their memory caps (Table 1's), the server counts and the networks between servers
SERVER_MODELS = ("gpt2_xl", "bert_96")
SERVER_COUNTS = (1, 2, 4)
NETWORKS = {"25 GbE": INTER_SERVER_25GBE, "100 Gb/s": INTER_SERVER_100G}
RUNS = (("harmony", "vPP"), ("harmony", "vDP"), ("ours", "vPP"), ("ours", "vDP"))


def server_cases(counts=SERVER_COUNTS) -> list[tuple[int, str, object]]:
    """(servers, network label, Hardware): one server alone, more on each network."""
    out = []
    for n in counts:
        for label, bw in (NETWORKS.items() if n > 1 else [("-", 0.0)]):
            out.append((n, label, multi_server_hardware(HARDWARE, n, bw) if n > 1 else multi_server_hardware(HARDWARE, 1)))
    return out


def servers(time_limit: float = 2.0, models=SERVER_MODELS, batch: int = TABLE1_BATCH,
            counts=SERVER_COUNTS) -> pd.DataFrame:
    """Harmony's search and ours, each in vPP and in vDP on every GPU, on each hardware of
    ``server_cases``; every plan simulated."""
    caps = dict(TABLE1_CASES)
    rows = []
    for model in models:
        profile = load_profile(model)
        for n, network, base in server_cases(counts):
            hw = base.with_memory(caps[model]) if model in caps else base
            cap = hw.gpu_memory_bytes
            lb = lower_bound(profile, hw, batch, cap)["bound_s"]
            for who, mode in RUNS:
                row = {"model": model, "servers": n, "network": network, "hardware": hw.name, "planner": who,
                       "mode_requested": mode}
                t0 = time.perf_counter()
                try:
                    if who == "harmony":
                        p = plan_harmony(profile, hw, batch, cap, mode=mode, gpus=hw.gpus)
                    else:
                        p = get_planner("cp-sat")(profile, hw, batch, cap, mode=mode, gpus=hw.gpus,
                                                  time_limit=time_limit, processes=1)
                    search = time.perf_counter() - t0
                    tl = simulate(p, profile, hw, with_timeline=False)
                except HarmonyOptError as e:
                    rows.append({**row, "note": str(e).splitlines()[0][:100]})
                    continue
                moved = tl.meta["bytes"]
                host = max(m.total for m in host_memory_per_server(p, profile, hw)) if n > 1 else None
                rows.append({**row, **plan_columns(p, ""), "iteration_s": tl.iteration_time,
                             "samples_per_s": batch / tl.iteration_time,
                             "swap_GB": (moved["h2d"] + moved["d2h"]) / 1e9, "p2p_GB": moved["p2p"] / 1e9,
                             "network_GB": tl.meta.get("network_bytes", 0) / 1e9,
                             "host_GiB_per_server": (host if host is not None else None) and host / 2**30,
                             "lower_bound_s": lb, "efficiency": lb / tl.iteration_time, "search_s": search})
            log.info("servers: %s on %d server(s), %s done", model, n, network)
    df = pd.DataFrame(rows)
    if "samples_per_s" in df:
        one = df[df.servers == 1].set_index(["model", "planner", "mode_requested"]).samples_per_s
        df["speedup_vs_1"] = [r.samples_per_s / one.get((r.model, r.planner, r.mode_requested), float("nan"))
                              for r in df.itertuples()]
    return df


def write_servers(df: pd.DataFrame, out_dir: Path, time_limit: float) -> list[Path]:
    """servers.csv, servers.md and servers.png (samples/s against servers, per model)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    notes = (f"Minibatch {TABLE1_BATCH}, the memory caps of Table 1, every GPU of 1, 2 or 4 paper servers "
             f"({HARDWARE}: 4 GPUs, one PCIe switch of 11.5 GiB/s, P2P 8.2 GiB/s, 256 GiB of host memory each) "
             f"with 25 GbE (3.125 GB/s) or 100 Gb/s (12.5 GB/s) between servers; simulated with the default cost "
             f"model. Harmony's search and ours (the CP-SAT planner, time limit {time_limit:g} work seconds, one "
             "process; its search includes Harmony's), each in vPP and in vDP. swap_GB: host<->GPU bytes per "
             "iteration; p2p_GB: GPU<->GPU bytes (the all-reduce counted once per replica); network_GB: bytes "
             "that cross servers (activations, host-to-host copies of stashes and updated weights, the "
             "all-reduce's inter-server stage); host_GiB_per_server: the largest server's host memory; "
             "speedup_vs_1: samples/s over the same planner and mode on one server; efficiency = lower_bound_s / "
             "iteration_s. See docs/scaling.md for what the simulator models of several servers.")
    cols = ["model", "servers", "network", "planner", "mode", "gpus", "u_fwd", "u_bwd", "packs_fwd", "packs_bwd",
            "iteration_s", "samples_per_s", "speedup_vs_1", "swap_GB", "p2p_GB", "network_GB", "host_GiB_per_server",
            "efficiency", "search_s", "note"]
    paths = write_table(df, out_dir, "servers", "Beyond one server: 1, 2 and 4 simulated paper servers",
                        [Section("", cols, notes)])
    models = list(dict.fromkeys(df.model))
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 4.8), squeeze=False)
    colors = {("harmony", "vPP"): COLORS["harmony"], ("harmony", "vDP"): "tab:brown",
              ("ours", "vPP"): COLORS["cp-sat"], ("ours", "vDP"): "tab:cyan"}
    styles = {"25 GbE": ":", "100 Gb/s": "-"}
    for ax, model in zip(axes[0], models):
        d = df[(df.model == model) & df.samples_per_s.notna()] if "samples_per_s" in df else df.iloc[:0]
        for (who, mode), color in colors.items():
            one = d[(d.planner == who) & (d.mode_requested == mode) & (d.servers == 1)]
            for net, ls in styles.items():
                s = d[(d.planner == who) & (d.mode_requested == mode) & (d.network == net)]
                s = pd.concat([one, s]).sort_values("servers")
                if len(s):
                    ax.plot(s.servers, s.samples_per_s, marker="o", ls=ls, color=color, label=f"{who} {mode}, {net}")
        ax.set_xticks(list(SERVER_COUNTS))
        ax.set_xlabel("servers (4 GPUs each)")
        ax.set_ylabel("simulated samples / s")
        ax.set_title(f"{model}, D={TABLE1_BATCH}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Several paper servers: 25 GbE (dotted) and 100 Gb/s (solid) between them")
    fig.tight_layout()
    paths.append(save_figure(fig, out_dir / "servers.png"))
    return paths


if __name__ == "__main__":
    import sys

    from .cli import main
    sys.exit(main(["servers", *sys.argv[1:]]))
