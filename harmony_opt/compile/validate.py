"""Validation of a Program: its structure, its messages between ranks, its data flow and its
memory, and a replay of its streams that finds deadlocks; a failure names the instruction and
shows the rank's schedule around it (``format_schedule``)."""
from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict

from ..core.errors import ProgramError
from ..core.kinds import Tensor
from .program import (ALLOWED_STREAMS, ALLOWED_TENSORS, CHANNELS, INITIAL_HOST, ROW_TENSORS, Instr, Key, Kind,
                      LayerBytes, Program, channel, effects, replay_memory)


@dataclasses.dataclass(frozen=True)
class ProgramStats:
    """What the validator inferred: counts, peak device bytes (None when sizes are unknown), replay steps."""

    instructions: tuple[int, ...]
    counts: tuple[Counter, ...]
    peak_bytes: tuple[int, ...] | None
    bytes_moved: dict
    replay_rounds: int


def format_schedule(program: Program, rank: int, index: int, context: int = 6) -> str:
    """The instructions of ``rank`` around ``index``, with ``<-- ERROR HERE`` on it."""
    ins = program.ranks[rank]
    lo, hi = max(0, index - context), min(len(ins), index + context + 1)
    lines = [f"rank {rank}, instructions {lo}..{hi - 1} of {len(ins)}:"]
    for i in range(lo, hi):
        lines.append(f"  {i:5d}  {ins[i]}" + ("   <-- ERROR HERE" if i == index else ""))
    return "\n".join(lines)


def _fail(program: Program, rank: int, index: int, message: str):
    raise ProgramError(f"rank {rank}: instruction {program.ranks[rank][index]}: {message}\n"
                       + format_schedule(program, rank, index))


def validate_program(program: Program, cap_bytes: int | None = None, sizes: LayerBytes | None = None) -> ProgramStats:
    """Check a Program without running it; raise ProgramError naming the first bad instruction.

    Checks, in order: structure (ids, streams, fields, ``waits_on`` pointing backwards);
    messages (each SEND has one RECV with the same tag, peer and size, in the same
    order on its channel; all-reduces line up across ranks); dataflow (every device
    tensor is allocated before it is read and by an instruction the reader waits for,
    directly, through other waits or through stream order; frees and in-place updates
    come after every use; host rows are written before they are read); memory (with
    ``sizes`` or the program's own layer bytes: live device bytes in issue order never
    exceed ``cap_bytes``); and progress (a replay under GPU stream semantics, with
    rendezvous sends and collective all-reduces, and under in-order CPU semantics,
    must finish: otherwise the ranks deadlock).
    """
    sizes = sizes or program.layer_bytes
    if sizes is not None and sizes.num_layers != program.num_layers:
        raise ProgramError(f"layer bytes describe {sizes.num_layers} layers but the program has {program.num_layers}")
    index = [_check_structure(program, r) for r in range(program.gpus)]
    queues = [_queues(program, r) for r in range(program.gpus)]
    partner = _check_messages(program)
    for r in range(program.gpus):
        _check_dataflow(program, r, index[r], queues[r])
    peaks = tuple(_check_memory(program, r, sizes, cap_bytes) for r in range(program.gpus)) if sizes else None
    rounds = _replay_streams(program, index, queues, partner)
    _replay_in_order(program, index, partner)
    moved = Counter()
    for ins in program.ranks:
        for i in ins:
            if i.kind in (Kind.SWAP_IN, Kind.SWAP_OUT, Kind.SEND):
                moved[i.stream.value] += i.bytes
    return ProgramStats(instructions=tuple(len(x) for x in program.ranks),
                        counts=tuple(program.counts(r) for r in range(program.gpus)),
                        peak_bytes=peaks, bytes_moved=dict(moved), replay_rounds=rounds)


