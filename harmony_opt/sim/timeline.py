"""Timeline: what a simulator (or the runtime's measurement) says happened in one iteration.

``events`` is a pandas table, one row per event: ``rank, stream, kind, task, pack,
microbatch, start, end, bytes``. ``memory`` is a step function per rank: ``rank, time,
bytes`` (GPU bytes in use from ``time`` on). ``host`` (measured on a GPU): when the issuing thread
issued each instruction, ``rank, instruction, kind, start, end``. Exports: Chrome/Perfetto trace JSON and a
matplotlib Gantt chart with memory over time beneath.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd

from ..core.io import atomic_write_figure, atomic_write_text

EVENT_COLUMNS = ["rank", "stream", "kind", "task", "pack", "microbatch", "start", "end", "bytes"]

#: Streams that move bytes over the host link, by direction.
H2D_STREAMS = ("swap_in", "swap_in_w", "SwapIn")
D2H_STREAMS = ("swap_out", "SwapOut")
P2P_STREAMS = ("p2p", "P2PIn", "P2POut")

#: Gantt colours of the transfer streams (compute events are coloured by their kind).
STREAM_COLORS = {"swap_in_w": "tab:brown", "swap_in": "tab:orange", "SwapIn": "tab:orange",
                 "swap_out": "tab:purple", "SwapOut": "tab:purple", "p2p": "tab:pink", "P2PIn": "tab:pink",
                 "P2POut": "tab:pink", "cpu": "tab:red", "CPU": "tab:red", "net": "tab:olive"}


#: The ``meta`` entries a Chrome trace carries (in its ``otherData``) and reads back.
TRACE_META = ("source", "plan_identity")

_NO_EVENTS = pd.DataFrame(columns=EVENT_COLUMNS)
_NO_MEMORY = pd.DataFrame(columns=["rank", "time", "bytes"])
HOST_COLUMNS = ["rank", "instruction", "kind", "start", "end"]
#: The thread a Chrome trace shows the host's issue times on (one per rank)
HOST_THREAD = "host issue"


@dataclasses.dataclass
class Timeline:
    events: pd.DataFrame
    iteration_time: float
    memory: pd.DataFrame = dataclasses.field(
        default_factory=lambda: pd.DataFrame(columns=["rank", "time", "bytes"]))
    cost_model: str = "default"
    ranks: int = 1
    meta: dict = dataclasses.field(default_factory=dict)
    host: pd.DataFrame = dataclasses.field(default_factory=lambda: pd.DataFrame(columns=HOST_COLUMNS))

    @classmethod
    def from_records(cls, records: list[tuple], iteration_time: float, memory_records=(), **kw) -> "Timeline":
        ev = pd.DataFrame.from_records(records, columns=EVENT_COLUMNS) if records else pd.DataFrame(
            columns=EVENT_COLUMNS)
        mem = pd.DataFrame.from_records(list(memory_records), columns=["rank", "time", "bytes"])
        return cls(ev, float(iteration_time), mem, **kw)

    @classmethod
    def summary(cls, iteration_time: float, **kw) -> "Timeline":
        """A Timeline without its tables (``meta`` carries the summaries): the planners simulate
        thousands of candidates, and building two DataFrames cost a small plan's simulation a third
        of its time."""
        return cls(_NO_EVENTS.copy(), float(iteration_time), _NO_MEMORY.copy(), **kw)

    # -- summaries ------------------------------------------------------------------------
    def peak_memory(self) -> dict[int, int]:
        """Peak GPU bytes per rank: ``meta["peak_memory"]`` where the maker knows it exactly (the
        simulator: the program's replay, whose changes at one instant ``memory`` nets out), else the
        most ``memory`` holds."""
        if "peak_memory" in self.meta or self.memory.empty:
            return {int(r): int(b) for r, b in self.meta.get("peak_memory", {}).items()}
        return {int(r): int(g["bytes"].max()) for r, g in self.memory.groupby("rank")}

    def bytes_moved(self) -> dict[str, int]:
        """Bytes per link: host->GPU, GPU->host, GPU<->GPU (counted once per transfer)."""
        ev = self.events
        out = {}
        for name, streams in (("h2d", H2D_STREAMS), ("d2h", D2H_STREAMS)):
            out[name] = int(ev.loc[ev.stream.isin(streams), "bytes"].sum())
        p2p = ev[ev.stream.isin(P2P_STREAMS)]
        # a rendezvous appears on both sides (send and receive): count the send only
        sends = p2p[p2p.kind.isin(["Y", "dX", "send", "ARD"]) | (p2p.stream == "P2POut")]
        out["p2p"] = int(sends["bytes"].sum())
        return out

    def swap_bytes(self) -> int:
        b = self.bytes_moved()
        return b["h2d"] + b["d2h"]

    def busy_time(self, stream: str = "compute") -> dict[int, float]:
        ev = self.events[self.events.stream.str.lower() == stream.lower()]
        return {int(r): float((g.end - g.start).sum()) for r, g in ev.groupby("rank")}

    # -- exports ----------------------------------------------------------------------------
    def to_chrome_trace(self, path: str | Path) -> Path:
        """Chrome/Perfetto trace: one process per rank, one thread per stream, times in us."""
        streams = sorted(self.events.stream.unique()) if len(self.events) else []
        tid = {s: i for i, s in enumerate(streams)}
        trace = []
        for r in range(self.ranks):
            trace.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"rank {r}"}})
            for s, i in tid.items():
                trace.append({"ph": "M", "name": "thread_name", "pid": r, "tid": i, "args": {"name": s}})
        for e in self.events.itertuples(index=False):
            task = e.task.item() if isinstance(e.task, np.generic) else e.task
            trace.append({
                "ph": "X", "pid": int(e.rank), "tid": tid[e.stream], "name": f"{e.kind} {e.pack}",
                "ts": float(e.start) * 1e6, "dur": max(float(e.end - e.start), 0.0) * 1e6,
                "args": {"task": task, "kind": str(e.kind), "pack": str(e.pack), "microbatch": int(e.microbatch),
                         "bytes": int(e.bytes)},
            })
        if len(self.host):
            for r in range(self.ranks):
                trace.append({"ph": "M", "name": "thread_name", "pid": r, "tid": len(tid),
                              "args": {"name": HOST_THREAD}})
            for h in self.host.itertuples(index=False):
                trace.append({"ph": "X", "pid": int(h.rank), "tid": len(tid), "name": str(h.instruction),
                              "ts": float(h.start) * 1e6, "dur": max(float(h.end - h.start), 0.0) * 1e6,
                              "args": {"issued": str(h.instruction), "kind": str(h.kind)}})
        for m in self.memory.itertuples(index=False):
            trace.append({"ph": "C", "pid": int(m.rank), "name": "GPU memory (MiB)",
                          "ts": float(m.time) * 1e6, "args": {"MiB": float(m.bytes) / 2**20, "bytes": int(m.bytes)}})
        # what from_chrome_trace needs besides the events (Chrome and Perfetto ignore it)
        other = {"iteration_time_s": float(self.iteration_time), "cost_model": self.cost_model, "ranks": self.ranks,
                 **{k: v for k, v in self.meta.items() if k in TRACE_META}}
        return atomic_write_text(path, json.dumps({"traceEvents": trace, "displayTimeUnit": "ms",
                                                   "otherData": other}))

    @classmethod
    def from_chrome_trace(cls, path: str | Path) -> "Timeline":
        """A Timeline read back from :meth:`to_chrome_trace`'s file (``harmony-opt run --trace``,
        ``simulate --trace``): its events, memory steps and iteration time. A file that is not such a
        trace raises UsageError naming it."""
        from ..core.errors import UsageError
        from ..core.io import read_text

        path = Path(path)
        text = read_text(path, "trace file", UsageError, "give a trace written by `harmony-opt run --trace FILE`")
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise UsageError(f"trace file {path}: line {e.lineno}: not valid JSON ({e.msg})") from None
        items = doc.get("traceEvents") if isinstance(doc, dict) else None
        if not isinstance(items, list):
            raise UsageError(f"trace file {path}: no traceEvents list; give a trace written by "
                             f"`harmony-opt run --trace FILE`")
        other = doc.get("otherData") if isinstance(doc.get("otherData"), dict) else {}
        try:
            threads = {(int(e["pid"]), int(e["tid"])): str(e["args"]["name"]) for e in items
                       if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "thread_name"}
            records, memory, host = [], [], []
            for e in items:
                if not isinstance(e, dict) or e.get("ph") not in ("X", "C"):
                    continue
                a, rank = e.get("args") or {}, int(e["pid"])
                if "issued" in a:
                    start = float(e["ts"]) / 1e6
                    host.append((rank, str(a["issued"]), str(a["kind"]), start, start + float(e["dur"]) / 1e6))
                    continue
                if e["ph"] == "C":
                    mib = a.get("bytes", float(a.get("MiB", 0.0)) * 2**20)
                    memory.append((rank, float(e["ts"]) / 1e6, int(round(mib))))
                    continue
                kind, pack = (a["kind"], a["pack"]) if "kind" in a else str(e["name"]).split(" ", 1)
                start = float(e["ts"]) / 1e6
                records.append((rank, threads[(rank, int(e["tid"]))], str(kind), a.get("task", ""), str(pack),
                                int(a.get("microbatch", -1)), start, start + float(e["dur"]) / 1e6,
                                int(a.get("bytes", 0))))
        except (KeyError, TypeError, ValueError) as e:
            raise UsageError(f"trace file {path}: an event lacks or has a malformed field ({type(e).__name__}: "
                             f"{e}); give a trace written by `harmony-opt run --trace FILE`") from None
        if not records:
            raise UsageError(f"trace file {path} holds no timed events; give a trace written by "
                             f"`harmony-opt run --trace FILE`")
        iteration = float(other.get("iteration_time_s", max(r[7] for r in records)))
        ranks = int(other.get("ranks", 1 + max(r[0] for r in records)))
        meta = {k: v for k, v in other.items() if k in TRACE_META}
        return cls.from_records(records, iteration, memory, cost_model=str(other.get("cost_model", "default")),
                                ranks=ranks, meta=meta, host=pd.DataFrame(host, columns=HOST_COLUMNS))

    def plot(self, path: str | Path, title: str = "", cap: int | None = None, xmax: float | None = None) -> Path:
        """Gantt chart per rank and stream, with GPU memory over time beneath.

        ``xmax`` (seconds) fixes the time axis, so charts of two plans compare at one scale."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ev = self.events
        lanes = sorted({(int(r), s) for r, s in zip(ev["rank"], ev["stream"])}, key=lambda x: (x[0], x[1]))
        colors = {"compute": "tab:blue", "FWD": "tab:blue", "REC": "tab:cyan", "BWD": "tab:green",
                  "UPD": "tab:red", "Update": "tab:red"}
        fig, (ax, axm) = plt.subplots(2, 1, figsize=(13, 2 + 0.35 * len(lanes) + 2.5), sharex=True,
                                      gridspec_kw={"height_ratios": [max(len(lanes), 1) * 0.35 + 1, 2.5]})
        for y, (r, s) in enumerate(lanes):
            sub = ev[(ev["rank"] == r) & (ev["stream"] == s)]
            bars = list(zip(sub.start, sub.end - sub.start))
            cols = [colors.get(k, STREAM_COLORS.get(s, "tab:gray")) for k in sub.kind]
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=cols, edgecolor="none")
        ax.set_yticks(range(len(lanes)))
        ax.set_yticklabels([f"GPU{r} {s}" for r, s in lanes], fontsize=7)
        ax.invert_yaxis()
        from matplotlib.patches import Patch
        # legends above and beside the axes, never over the bars or the memory traces
        ax.legend(handles=[Patch(color=c, label=l) for l, c in (
            ("forward", "tab:blue"), ("recompute", "tab:cyan"), ("backward", "tab:green"),
            ("CPU update", "tab:red"), ("weights in", "tab:brown"), ("swap in", "tab:orange"),
            ("swap out", "tab:purple"), ("GPU to GPU", "tab:pink"), ("other", "tab:gray"))],
            fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=9, frameon=False)
        ax.set_title(title or f"timeline ({self.cost_model} cost model): iteration {self.iteration_time:.3f} s",
                     pad=22)
        for r, g in self.memory.groupby("rank"):
            g = g.sort_values("time")
            axm.step(g.time, g.bytes / 2**30, where="post", label=f"GPU{r}", lw=1)
        if cap:
            axm.axhline(cap / 2**30, color="k", ls="--", lw=1, label="memory cap")
        axm.set_ylabel("GPU memory (GiB)")
        axm.set_xlabel("time (s)")
        if xmax:
            axm.set_xlim(0, xmax)
        top = max([float(self.memory.bytes.max()) if not self.memory.empty else 0.0, float(cap or 0)]) / 2**30
        if top > 0:
            axm.set_ylim(0, top * 1.08)
        if not self.memory.empty:
            axm.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
        fig.tight_layout()
        return atomic_write_figure(path, fig, dpi=110)


def memory_steps(rank: int, deltas: list[tuple[float, int]]) -> list[tuple[int, float, int]]:
    """Turn (time, +/-bytes) allocation deltas into a step function (rank, time, bytes in use)."""
    if not deltas:
        return [(rank, 0.0, 0)]
    d = np.array(sorted(deltas, key=lambda x: (x[0], x[1])), dtype=np.float64)
    times, inc = d[:, 0], d[:, 1]
    level = np.cumsum(inc)
    # keep the last level at each time (frees at the same instant as allocs net out)
    keep = np.append(times[1:] != times[:-1], True)
    return [(rank, 0.0, 0)] + [(rank, float(t), int(b)) for t, b in zip(times[keep], level[keep])]
