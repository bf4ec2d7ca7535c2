"""The probed hardware terms against a traced run on the CPU.

::

    OMP_NUM_THREADS=1 python benchmarks/bench_probe_terms.py [--hardware probed.toml] [--steps 3]

Profiles gpt2-tiny on the CPU (one thread), probes the machine (or loads ``--hardware``), trains a
hand-made vPP plan for a few steps with the executor's trace, and compares, instruction by
instruction of the last step:

* swaps: measured seconds against ``latency + bytes / bandwidth`` of their direction;
* CPU optimizer steps: measured against ``cpu_optimizer_call_s + sum of the pack's cpu_update_s``
  (and, as "without term", against the steps the profile held before it took the call's cost off:
  each layer's ``cpu_update_s + cpu_update_call_s``, summed), in the run ("UPD (cpu)", beside the
  compute) and alone ("UPD alone": ``PackOptimizers.step_host`` of each pack, the fastest of 5);
* compute: FWD against the profile's forward + ``issue_overhead_s``, REC + BWD of a (pack,
  microbatch) against the profile's backward + 2 x ``issue_overhead_s``.

Prints, per group, the summed measured and predicted seconds and the median ratio measured / predicted.
"""
from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

import torch


def main() -> None:
    from harmony_opt.core.hardware import Hardware
    from harmony_opt.core.plan import Plan
    from harmony_opt.measure.models import build_model
    from harmony_opt.measure.probe import probe_hardware
    from harmony_opt.measure.profiler import profile_model
    from harmony_opt.training import train

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", default=None, help="a probed hardware file (default: probe now, one thread)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--microbatch", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)

    model = build_model("gpt2-tiny")
    u, R = args.microbatch, model.num_layers
    prof = profile_model(model, [u], "cpu", repeats=5, threads=1, progress=False)
    hw = Hardware.load(args.hardware) if args.hardware else probe_hardware("cpu", threads=1)
    print(f"hardware: h2d {hw.h2d_latency_s * 1e6:.0f} us + {hw.h2d_bandwidth / 1e9:.2f} GB/s, d2h "
          f"{hw.d2h_latency_s * 1e6:.0f} us + {hw.d2h_bandwidth / 1e9:.2f} GB/s, "
          f"call {hw.cpu_optimizer_call_s * 1e6:.0f} us, issue {hw.issue_overhead_s * 1e6:.0f} us; "
          f"profile call {prof.meta['cpu_update_call_s'] * 1e6:.0f} us")
    fwd = [(0, 1), (2, 3), (4, 5)]
    bwd = [(0, 1), (2, 3), (4, 5), (6, R - 1)]
    plan = Plan(planner="bench", mode="vPP", gpus=1, batch=args.batch, microbatch_fwd=u, microbatch_bwd=u,
                packs_fwd=fwd, packs_bwd=bwd, num_layers=R, options=(), allow_uneven=True)
    res = train(model, plan, steps=args.steps, progress=False, trace=True)
    events = res.trace[0]["events"]

    groups: dict[str, list[tuple[float, float, float]]] = defaultdict(list)   # (measured, predicted, before)
    backward: dict[tuple, float] = defaultdict(float)
    for _, stream, kind, name, layers, mb, start, end, nbytes in events:
        a, b = (int(v) for v in layers.split("-"))
        took = end - start
        if stream in ("swap_in", "swap_out"):
            lat, bw = ((hw.h2d_latency_s, hw.h2d_bandwidth) if stream == "swap_in" else
                       (hw.d2h_latency_s, hw.d2h_bandwidth))
            groups[f"{stream} {kind}"].append((took, lat + nbytes / bw, nbytes / bw))
        elif kind == "UPD":
            net = float(prof.cpu_update_time(a, b))
            gross = net + (b - a + 1) * prof.meta["cpu_update_call_s"]
            groups["UPD (cpu)"].append((took, hw.cpu_optimizer_call_s + net, gross))
        elif kind == "FWD":
            t = prof.fwd_time(a, b, u)
            groups["FWD"].append((took, t + hw.issue_overhead_s, t))
        elif kind in ("REC", "BWD"):
            backward[(a, b, mb)] += took
    for a, b in bwd:     # the same steps alone: the relation without the compute beside them
        took = _isolated_step(model, (a, b), prof.meta["optimizer"])
        net = float(prof.cpu_update_time(a, b))
        groups["UPD alone"].append((took, hw.cpu_optimizer_call_s + net,
                                    net + (b - a + 1) * prof.meta["cpu_update_call_s"]))
    for (a, b, _), took in backward.items():
        t = prof.bwd_time(a, b, u)
        groups["REC+BWD"].append((took, t + 2 * hw.issue_overhead_s, t))

    print(f"{'group':<16}{'n':>4}{'measured ms':>13}{'predicted ms':>14}{'without term':>14}"
          f"{'median meas/pred':>18}{'median meas/without':>21}")
    for g, rows in sorted(groups.items()):
        m, p, w = (sum(r[i] for r in rows) * 1e3 for i in range(3))
        ratio = statistics.median(r[0] / r[1] for r in rows)
        known = [r[0] / r[2] for r in rows if r[2] > 0]
        before = statistics.median(known) if known else float("nan")
        print(f"{g:<16}{len(rows):>4}{m:>13.2f}{p:>14.2f}{w:>14.2f}{ratio:>18.2f}{before:>21.2f}")
    print(f"iteration {res.iteration_times[-1] * 1e3:.1f} ms")


def _isolated_step(model, pack: tuple[int, int], optimizer: str, repeats: int = 5) -> float:
    """The fastest of ``repeats`` host steps of one pack's optimizer (``PackOptimizers.step_host``), alone."""
    import time

    from harmony_opt.runtime.optim import PackOptimizers, make_factory

    factory = make_factory("adam", 1e-4) if optimizer == "adam" else make_factory("sgd", 1e-3, momentum=0.9)
    optim = PackOptimizers(model.layers, [pack], factory)
    for g in optim.grads.values():
        g.fill_(1e-3)
    optim.step_host(pack)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        optim.step_host(pack)
        best = min(best, time.perf_counter() - t0)
    return best


if __name__ == "__main__":
    main()