def _check_structure(program: Program, r: int) -> dict[int, int]:
    """Ids unique, waits pointing to earlier instructions, fields consistent; returns id -> index."""
    pos: dict[int, int] = {}
    R, S = program.num_layers, program.samples[r]
    for i, ins in enumerate(program.ranks[r]):
        if ins.id in pos:
            _fail(program, r, i, f"id {ins.id} is used twice")
        for w in ins.waits_on:
            if w not in pos:
                _fail(program, r, i, f"waits on {w}, which is not an earlier instruction of rank {r}")
        pos[ins.id] = i
        a, b = ins.layers
        if not 0 <= a <= b < R:
            _fail(program, r, i, f"layers [{a}, {b}] are outside the model's {R} layers")
        if ins.kind is Kind.FWD and b >= R - 1:
            _fail(program, r, i, "a forward sub-pack cannot contain the loss layer (it runs as the recompute)")
        if ins.stream not in ALLOWED_STREAMS[ins.kind]:
            _fail(program, r, i, f"{ins.kind.name} cannot run on stream {ins.stream.value}")
        if ins.tensor not in ALLOWED_TENSORS[ins.kind]:
            _fail(program, r, i, f"{ins.kind.name} cannot carry tensor {ins.tensor and ins.tensor.value}")
        needs_rows = ins.kind in (Kind.FWD, Kind.REC, Kind.BWD) or ins.tensor in ROW_TENSORS
        if needs_rows:
            if ins.offset is None or ins.size is None or ins.mb is None:
                _fail(program, r, i, "needs a microbatch (index, first sample, size)")
            if ins.size < 1 or ins.offset + ins.size > S:
                _fail(program, r, i, f"samples {ins.offset}..{ins.offset + ins.size - 1} are outside the rank's "
                                     f"{S} samples")
        if (ins.kind in (Kind.SEND, Kind.RECV)) != (ins.peer is not None and ins.tag is not None):
            _fail(program, r, i, "a send or receive needs a peer and a tag; nothing else has them")
        if ins.peer is not None and not (0 <= ins.peer < program.gpus and ins.peer != r):
            _fail(program, r, i, f"peer {ins.peer} is not another rank of the {program.gpus}")
    return pos


def _queue_of(ins: Instr, r: int):
    """The FIFO an instruction waits in: its stream, or for messages its channel."""
    return ("p2p",) + channel(ins, r) if ins.kind in (Kind.SEND, Kind.RECV) else (ins.stream.value,)


def _queues(program: Program, r: int) -> dict:
    q = defaultdict(list)
    for i, ins in enumerate(program.ranks[r]):
        q[_queue_of(ins, r)].append(i)
    return dict(q)


def _check_messages(program: Program) -> dict:
    """Pair every SEND with its RECV; returns (rank, index) -> (rank, index) both ways."""
    sends, recvs = {}, {}
    for r, ins in enumerate(program.ranks):
        for i, x in enumerate(ins):
            if x.kind in (Kind.SEND, Kind.RECV):
                table = sends if x.kind is Kind.SEND else recvs
                if x.tag in table:
                    _fail(program, r, i, f"message tag {x.tag} is used by another {x.kind.name} too")
                table[x.tag] = (r, i)
    partner = {}
    for tag, (r, i) in sends.items():
        s = program.ranks[r][i]
        if tag not in recvs:
            _fail(program, r, i, f"send to rank {s.peer} (tag {tag}) has no matching receive")
        q, j = recvs[tag]
        v = program.ranks[q][j]
        if q != s.peer or v.peer != r:
            _fail(program, r, i, f"send to rank {s.peer} is received by rank {q} from rank {v.peer}")
        if CHANNELS[s.tensor] != CHANNELS[v.tensor] or (s.tensor is Tensor.DX) != (v.tensor is Tensor.DY):
            _fail(program, r, i, f"sends {s.tensor.value} but rank {q} receives {v.tensor.value}")
        if (s.layers, s.size) != (v.layers, v.size):
            _fail(program, r, i, f"sends layers {s.layers} x {s.size} samples but rank {q} receives "
                                 f"{v.layers} x {v.size}")
        partner[(r, i)], partner[(q, j)] = (q, j), (r, i)
    for tag, (q, j) in recvs.items():
        if tag not in sends:
            _fail(program, q, j, f"receive from rank {program.ranks[q][j].peer} (tag {tag}) has no matching send")
    order = defaultdict(list)
    for r, ins in enumerate(program.ranks):
        for i, x in enumerate(ins):
            if x.kind in (Kind.SEND, Kind.RECV):
                order[(x.kind, channel(x, r))].append((x.tag, r, i))
    for (kind, ch), seq in order.items():
        if kind is not Kind.SEND:
            continue
        got = order.get((Kind.RECV, ch), [])
        for (ts, r, i), (tr, q, j) in zip(seq, got):
            if ts != tr:
                _fail(program, q, j, f"receives tag {tr} where rank {r} sends tag {ts} on channel {ch}: "
                                     f"sends and receives must be in the same order")
    reduces = [[x.layers for x in ins if x.kind is Kind.ALL_REDUCE] for ins in program.ranks]
    for r, red in enumerate(reduces):
        if red != reduces[0]:
            idx = next(i for i, x in enumerate(program.ranks[r]) if x.kind is Kind.ALL_REDUCE) \
                if red else max(len(program.ranks[r]) - 1, 0)
            if not program.ranks[r]:
                raise ProgramError(f"rank {r} has no instructions but rank 0 all-reduces {reduces[0]}")
            _fail(program, r, idx, f"all-reduces {red} but rank 0 all-reduces {reduces[0]}: collectives must "
                                   f"line up on every rank")
    return partner


