"""The memory a simulated step reports: its compiled Program's live device bytes, timed on the
simulated events (what the executor's guard counts and its trace records)."""
from __future__ import annotations

from collections import defaultdict

from ..compile.program import Kind, Stream, effects, trace_name
from ..compile.program_memory import ProgramMemory, compiled_memory
from ..core.kinds import Tensor
from ..core.plan import Plan
from ..core.profile import Profile
from .matching import anchors, event_key, work_of

#: The kinds of work whose simulated events set the clock of the program's memory.
_CLOCKS = frozenset({"forward", "backward", "GPU step", "all-reduce", "weights in"})


def timed_program_memory(plan: Plan, profile: Profile, events, cap: int | None = None
                         ) -> tuple[ProgramMemory, list[tuple[int, float, int]]]:
    """The program's memory (:func:`~harmony_opt.compile.program_memory.program_memory`) and its live
    device bytes over a simulated step: rows (rank, time, bytes) for a Timeline's ``memory``.

    The changes keep the program's issue order (the order the allocator and the guard see them), on a
    clock taken from the simulated events. An instruction that does the work of one
    (:func:`~harmony_opt.sim.matching.event_key`: a pack's compute, the copy in of its weights; the
    k-th instruction of a key at its k-th event, the last one where the program splits a task) is at
    that event's start; a FREE, where the last timed instruction of its stream ends (what the caching
    allocator waits for); the rest (copies out, activation copies and buffers, which the two sides
    split and name differently, a CPU step), with the instruction before. None is before the one
    before. Every change is a row, several at one instant included, so the rows reach the replay's
    peaks (:func:`~harmony_opt.compile.program_memory.program_memory`)."""
    mem, drafts, sizes = compiled_memory(plan, profile, cap)
    labels = anchors(plan)
    spans: dict[tuple, list[tuple[float, float]]] = defaultdict(list)
    order = events.sort_values(["start", "end"], kind="stable")
    for r, s, k, p, m, a, b in zip(order["rank"], order["stream"], order["kind"], order["pack"],
                                   order["microbatch"], order["start"], order["end"]):
        w = work_of(str(s), str(k))
        if w in _CLOCKS:
            spans[event_key(r, w, p, m, labels)].append((float(a), float(b)))
    rows = []
    for r, instrs in enumerate(drafts):
        used: dict[tuple, int] = defaultdict(int)
        t, ended = 0.0, defaultdict(float)       # the clock; per stream, its last timed instruction's end
        live, held = 0, {}
        rows.append((r, 0.0, 0))
        for x in instrs:
            if x.kind is Kind.FREE:
                t = max(t, ended[x.stream])
            elif x.stream is not Stream.CPU and (x.kind is not Kind.SWAP_IN or x.tensor is Tensor.W):
                kind, pack, mb = trace_name(x)
                w = work_of(x.stream.value, kind)
                key = event_key(r, w, pack, mb, labels) if w in _CLOCKS else None
                if key in spans:
                    a, b = spans[key][min(used[key], len(spans[key]) - 1)]
                    used[key] += 1
                    t = max(t, a)
                    ended[x.stream] = max(ended[x.stream], b)
            e = effects(x, plan.num_layers)
            for key in e.allocs:
                held[key] = sizes.alloc_bytes(x, key)
                live += held[key]
            if e.allocs:
                rows.append((r, t, live))
            gone = sum(held.pop(key) for key in e.frees if key in held)
            if gone:
                live -= gone
                rows.append((r, t, live))
    return mem, rows
