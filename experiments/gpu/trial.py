"""One training run, alone in its process, so that its memory cap and peak are its own.

::

    python -m experiments.gpu.trial '{"method": "ours", "model": "gpt2-xl", "plan": "p.json", ...}' out.json

The job is a JSON object: ``method`` (a plan method, or ``torch-offload`` / ``deepspeed``),
``model``, ``overrides``, ``batch``, ``cap`` (bytes; the CUDA allocator is limited to it
with ``torch.cuda.set_per_process_memory_fraction``), ``plan`` (plan methods),
``microbatch`` and ``budget_s`` (the others: fewer steps once the measured ones took
``budget_s``), ``warmup``, ``steps``, ``device``. The result JSON holds the
median and mean step time over the measured steps, samples/s, the allocator's peak, bytes
moved per step, the first and last loss, or the error that stopped the run.
"""
from __future__ import annotations

import hashlib
import io
import itertools
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from harmony_opt.core.io import atomic_write_bytes, atomic_write_json


def _tensors(layer):
    return itertools.chain(layer.named_parameters(), layer.named_buffers())


def busy_by_stream(timeline) -> dict[str, float]:
    """Seconds each stream is busy in a Timeline (rank 0), the host link's two directions summed over
    their streams: what the simulator and the measurement are compared by."""
    from harmony_opt.sim.timeline import D2H_STREAMS, H2D_STREAMS

    def busy(streams):
        return float(sum(timeline.busy_time(s).get(0, 0.0) for s in streams))
    return {"compute": busy(["compute"]), "cpu": busy(["cpu"]), "h2d": busy(H2D_STREAMS), "d2h": busy(D2H_STREAMS)}


#: what each event is, by stream and kind, in both a simulated and a measured Timeline (the
#: simulator names a GPU step GPU_UPD, the executor UPD; the executor times a backward pack's
#: recompute apart, REC, the simulator within BWD)
KINDS = {"FWD": "forward", "REC": "backward", "BWD": "backward", "UPD": "GPU step", "GPU_UPD": "GPU step"}
WEIGHTS = ("W", "B", "K", "WK", "dW")


def kind_of(stream: str, kind: str) -> str:
    """The kind of work an event is, for ``busy_by_kind``: compute by phase, steps by device,
    transfers by direction and whether they carry weights (with their state and gradients)."""
    if stream == "cpu":
        return "CPU step"
    if stream == "compute":
        return KINDS.get(kind, kind)
    way = "in" if stream.startswith("swap_in") else "out"
    return f"{'weights' if kind in WEIGHTS else 'activations'} {way}"


def busy_by_kind(events) -> dict[str, float]:
    """Seconds of events of each kind (``kind_of``) on rank 0, from a Timeline's event table."""
    ev = events[events["rank"] == 0]
    kinds = [kind_of(s, k) for s, k in zip(ev["stream"], ev["kind"])]
    return {str(k): float(v) for k, v in (ev["end"] - ev["start"]).groupby(kinds).sum().items()}


def build_cached(name: str, overrides: dict, cache: Path | None = None):
    """``build_model(name, **overrides)``, with the initial weights kept in ``cache`` (default: the
    system's temporary folder) after the first build: GPT-2 XL's initialisation takes about 30 s
    on the CPU, loading its 6 GB back a few, and every method's run starts from the same weights."""
    import torch

    from harmony_opt.measure.models import build_model

    key = hashlib.sha256(json.dumps([name, overrides], sort_keys=True).encode()).hexdigest()[:16]
    path = (cache or Path(tempfile.gettempdir()) / "harmony-opt-models") / f"{name}-{key}.pt"
    if path.exists():
        model = build_model(name, device="meta", **overrides)
        saved = torch.load(path, mmap=True, weights_only=True)
        for layer, tensors in zip(model.layers, saved):
            layer.to_empty(device="cpu")
            with torch.no_grad():
                for n, t in _tensors(layer):
                    t.copy_(tensors[n])
        return model
    model = build_model(name, **overrides)
    buf = io.BytesIO()
    torch.save([{n: t.detach() for n, t in _tensors(layer)} for layer in model.layers], buf)
    atomic_write_bytes(path, buf.getvalue())
    return model


def run(job: dict) -> dict:
    import torch

    from harmony_opt.training import batch_seed

    device = torch.device(job["device"])
    if device.type == "cuda":       # precision: torch's defaults, under which the profiles were measured
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, job["cap"] / total))
    t0 = time.perf_counter()
    model = build_cached(job["model"], job.get("overrides", {}))
    optimizer = model.meta.get("optimizer", "adam")
    lr = 1e-4 if optimizer == "adam" else 1e-3
    n = job["warmup"] + job["steps"]
    out = {"build_s": time.perf_counter() - t0}
    if job["method"] in ("torch-offload", "deepspeed"):
        from .native import train_deepspeed, train_torch_offload

        batches = [model.make_batch(job["batch"], torch.Generator().manual_seed(batch_seed(0, s))) for s in range(n)]
        if device.type == "cuda":
            batches = [(x.pin_memory(), y.pin_memory()) for x, y in batches]
        fn = train_torch_offload if job["method"] == "torch-offload" else train_deepspeed
        res = fn(model, batches, job["microbatch"], device, optimizer, lr, warmup=job["warmup"],
                 budget_s=job.get("budget_s", float("inf")))
        times, losses = res["times"], res["losses"]
        h2d, d2h = res["bytes_h2d"] / len(times), res["bytes_d2h"] / len(times)
    else:
        from harmony_opt.core.plan import Plan
        from harmony_opt.training import train

        plan = Plan.load(job["plan"])
        # the CUDA allocator enforces the cap; the executor's guard (live tensors against the plan's
        # model of memory) is off here so that a run shows what the real allocator needed
        res = train(model, plan, steps=n, device=device.type, memory_cap=2 ** 62, progress=False,
                    optimizer=optimizer, lr=lr, trace=True)
        out["live_tensor_peak"] = res.peak_device_bytes[0]
        last_step = res.timeline()
        out["busy_last_step"] = busy_by_stream(last_step)
        if job.get("trace_path"):
            last_step.to_chrome_trace(job["trace_path"])
        times, losses = res.iteration_times, res.losses
        h2d = res.bytes_moved[0]["h2d"] / n
        d2h = res.bytes_moved[0]["d2h"] / n
    measured = times[job["warmup"]:]
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    reserved = torch.cuda.max_memory_reserved() if device.type == "cuda" else None
    out.update(step_s_median=statistics.median(measured), step_s_mean=statistics.fmean(measured),
               step_s_min=min(measured), step_s_max=max(measured), steps_measured=len(measured),
               samples_per_s=job["batch"] / statistics.fmean(measured), peak_allocated=peak, peak_reserved=reserved,
               bytes_h2d_per_step=h2d, bytes_d2h_per_step=d2h, loss_first=losses[0], loss_last=losses[-1],
               warmup_s=sum(times[:job["warmup"]]))
    return out


def main(argv: list[str]) -> int:
    job, path = json.loads(argv[0]), argv[1]
    try:
        result = {"ok": True, **run(job)}
    except Exception as e:   # noqa: BLE001 - the parent records any failure of the run as its result
        result = {"ok": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:500],
                  "traceback": traceback.format_exc()[-3000:]}
    atomic_write_json(path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
