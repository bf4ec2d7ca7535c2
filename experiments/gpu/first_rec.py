"""How much longer a backward pack's first recompute runs than its later ones, from run traces.

    python -m experiments.gpu.first_rec TRACE.json ...

For each trace (the Chrome trace a run writes with ``trace_path``, rank 0): the step's length,
and over the backward packs with more than one microbatch the sum of (first recompute - the
shortest later one), the time the first microbatch of each pack loses (experiments/README.md).
"""
from __future__ import annotations

import sys
from collections import defaultdict

from harmony_opt.errors import HarmonyOptError, UsageError
from harmony_opt.io import read_json


def first_rec_excess(trace: dict) -> dict:
    ev = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    if not ev:
        raise UsageError("no timed events: give the Chrome trace a traced run wrote (trace_path)")
    recs = defaultdict(list)
    for e in sorted(ev, key=lambda e: e["ts"]):
        if e["name"].startswith("REC"):
            recs[e["name"]].append(e["dur"] / 1e3)
    multi = [v for v in recs.values() if len(v) > 1]
    span = (max(e["ts"] + e["dur"] for e in ev) - min(e["ts"] for e in ev)) / 1e3
    return {"step_ms": span, "packs": len(multi), "excess_ms": sum(v[0] - min(v[1:]) for v in multi),
            "later_rec_ms": sum(sum(v[1:]) for v in multi)}


def main(paths: list[str]) -> int:
    try:
        for p in paths:
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
