"""Tables and the figure of the GPU experiment, from the raw JSON of experiments/results/gpu/."""
from __future__ import annotations

import datetime

import pandas as pd

from harmony_opt.core.io import atomic_write_figure, atomic_write_text
from harmony_opt.report import markdown_table

from . import read_result

GB = 10 ** 9
#: every method a case may hold results of, in table and figure order ("l2l": runs filed as what they ran)
METHODS = ("ours", "harmony", "naive-swap", "l2l", "torch-offload", "deepspeed")


def runs_table(P, workloads, caps, device_name: str) -> pd.DataFrame:
    rows = []
    for w in workloads:
        for cap in caps:
            d = P.case(w, cap)
            if not (d / "case.json").exists():
                continue
            info = read_result(d / "case.json")
            base = {"device": device_name, "model": w.model, "cap_GB": cap / GB, "batch": info["batch"],
                    "footprint_GB": info["footprint"] / GB, "lower_bound_s": info.get("lower_bound_s")}
            if info.get("skipped"):
                rows.append({**base, "method": "-", "status": info["skipped"]})
                continue
            for method in METHODS:
                f = d / f"{method}.run.json"
                plan = info["plans"].get(method, {})
                if not f.exists():
                    continue
                r = read_result(f)
                row = {**base, "method": method, "status": "ok" if r.get("ok") else r.get("error", "failed"),
                       "simulated_s": plan.get("simulated_s"), "u_fwd": plan.get("u_fwd"),
                       "u_bwd": plan.get("u_bwd"), "packs_bwd": plan.get("packs_bwd")}
                if r.get("ok"):
                    row.update(measured_s=r["step_s_mean"], measured_median_s=r["step_s_median"],
                               samples_per_s=r["samples_per_s"], steps=r["steps_measured"],
                               peak_allocated_GB=(r["peak_allocated"] or 0) / GB,
                               peak_reserved_GB=(r["peak_reserved"] or 0) / GB,
                               moved_h2d_GB=r["bytes_h2d_per_step"] / GB, moved_d2h_GB=r["bytes_d2h_per_step"] / GB,
                               loss_first=r["loss_first"], loss_last=r["loss_last"])
                    if plan.get("simulated_s"):
                        row["measured_over_simulated"] = r["step_s_mean"] / plan["simulated_s"]
                        row["sim_h2d_GB"] = plan["sim_h2d"] / GB
                        row["sim_d2h_GB"] = plan["sim_d2h"] / GB
                    if info.get("lower_bound_s"):
                        row["measured_over_bound"] = r["step_s_mean"] / info["lower_bound_s"]
                    # which term is off: each stream's busy seconds, measured (last step) and simulated
                    sim_busy = info.get("simulated_busy", {}).get(method, {})
                    for stream, t in r.get("busy_last_step", {}).items():
                        row[f"busy_{stream}_s"] = t
                        if sim_busy.get(stream):
                            row[f"busy_{stream}_over_sim"] = t / sim_busy[stream]
                rows.append(row)
    df = pd.DataFrame(rows)
    if not df.empty and "samples_per_s" in df:
        ours = df[df.method == "ours"].set_index(["model", "cap_GB"])["samples_per_s"]
        df["ours_speedup"] = [ours.get((m, c)) / s if s and ours.get((m, c)) else None
                              for m, c, s in zip(df.model, df.cap_GB, df["samples_per_s"])]
    return df


