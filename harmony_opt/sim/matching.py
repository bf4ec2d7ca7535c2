"""How an event of a measured step (the runtime's Tracer) and one of a simulated step name the same work.

The executor times each instruction of its Program; the simulator times the tasks of the plan. Both
name an event by rank, stream, kind, pack and microbatch, in their own vocabularies; :func:`work_of`
maps either to one kind of work and :func:`event_key` to a key both sides share. Calibration matches
events by this key; the simulator times the Program's memory on its own events with it.
"""
from __future__ import annotations

from .timeline import D2H_STREAMS, H2D_STREAMS, P2P_STREAMS

#: Kinds of work, in the order tables list them.
WORK = ("forward", "backward", "GPU step", "CPU step", "weights in", "activations in", "weights out",
        "activations out", "all-reduce", "GPU to GPU")

#: Compute-stream kinds of both timelines: the executor's instruction kinds (runtime Tracer: FWD, REC,
#: BWD, UPD, ALL_REDUCE) and the simulator's (FWD, REC and BWD where dY comes from another rank, else
#: BWD with its recompute inside, GPU_UPD).
COMPUTE_KINDS = {"FWD": "forward", "REC": "backward", "BWD": "backward", "UPD": "GPU step", "GPU_UPD": "GPU step",
                 "ALL_REDUCE": "all-reduce"}
#: Transfer kinds that move a pack's weights, buffers, optimizer state or gradients (the rest: activations).
WEIGHT_TENSORS = frozenset({"W", "B", "K", "WK", "dW"})
#: Kinds of work done once per pack, not per microbatch (the executor writes microbatch -1, the simulator 0).
WHOLE_PACK = frozenset({"GPU step", "CPU step", "weights in", "weights out", "all-reduce"})
#: Kinds of work whose events are matched per microbatch only: the simulator names an activation copy by
#: the task it serves, the executor by the layer whose tensor it is.
ANY_PACK = frozenset({"activations in", "activations out", "GPU to GPU"})


def work_of(stream: str, kind: str) -> str | None:
    """The kind of work (one of WORK) an event of either timeline is; None for what is neither."""
    if stream.lower() == "cpu":
        return "CPU step"
    if stream == "compute":
        return COMPUTE_KINDS.get(kind)
    if stream in H2D_STREAMS:
        return "weights in" if kind in WEIGHT_TENSORS else "activations in"
    if stream in D2H_STREAMS:
        return "weights out" if kind in WEIGHT_TENSORS else "activations out"
    if stream in P2P_STREAMS:
        return "all-reduce" if kind == "ARD" else "GPU to GPU"
    return None


def anchors(plan) -> dict[str, dict[int, str]]:
    """Layer -> the label of the plan's pack that holds it, forward and backward: the executor may run
    a forward pack as sub-packs (to stash an input inside it), the simulator names the whole pack."""
    if plan is None:
        return {}
    out = {}
    for work, packs in (("forward", plan.packs_fwd), ("backward", plan.packs_bwd)):
        out[work] = {l: f"{a}-{b}" for a, b in packs for l in range(a, b + 1)}
    return out


def event_key(rank: int, work: str, pack: str, mb: int, labels: dict) -> tuple:
    """(rank, work, pack, microbatch) under which both timelines file an event; ``labels`` from
    :func:`anchors`."""
    if work in ANY_PACK:
        pack = "*"
    elif work in labels:
        try:
            pack = labels[work].get(int(str(pack).split("-")[0]), pack)
        except ValueError:
            pass
    return int(rank), work, str(pack), -1 if work in WHOLE_PACK else int(mb)