def _ancestors(program: Program, r: int, pos: dict, queues: dict) -> list[int]:
    """Happens-before per instruction as a bitset: waits_on plus the previous instruction of its queue."""
    ins = program.ranks[r]
    prev = {}
    for q in queues.values():
        for a, b in zip(q, q[1:]):
            prev[b] = a
    anc = [0] * len(ins)
    for i, x in enumerate(ins):
        deps = [pos[w] for w in x.waits_on] + ([prev[i]] if i in prev else [])
        acc = 0
        for d in deps:
            acc |= anc[d] | (1 << d)
        anc[i] = acc
    return anc


def _check_dataflow(program: Program, r: int, pos: dict, queues: dict) -> None:
    """Device tensors exist before use and are ordered with every other use; host rows exist before read."""
    anc = _ancestors(program, r, pos, queues)
    R = program.num_layers
    writer: dict = {}
    readers: dict = defaultdict(list)
    host_writes: dict = defaultdict(list)

    def ordered(i, j, what):
        if not anc[i] >> j & 1:
            _fail(program, r, i, f"{what} {program.ranks[r][j]} without waiting for it (directly, through another "
                                 f"wait or through stream order): it may run before that completes")

    for i, x in enumerate(program.ranks[r]):
        e = effects(x, R)
        for k in e.reads + e.updates + e.frees:
            if k not in writer:
                verb = "frees" if k in e.frees else "uses"
                _fail(program, r, i, f"{verb} device tensor {_key_str(k)} before it arrives (or after it was freed)")
            ordered(i, writer[k], f"uses {_key_str(k)} made by")
        for k in e.reads:
            readers[k].append(i)
        for k in e.updates + e.frees:
            for j in readers[k]:
                ordered(i, j, f"changes {_key_str(k)} still read by")
            readers[k] = []
        for k in e.updates:
            writer[k] = i
        for k in e.frees:
            del writer[k]
        for k in e.allocs:
            if k in writer:
                _fail(program, r, i, f"allocates device tensor {_key_str(k)}, which is already there "
                                     f"(made by {program.ranks[r][writer[k]]})")
            writer[k] = i
        for buf, rows in e.host_reads:
            if buf[0] in INITIAL_HOST:
                continue
            need = set(range(rows[0], rows[0] + rows[1])) if rows else {None}
            for lo, n, j in host_writes[buf]:
                if anc[i] >> j & 1:
                    need -= set(range(lo, lo + n)) if lo is not None else {None}
            if need:
                missing = "it" if None in need else f"samples {min(need)}..{max(need)}"
                _fail(program, r, i, f"reads host buffer {'/'.join(map(str, buf))} but {missing} "
                                     f"were not written by an instruction it waits for")
        for buf, rows in e.host_writes:
            host_writes[buf].append((rows[0], rows[1], i) if rows else (None, None, i))


def _key_str(k: Key) -> str:
    if k[0] in ("W", "B", "K", "dW"):
        return f"{k[0]}[{k[1]}]"
    if k[0] == "G":
        return f"sA[{k[1]}-{k[2]}]({k[3]}+{k[4]})"
    if k[0] == "T":
        return f"T({k[1]}+{k[2]})"
    return f"{k[0]}[{k[1]}]({k[2]}+{k[3]})"


def _check_memory(program: Program, r: int, sizes: LayerBytes, cap: int | None) -> int:
    """:func:`replay_memory` of rank ``r``, failing on the first instruction over the cap; returns the peak."""
    peak, over = replay_memory(program.ranks[r], program.num_layers, sizes, cap)
    if over is not None:
        _fail(program, r, over[0], f"would hold {over[1]} bytes on the device, over the cap of {cap} bytes")
    return peak