def _bars(path, labels: list[str], series: dict[str, list[float]], ylabel: str, title: str, *,
          values: bool = False, reference: float | None = None) -> None:
    """Grouped bars: one group per label, one bar per series; saved as PNG (atomically)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, (0.5 + 0.3 * len(series)) * len(labels)), 4))
    width = 0.8 / max(len(series), 1)
    for k, (name, ys) in enumerate(series.items()):
        bars = ax.bar([i + k * width for i in range(len(labels))], [y or 0 for y in ys], width, label=name)
        if values:
            ax.bar_label(bars, labels=[f"{y:.3g}" if y else "" for y in ys], fontsize=7)
    if reference is not None:
        ax.axhline(reference, color="black", lw=0.8)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(labels))])
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_write_figure(path, fig, dpi=120)


def plot(df: pd.DataFrame, path, device_name: str) -> None:
    """Samples/s by method, one group per model and cap."""
    ok = df[df.status == "ok"]
    groups = list(dict.fromkeys(zip(ok.model, ok.cap_GB)))
    methods = [m for m in METHODS if m in set(ok.method)]

    def value(g, m):
        v = ok[(ok.model == g[0]) & (ok.cap_GB == g[1]) & (ok.method == m)]["samples_per_s"]
        return float(v.iloc[0]) if len(v) else None
    labels = [f"{m}\ncap {c:g} GB, D={int(ok[(ok.model == m) & (ok.cap_GB == c)].batch.iloc[0])}" for m, c in groups]
    _bars(path, labels, {m: [value(g, m) for g in groups] for m in methods}, "samples/s (higher is better)",
          f"Training larger than the GPU memory cap on {device_name}", values=True)


def plot_busy(df: pd.DataFrame, path, device_name: str) -> None:
    """Per plan run: each stream's busy time in the last step, measured over simulated. A stream far
    from 1 is the cost-model term to fix (docs: experiments/README.md, "On a real GPU")."""
    streams = [s for s in ("compute", "cpu", "h2d", "d2h") if f"busy_{s}_over_sim" in df]
    runs = df.dropna(subset=[f"busy_{streams[0]}_over_sim"])
    labels = [f"{m}\n{c:g} GB\n{meth}" for m, c, meth in zip(runs.model, runs.cap_GB, runs.method)]
    _bars(path, labels, {s: list(runs[f"busy_{s}_over_sim"]) for s in streams}, "busy time, measured / simulated",
          f"Which term is off: each stream's busy time on {device_name}", reference=1.0)


def handoff_table(P, workloads, caps) -> pd.DataFrame:
    """Plan.gpu_handoff measured (stage ``handoff``): per case, the plan with its gradients kept on the
    GPU against the same plan through host memory, measured (median over the rounds of each run's mean
    step time; every round's in ``rounds_*``) and simulated."""
    rows = []
    for w in workloads:
        for cap in caps:
            f = P.case(w, cap) / "handoff.json"
            if not f.exists():
                continue
            h = read_result(f)
            row = {"model": w.model, "cap_GB": cap / GB, "batch": h["batch"], "swaps_host": h["swaps"]["host"],
                   "swaps_kept": h["swaps"]["kept"]}
            if h.get("skipped"):
                rows.append({**row, "status": h["skipped"]})
                continue
            runs = pd.DataFrame(h["runs"])
            failed = runs[~runs.ok.astype(bool)]
            row["status"] = "ok" if failed.empty else f"failed: {failed.error.iloc[0]}"
            for k in ("host", "kept"):
                ok = runs[(runs.plan == k) & runs.ok.astype(bool)]
                row[f"simulated_{k}_s"] = h[f"simulated_{k}_s"]
                if len(ok):
                    row[f"measured_{k}_s"] = float(ok.step_s_mean.median())
                    row[f"rounds_{k}_s"] = " / ".join(f"{t:.4g}" for t in ok.step_s_mean)
                    row[f"moved_{k}_GB"] = float((ok.bytes_h2d_per_step + ok.bytes_d2h_per_step).mean()) / GB
                    row[f"loss_last_{k}"] = float(ok.loss_last.iloc[-1])
            if "measured_kept_s" in row and "measured_host_s" in row:
                row["measured_gain"] = row["measured_host_s"] / row["measured_kept_s"]
            row["simulated_gain"] = row["simulated_host_s"] / row["simulated_kept_s"]
            rows.append(row)
    return pd.DataFrame(rows)


def trace_events(path) -> pd.DataFrame:
    """The event table of a Chrome trace written by ``Timeline.to_chrome_trace`` (times in s)."""
    trace = read_result(path)["traceEvents"]
    streams = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace if e["ph"] == "M" and e["name"] == "thread_name"}
    return pd.DataFrame([{"rank": e["pid"], "stream": streams[(e["pid"], e["tid"])], "kind": e["name"].split()[0],
                          "start": e["ts"] / 1e6, "end": (e["ts"] + e["dur"]) / 1e6}
                         for e in trace if e["ph"] == "X"], columns=["rank", "stream", "kind", "start", "end"])


