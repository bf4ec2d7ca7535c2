"""How much longer a backward pack's first recompute runs than its later ones, from run traces.

    python -m experiments.gpu.first_rec TRACE.json ...
    python -m experiments.gpu.first_rec --host HOST.json ...

For each trace (the Chrome trace a run writes with ``trace_path``, rank 0): the step's length,
and over the backward packs with more than one microbatch the sum of (first recompute - the
shortest later one), the time the first microbatch of each pack loses (experiments/README.md).
With ``--host``: the same sums over the host time of each recompute's handler, the time the
host took to launch its kernels (rows ``[step, layers, microbatch, ms]`` that
``first_rec.sh launch`` writes), in the last step.
"""
from __future__ import annotations

import sys
from collections import defaultdict

from harmony_opt.core.errors import HarmonyOptError, UsageError
from harmony_opt.core.io import read_json


def first_rec_excess(trace: dict) -> dict:
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    if not ev:
        raise UsageError("no timed events: give the Chrome trace a traced run wrote (trace_path)")
    recs = defaultdict(list)
    for e in sorted(ev, key=lambda e: e["ts"]):
        if e["name"].startswith("REC"):
            recs[e["name"]].append(e["dur"] / 1e3)
    span = (max(e["ts"] + e["dur"] for e in ev) - min(e["ts"] for e in ev)) / 1e3
    return {"step_ms": span, **_excess(recs)}


def _excess(recs: dict) -> dict:
    multi = [v for v in recs.values() if len(v) > 1]
    return {"packs": len(multi), "excess_ms": sum(v[0] - min(v[1:]) for v in multi),
            "later_rec_ms": sum(sum(v[1:]) for v in multi)}


def host_excess(rows: list) -> dict:
    """``first_rec_excess`` over the host time of the recompute handlers of the last step."""
    try:
        last = max(r[0] for r in rows)
        recs = defaultdict(list)
        for step, layers, mb, ms in sorted(rows, key=lambda r: (r[0], str(r[1]), r[2])):
            if step == last:
                recs[str(layers)].append(float(ms))
    except (TypeError, ValueError, IndexError):
        raise UsageError("no host times: give the [step, layers, microbatch, ms] rows first_rec.sh launch "
                         "writes") from None
    return _excess(recs)


def main(args: list[str]) -> int:
    host = bool(args) and args[0] == "--host"
    try:
        if not args[host:]:
            raise UsageError("give the traces to read (TRACE.json ...), or --host HOST.json ...")
        for p in args[host:]:
            if host:
                rows = read_json(p, "host times", UsageError, "give the rows first_rec.sh launch writes")
                try:
                    r = host_excess(rows if isinstance(rows, list) and rows else [None])
                except UsageError as e:
                    raise UsageError(f"{p}: {e}") from None
                print(f"{p}: host time of the first recompute over the later ones {r['excess_ms']:.1f} ms over "
                      f"{r['packs']} packs (later ones {r['later_rec_ms']:.1f} ms)")
                continue
            trace = read_json(p, "trace", UsageError, "give the Chrome trace a traced run wrote (trace_path)")
            try:
                r = first_rec_excess(trace if isinstance(trace, dict) else {})
            except UsageError as e:
                raise UsageError(f"{p}: {e}") from None
            print(f"{p}: step {r['step_ms']:.1f} ms, first recompute over the later ones {r['excess_ms']:.1f} ms "
                  f"over {r['packs']} packs")
    except HarmonyOptError as e:
        print(f"python -m experiments.gpu.first_rec: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