def _replay_streams(program: Program, index: list[dict], queues: list[dict], partner: dict) -> int:
    """Play the ranks under GPU semantics: FIFO streams and channels, events, rendezvous, collectives."""
    done = [[False] * len(x) for x in program.ranks]
    heads = [{q: 0 for q in qs} for qs in queues]
    reduces = [[i for i, x in enumerate(ins) if x.kind is Kind.ALL_REDUCE] for ins in program.ranks]

    def head(r, i):
        q = _queue_of(program.ranks[r][i], r)
        return queues[r][q][heads[r][q]] == i if heads[r][q] < len(queues[r][q]) else False

    def ready(r, i):
        return head(r, i) and all(done[r][index[r][w]] for w in program.ranks[r][i].waits_on)

    def finish(r, i):
        done[r][i] = True
        heads[r][_queue_of(program.ranks[r][i], r)] += 1

    remaining, rounds = sum(len(x) for x in program.ranks), 0
    while remaining:
        rounds += 1
        progress = False
        for r in range(program.gpus):
            for q, items in queues[r].items():
                while heads[r][q] < len(items):
                    i = items[heads[r][q]]
                    x = program.ranks[r][i]
                    if not ready(r, i):
                        break
                    if x.kind in (Kind.SEND, Kind.RECV):
                        pr, pi = partner[(r, i)]
                        if not ready(pr, pi):
                            break
                        finish(pr, pi)
                        remaining -= 1
                    elif x.kind is Kind.ALL_REDUCE:
                        k = reduces[r].index(i)
                        if not all(ready(s, reduces[s][k]) for s in range(program.gpus)):
                            break
                        for s in range(program.gpus):
                            if s != r:
                                finish(s, reduces[s][k])
                        remaining -= program.gpus - 1
                    finish(r, i)
                    remaining -= 1
                    progress = True
        if not progress:
            _deadlock(program, done, "on the GPU streams")
    return rounds


def _replay_in_order(program: Program, index: list[dict], partner: dict) -> None:
    """Play the ranks as the CPU executor runs them: one instruction at a time, in list order.

    Sends and updates do not block; an instruction waits for its ``waits_on``, and a
    receive is complete once its send has been issued; all-reduces block until every
    rank reaches them.
    """
    issued = [[False] * len(x) for x in program.ranks]
    cursor = [0] * program.gpus

    def complete(r, i):
        x = program.ranks[r][i]
        if not issued[r][i]:
            return False
        if x.kind is Kind.RECV:
            pr, pi = partner[(r, i)]
            return issued[pr][pi]
        return True

    def can_issue(r):
        i = cursor[r]
        x = program.ranks[r][i]
        return all(complete(r, index[r][w]) for w in x.waits_on)

    total = sum(len(x) for x in program.ranks)
    while sum(cursor) < total:
        progress = False
        for r in range(program.gpus):
            while cursor[r] < len(program.ranks[r]) and can_issue(r):
                x = program.ranks[r][cursor[r]]
                if x.kind is Kind.ALL_REDUCE:
                    k = sum(1 for y in program.ranks[r][:cursor[r]] if y.kind is Kind.ALL_REDUCE)
                    peers = [_nth_reduce(program, s, k) for s in range(program.gpus)]
                    if not all(p == cursor[s] and can_issue(s) for s, p in enumerate(peers)):
                        break
                    for s in range(program.gpus):
                        issued[s][cursor[s]] = True
                        cursor[s] += 1
                    progress = True
                    break
                issued[r][cursor[r]] = True
                cursor[r] += 1
                progress = True
        if not progress:
            _deadlock(program, [[issued[r][i] for i in range(len(x))] for r, x in enumerate(program.ranks)],
                      "when run in order (the CPU executor)")


def _nth_reduce(program: Program, r: int, k: int) -> int:
    return [i for i, x in enumerate(program.ranks[r]) if x.kind is Kind.ALL_REDUCE][k]


def _deadlock(program: Program, done: list[list[bool]], how: str):
    stuck = []
    for r, d in enumerate(done):
        first = next((i for i, ok in enumerate(d) if not ok), None)
        if first is not None:
            stuck.append((r, first))
    detail = "; ".join(f"rank {r} stuck at {program.ranks[r][i]}" for r, i in stuck)
    r, i = stuck[0]
    raise ProgramError(f"the ranks deadlock {how}: {detail}\n" + "\n".join(
        format_schedule(program, s, j, 3) for s, j in stuck))