def kinds_table(P, workloads, caps) -> pd.DataFrame:
    """Per trained run with a trace: seconds of each kind of work in the measured last step and in
    the simulator's iteration of the same plan (trial.busy_by_kind), so that where the two
    disagree shows by kind, not only by stream."""
    from harmony_opt.core.hardware import get_hardware
    from harmony_opt.core.plan import Plan
    from harmony_opt.core.profile import Profile
    from harmony_opt.sim.simulator import simulate

    from .trial import busy_by_kind
    rows = []
    if not P.hardware.exists():
        return pd.DataFrame(rows)
    for w in workloads:
        prof = Profile.load(P.profile(w)) if P.profile(w).exists() else None
        for cap in caps:
            d = P.case(w, cap)
            runs = [m for m in METHODS if (d / f"{m}.trace.json").exists() and (d / f"{m}.plan.json").exists()]
            if prof is None or not runs:
                continue
            hw = get_hardware(P.hardware, memory_cap=cap)
            for method in runs:
                trace = d / f"{method}.trace.json"
                tl = simulate(Plan.load(d / f"{method}.plan.json"), prof, hw, memory_cap=cap)
                measured, simulated = busy_by_kind(trace_events(trace)), busy_by_kind(tl.events)
                for kind in sorted(set(measured) | set(simulated)):
                    m, s = measured.get(kind, 0.0), simulated.get(kind, 0.0)
                    rows.append({"model": w.model, "cap_GB": cap / GB, "method": method, "kind": kind,
                                 "measured_s": m, "simulated_s": s, "measured_over_simulated": m / s if s else None})
    return pd.DataFrame(rows)


def write_report(P, workloads, caps, device_name: str) -> None:
    P.results.mkdir(parents=True, exist_ok=True)
    df = runs_table(P, workloads, caps, device_name)
    atomic_write_text(P.results / "gpu_runs.csv", df.to_csv(index=False, float_format="%.6g"))
    path = P.raw / "correctness.json"
    corr = pd.DataFrame(read_result(path)) if path.exists() else None
    if corr is not None:
        atomic_write_text(P.results / "gpu_correctness.csv", corr.to_csv(index=False, float_format="%.3g"))
    if not df.empty and (df.status == "ok").any():
        plot(df, P.results / "gpu_samples_per_s.png", device_name)
    if "busy_compute_over_sim" in df and df["busy_compute_over_sim"].notna().any():
        plot_busy(df, P.results / "gpu_busy_by_stream.png", device_name)
    lines = [f"# GPU experiment on {device_name} ({datetime.date.today().isoformat()})", "",
             "`python -m experiments.gpu` (experiments/gpu/); raw results in experiments/results/gpu/.", ""]
    if not df.empty:
        cols = [c for c in ("model", "cap_GB", "batch", "footprint_GB", "method", "status", "samples_per_s",
                            "ours_speedup", "measured_s", "simulated_s", "measured_over_simulated",
                            "measured_over_bound", "busy_compute_over_sim", "busy_cpu_over_sim",
                            "busy_h2d_over_sim", "busy_d2h_over_sim", "peak_allocated_GB", "moved_h2d_GB",
                            "moved_d2h_GB", "steps")
                if c in df]
        lines += [markdown_table(df[cols], floatfmt=".3g"), ""]
    kept = handoff_table(P, workloads, caps)
    if not kept.empty:
        atomic_write_text(P.results / "gpu_handoff.csv", kept.to_csv(index=False, float_format="%.6g"))
        lines += ["Gradients kept on the GPU (Plan.gpu_handoff; stage `handoff`): our plan with the activation "
                  "gradients between single-microbatch backward packs kept on the GPU (`kept`) against the same "
                  "plan through host memory (`host`), trained alternately; `measured_*`: median over the rounds of "
                  "each run's mean step time (`rounds_*`: each round's); `swaps_*`: swap instructions per "
                  "iteration.", "", markdown_table(kept, floatfmt=".4g"), ""]
    kinds = kinds_table(P, workloads, caps)
    if not kinds.empty:
        atomic_write_text(P.results / "gpu_by_kind.csv", kinds.to_csv(index=False, float_format="%.6g"))
        runs = kinds.assign(run=[f"{m} {c:g} GB {k}" for m, c, k in zip(kinds.model, kinds.cap_GB, kinds.method)])
        cells = [f"{a:.3f} / {b:.3f}" for a, b in zip(runs.measured_s, runs.simulated_s)]
        pivot = runs.assign(cell=cells).pivot(index="run", columns="kind", values="cell").fillna("-").reset_index()
        lines += ["Where the time goes, by kind of work (seconds in the measured last step / in the simulator's "
                  "iteration of the same plan; sums of event durations on rank 0, so overlapping work counts in "
                  "full; gpu_by_kind.csv):", "", markdown_table(pivot), ""]
    if corr is not None:
        lines += ["Correctness (weights after 10 steps, executor vs plain PyTorch, TF32 off):", "",
                  markdown_table(corr, floatfmt=".2e"), ""]
    atomic_write_text(P.results / "gpu_summary.md", "\n".join(lines))
