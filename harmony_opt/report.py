"""Tables and figures people read: profile summaries, per-layer plots, markdown tables and the
one line that says which machine a result came from (the experiments and benchmarks use both)."""
from __future__ import annotations

import math
import os
import platform
from pathlib import Path

import numpy as np
import pandas as pd

from .core.io import atomic_write_figure
from .core.profile import Profile


def machine_description() -> str:
    """One line naming the CPU, cores, memory and library versions, so results say where they ran."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = ""
    try:
        kb = int(Path("/proc/meminfo").read_text().split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    try:
        from ortools import __version__ as ortools_version
    except ImportError:
        ortools_version = "?"
    return (f"{cpu}, {os.cpu_count()} cores{mem}; {platform.system()} {platform.release()}; "
            f"Python {platform.python_version()}, OR-tools {ortools_version}, numpy {np.__version__}, "
            f"pandas {pd.__version__}")


def markdown_table(df: pd.DataFrame, floatfmt: str = ".4g") -> str:
    """A GitHub markdown table (no tabulate dependency); NaN prints as an empty cell."""
    def cell(v):
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return ""
        if isinstance(v, (float, np.floating)):
            return format(float(v), floatfmt)
        return str(v).replace("|", "/")
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def profiles_table(profiles: list[Profile]) -> pd.DataFrame:
    rows = []
    for p in profiles:
        t = p.totals()
        f, b = p.sizes("FWD"), p.sizes("BWD")
        rows.append({
            "profile": p.name, "layers": t["layers"],
            "params_GB": round(t["param_bytes"] / 1e9, 2),
            "optimizer_GB": round(t["optimizer_state_bytes"] / 1e9, 2),
            "fwd_microbatch": _sizes(f), "bwd_microbatch": _sizes(b),
            "device": p.meta.get("device", ""),
        })
    return pd.DataFrame(rows)


def _sizes(s) -> str:
    if len(s) == 1:
        return str(s[0])
    step = s[1] - s[0]
    if all(s[i + 1] - s[i] == step for i in range(len(s) - 1)):
        return f"{s[0]}..{s[-1]}" + (f" step {step}" if step != 1 else "")
    return ",".join(map(str, s))


def layer_table(p: Profile, u: int) -> pd.DataFrame:
    f, b = p.costs("FWD", min(u, p.size_range("FWD")[1])), p.costs("BWD", u)
    lay = p.layers.sort_values("layer")
    return pd.DataFrame({
        "layer": lay["layer"].to_numpy(),
        "params_MiB": (lay["param_bytes"].to_numpy() / 2**20).round(1),
        "fwd_ms": (f.time * 1e3).round(3),
        "bwd_ms": (b.time * 1e3).round(3),
        "fwd_peak_MiB": (f.memory / 2**20).round(1),
        "bwd_peak_MiB": (b.memory / 2**20).round(1),
        "input_MiB": (b.input[:-1] / 2**20).round(2),
        "cpu_update_ms": (lay["cpu_update_s"].to_numpy() * 1e3).round(2),
    })


def plot_profile(p: Profile, u: int, path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt


    df = layer_table(p, u)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    ax1.plot(df.layer, df.fwd_ms, label="forward", lw=1)
    ax1.plot(df.layer, df.bwd_ms, label="recompute + backward", lw=1)
    ax1.plot(df.layer, df.cpu_update_ms, label="CPU optimizer step", lw=1, ls="--")
    ax1.set_ylabel("time per layer (ms)")
    ax1.legend(loc="upper right", fontsize=8)
    ax1.set_title(f"{p.name}: per-layer profile at microbatch {u} ({p.meta.get('device', '')})")
    ax2.plot(df.layer, df.fwd_peak_MiB, label="forward peak", lw=1)
    ax2.plot(df.layer, df.bwd_peak_MiB, label="backward peak", lw=1)
    ax2.plot(df.layer, df.params_MiB, label="parameters", lw=1, ls="--")
    ax2.set_ylabel("memory per layer (MiB)")
    ax2.set_xlabel("layer")
    ax2.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    return atomic_write_figure(path, fig, dpi=110)
