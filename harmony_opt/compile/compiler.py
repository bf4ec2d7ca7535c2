"""Compile a Plan into a Program: per rank, the instruction list of one iteration.

::

    program = compile_plan(plan)                                  # no byte sizes
    program = compile_plan(plan, layer_bytes=LayerBytes.from_profile(profile, u))
    validate_program(program, cap_bytes=plan.memory_cap)

The lowering is a chain of pure passes:

1. :func:`build_tasks`: Harmony's task order and placement (HARMONY_REFERENCE.md 5):
   forward packs ascending, then backward packs from the last to the first, each
   followed by its update. vPP deals the k-th forward task to rank ``k mod N`` and the
   k-th backward task to ``(nF + k) mod N``; vDP gives every rank a copy of every task.
2. :func:`stash_modes`: which backward packs keep their forward's autograd graph
   (``recompute=False``) instead of recomputing, where the runtime can do so exactly.
3. :func:`lower`: each task becomes instructions (the event expansion of 6.3, with
   prefetch): weights and buffers swapped in before a pack, the next pack's weights
   prefetched while the current one computes its last microbatches, each microbatch's
   input fetched one microbatch ahead (double buffering), the input of every backward
   pack stashed to host during the forward, activations and gradients passed between
   packs through host memory on the same rank or by send/receive across ranks (with
   ``plan.gpu_handoff``, a gradient between two single-microbatch backward packs of one rank
   stays where it is: the next pack reads the same device tensor), and,
   after each backward pack, dW swapped out and the pack's optimizer step on the CPU
   (or, with ``optimizer="gpu"``, state swapped in and the step on the device).
   Wherever producer and consumer microbatches differ (u_fwd != u_bwd), the tensor
   goes through host memory, where a microbatch is just a row range, so re-batching
   costs nothing extra. Without input-batch grouping (naive swapping) each microbatch
   sweeps the whole task list alone: every pack's weights come in once per sweep, each
   sweep's dW is added to the host gradients (its swap-out carries the sweep as ``mb``;
   sweep 0 overwrites), and the optimizer steps after the last sweep.
4. :func:`follow_order`: where the plan carries its own transfer order
   (``Plan.transfer_order``, chosen by the planner's timeline model), each rank's swap-ins and
   swap-outs are issued in it; everything else keeps its place up to what they depend on.
5. :func:`fit_swap_ins`: with layer sizes and a memory cap, each swap-in is issued only once
   its bytes fit under the cap (the simulator's rule: a swap-in starts when there is room), at
   the latest just before what reads it, so a prefetch never pushes the rank over its cap.
6. :func:`add_waits`: ids, and every instruction's ``waits_on`` derived from what it
   reads and writes (:func:`harmony_opt.compile.program.effects`), leaving out what the order
   of its own stream already implies.
7. :func:`add_bytes`: byte sizes, when layer sizes are known.
"""
from __future__ import annotations

import dataclasses
import itertools
from collections import defaultdict

import networkx as nx

from ..core.errors import PlanError
from ..core.kinds import TaskKind, Tensor
from ..core.placement import placement
from ..core.plan import Plan, in_order, transfer_key
from .program import CHANNELS, Effects, Instr, Kind, LayerBytes, Program, Stream, effects, plan_identity

I, O, S, R, F, C, B, U, A, D = (Kind.SWAP_IN, Kind.SWAP_OUT, Kind.SEND, Kind.RECV, Kind.FWD, Kind.REC, Kind.BWD,
                                Kind.UPD, Kind.ALL_REDUCE, Kind.FREE)
Rows = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Task:
    """A FWD or BWD task of Harmony's task graph (the UPD is lowered with its BWD)."""

    kind: TaskKind              # FWD or BWD
    order: int                  # position in the task order of its copy
    pack: tuple[int, int]
    rank: int
    bwd: int | None = None      # index into plan.packs_bwd


def build_tasks(plan: Plan) -> list[list[Task]]:
    """Harmony's order and placement (core.placement, the simulator's rule), the UPD tasks left out:
    one task list for vPP, one per rank (all on that rank) for vDP."""
    copy = [p for p in placement(plan) if p.kind is not TaskKind.UPD]

    def tasks(rank_of):
        return [Task(p.kind, i, p.pack, rank_of(p), p.bwd_index if p.kind is TaskKind.BWD else None)
                for i, p in enumerate(copy)]

    if plan.mode == "vPP":
        return [tasks(lambda p: p.rank)]
    return [tasks(lambda p, n=n: n) for n in range(plan.gpus)]


def microbatch_rows(plan: Plan, phase: str, rank: int) -> tuple[Rows, ...]:
    """(first sample, size) of each microbatch of a phase on a rank."""
    out, first = [], 0
    for u in plan.microbatches(phase, rank):
        out.append((first, u))
        first += u
    return tuple(out)


def stash_modes(plan: Plan, tasks: list[Task]) -> tuple[tuple[bool, ...], tuple[str, ...]]:
    """Per backward pack: keep the forward's autograd graph (True) or recompute (False).

    A pack with ``recompute=False`` keeps its graph when its layers run inside one forward
    pack on the rank of its backward pack: the graph (with its saved tensors in host
    memory) then lives in that rank's process. Otherwise it recomputes, which gives the
    same numbers, and a note says so. The loss pack always runs its forward as its
    recompute (``Plan`` sets its option so).
    """
    fwd = [t for t in tasks if t.kind is TaskKind.FWD]
    bwd_rank = {t.bwd: t.rank for t in tasks if t.kind is TaskKind.BWD}
    modes, notes = [], []
    for j, (a, b) in enumerate(plan.packs_bwd):
        if plan.options[j].recompute:
            modes.append(False)
            continue
        host = next(t for t in fwd if t.pack[0] <= a <= t.pack[1])
        ok = host.pack[1] >= b and host.rank == bwd_rank[j]
        modes.append(ok)
        if not ok:
            why = ("its layers span several forward packs" if host.pack[1] < b else
                   f"its forward pack {list(host.pack)} runs on rank {host.rank}, its backward on rank {bwd_rank[j]}")
            notes.append(f"backward pack {j} {[a, b]}: recompute off needs the pack's forward inside one forward "
                         f"pack on the rank of its backward, but {why}; it recomputes instead")
    return tuple(modes), tuple(notes)


def _ins(kind: Kind, tensor: Tensor | None, layers: tuple[int, int], stream: Stream, rows: Rows | None = None,
         mb: int | None = None, peer: int | None = None, tag: int | None = None) -> Instr:
    off, size = rows if rows else (None, None)
    return Instr(id=-1, kind=kind, layers=layers, stream=stream, tensor=tensor, mb=mb, offset=off, size=size,
                 peer=peer, tag=tag)


def _stream(kind: Kind) -> Stream:
    return {I: Stream.SWAP_IN, O: Stream.SWAP_OUT, S: Stream.P2P, R: Stream.P2P}.get(kind, Stream.COMPUTE)


def _move(kind: Kind, tensor: Tensor, layer: int, rows: Rows, mb: int, peer=None, tag=None) -> Instr:
    return _ins(kind, tensor, (layer, layer), _stream(kind), rows, mb, peer, tag)


def _free(tensor: Tensor, layers: tuple[int, int], rows: Rows | None = None, mb: int | None = None) -> Instr:
    return _ins(D, tensor, layers, Stream.COMPUTE, rows, mb)


class _Lowering:
    """Builds the per-rank drafts of one Program; used only inside :func:`lower`."""

    def __init__(self, plan: Plan, modes: tuple[bool, ...]):
        self.plan, self.modes = plan, modes
        self.R = plan.num_layers
        self.out: dict[int, list[Instr]] = defaultdict(list)
        self.tags: dict[tuple, int] = {}
        self.counter = itertools.count()
        self.all_reduce = plan.mode == "vDP" and plan.gpus > 1
        self.sweep: tuple[int, Rows, bool] | None = None    # naive swapping: (index, rows, last?)

    # -- helpers ---------------------------------------------------------------------------------
    def emit(self, rank: int, *ins: Instr) -> None:
        self.out[rank].extend(ins)

    def send(self, rank: int, tensor: Tensor, layer: int, rows: Rows, mb: int, dst: int) -> Instr:
        tag = next(self.counter)
        self.tags[(CHANNELS[tensor], layer, rows, rank, dst)] = tag
        return _move(S, tensor, layer, rows, mb, dst, tag)

    def recv(self, rank: int, tensor: Tensor, layer: int, rows: Rows, mb: int, src: int) -> Instr:
        tag = self.tags[(CHANNELS[tensor], layer, rows, src, rank)]
        return _move(R, tensor, layer, rows, mb, src, tag)

    def rows_f(self, rank: int) -> tuple[Rows, ...]:
        if self.sweep is not None:
            return (self.sweep[1],)
        return microbatch_rows(self.plan, "FWD", rank)

    def rows_b(self, rank: int, j: int) -> tuple[Rows, ...]:
        """A backward pack's microbatches: the forward's when it keeps the forward's graph."""
        if self.sweep is not None:
            return (self.sweep[1],)
        return microbatch_rows(self.plan, "FWD" if self.modes[j] else "BWD", rank)

    def kept(self, prod: Task, prod_rows: tuple[Rows, ...], cons: Task, cons_rows: tuple[Rows, ...]) -> bool:
        """Whether the tensor ``prod`` hands to ``cons`` stays on their GPU (Plan.keeps_on_gpu)."""
        return prod.rank == cons.rank and self.plan.keeps_on_gpu([n for _, n in prod_rows], [n for _, n in cons_rows])

    def shared(self, t: Task, other: Task | None) -> set[int]:
        """Layers of ``t`` that ``other`` (the neighbouring task on its rank) also runs."""
        if other is None:
            return set()
        return set(range(t.pack[0], t.pack[1] + 1)) & set(range(other.pack[0], other.pack[1] + 1))

    def weights_in(self, t: Task) -> list[Instr]:
        """Swap in W and B of ``t``'s layers, except those the previous task on the rank left there."""
        keep = self.shared(t, self.prev_on_rank[t.order])
        return [_ins(I, x, p, Stream.SWAP_IN) for p in _ranges(t.pack, keep) for x in (Tensor.W, Tensor.B)]

    def weights_out(self, t: Task) -> list[Instr]:
        """Free W and B of ``t``'s layers, except those the next task on the rank runs too (JIT pinning)."""
        keep = self.shared(t, self.next_on_rank[t.order])
        return [_free(x, p) for p in _ranges(t.pack, keep) for x in (Tensor.W, Tensor.B)]

    # -- one copy of the task list -----------------------------------------------------------------
    def run(self, tasks: list[Task], sweep: tuple[int, Rows, bool] | None = None) -> None:
        self.tasks, self.sweep = tasks, sweep
        self.fwd = [t for t in tasks if t.kind is TaskKind.FWD]
        self.bwd = {t.bwd: t for t in tasks if t.kind is TaskKind.BWD}
        self.nB = len(self.plan.packs_bwd)
        by_rank = defaultdict(list)
        for t in tasks:
            by_rank[t.rank].append(t)
        self.next_on_rank = {t.order: (lst[k + 1] if k + 1 < len(lst) else None)
                             for lst in by_rank.values() for k, t in enumerate(lst)}
        self.prev_on_rank = {t.order: (lst[k - 1] if k > 0 else None)
                             for lst in by_rank.values() for k, t in enumerate(lst)}
        self.prefetched: set[int] = set()
        self.stash_plan = self._stash_sources()
        for t in tasks:
            if t.order not in self.prefetched:
                self.emit(t.rank, *self.weights_in(t))
            (self._fwd if t.kind is TaskKind.FWD else self._bwd)(t)

    def _prefetch_next(self, t: Task) -> None:
        nxt = self.next_on_rank[t.order]
        if nxt is not None and self.plan.prefetch:
            self.emit(t.rank, *self.weights_in(nxt))
            self.prefetched.add(nxt.order)

    def _stash_sources(self) -> dict:
        """Per stash layer: (fwd task order, "in" | "out", destination rank) of the stash swap-out or send.

        The stash of backward pack j is the input of its first layer a_j. It is swapped out
        on the rank of pack j by whichever forward task holds X(a_j) there: the one that
        consumes it, or the one that produced it as its output; failing both, the consuming
        task sends it to that rank, which swaps it out.
        """
        plan_ = {}
        for j in range(self.nB - 1):
            a = self.plan.packs_bwd[j][0]
            if self.modes[j] or a == 0:
                continue
            rb = self.bwd[j].rank
            cons = next(t for t in self.fwd if t.pack[0] <= a <= t.pack[1])
            if cons.rank != rb and cons.pack[0] == a and cons.order > 0 and self.fwd[cons.order - 1].rank == rb:
                plan_[a] = (cons.order - 1, "out", rb)
            else:
                plan_[a] = (cons.order, "in", rb)
        return plan_

    def _subpacks(self, t: Task) -> list[tuple[int, int, bool]]:
        """Cut a forward pack at every stashed layer and around every pack that keeps its graph."""
        a, b = t.pack
        cuts = {a}
        for layer, (order, side, _) in self.stash_plan.items():
            if side == "in" and order == t.order:
                cuts.add(layer)
        keep = set()
        for j, (x, y) in enumerate(self.plan.packs_bwd):
            if self.modes[j] and a <= x and y <= b:
                cuts |= {x, y + 1}
                keep.add((x, y))
        cuts = sorted(c for c in cuts if a <= c <= b)
        bounds = cuts + [b + 1]
        return [(c, e - 1, (c, e - 1) in keep) for c, e in zip(bounds, bounds[1:])]

    def _stash(self, t: Task, layer: int, rows: Rows, mb: int) -> None:
        _, _, rb = self.stash_plan[layer]
        if rb == t.rank:
            self.emit(t.rank, _move(O, Tensor.SX, layer, rows, mb))
            return
        self.emit(t.rank, self.send(t.rank, Tensor.SX, layer, rows, mb, rb))
        self.emit(rb, self.recv(rb, Tensor.SX, layer, rows, mb, t.rank), _move(O, Tensor.SX, layer, rows, mb),
                  _free(Tensor.X, (layer, layer), rows, mb))

    # -- forward task ------------------------------------------------------------------------------
    def _fwd(self, t: Task) -> None:
        r, (a, b) = t.rank, t.pack
        rows = self.rows_f(r)
        prev = self.fwd[t.order - 1] if t.order > 0 else None
        nxt = self.fwd[t.order + 1] if t.order + 1 < len(self.fwd) else self.bwd[self.nB - 1]
        subs = self._subpacks(t)
        out_stash = self.stash_plan.get(b + 1)

        def fetch(i):
            if a == 0 or prev.rank == r:
                return [_move(I, Tensor.X, a, rows[i], i)]
            return [self.recv(r, Tensor.X, a, rows[i], i, prev.rank)]

        M = len(rows)
        for i, ri in enumerate(rows):
            self._ahead(t, i, M, fetch)
            for c, d, keep in subs:
                if self.stash_plan.get(c, (None, None))[:2] == (t.order, "in"):
                    self._stash(t, c, ri, i)
                self.emit(r, _ins(F, Tensor.SA if keep else None, (c, d), Stream.COMPUTE, ri, i),
                          _free(Tensor.X, (c, c), ri, i))
            if out_stash and out_stash[0] == t.order and out_stash[1] == "out":
                self.emit(r, _move(O, Tensor.SX, b + 1, ri, i))
            if nxt.rank == r:
                self.emit(r, _move(O, Tensor.Y, b + 1, ri, i))
            else:
                self.emit(r, self.send(r, Tensor.Y, b + 1, ri, i, nxt.rank))
            self.emit(r, _free(Tensor.Y, (b + 1, b + 1), ri, i))
        self.emit(r, _ins(O, Tensor.B, t.pack, Stream.SWAP_OUT), *self.weights_out(t))

    def _ahead(self, t: Task, i: int, M: int, fetch) -> None:
        """Fetch microbatch 0 first, then each next one before computing the current (double
        buffering); once the last input is on its way, prefetch the next task's weights."""
        if i == 0:
            self.emit(t.rank, *fetch(0))
            if M == 1:
                self._prefetch_next(t)
        if i + 1 < M:
            self.emit(t.rank, *fetch(i + 1))
            if i + 1 == M - 1:
                self._prefetch_next(t)

    # -- backward task -----------------------------------------------------------------------------
    def _rebatched(self, r: int, tensor: Tensor, layer: int, want: Rows, mb: int, src: int,
                   src_rows: tuple[Rows, ...], done: list[int]) -> list[Instr]:
        """Receive the producer's microbatches that ``want`` needs, park them in host rows, swap ``want`` in."""
        out = []
        end = want[0] + want[1]
        while done[0] < len(src_rows) and src_rows[done[0]][0] < end:
            k = done[0]
            out += [self.recv(r, tensor, layer, src_rows[k], k, src), _move(O, tensor, layer, src_rows[k], k),
                    _free(tensor if tensor is Tensor.DY else Tensor.X, (layer, layer), src_rows[k], k)]
            done[0] += 1
        return out + [_move(I, tensor, layer, want, mb)]

    def _bwd(self, t: Task) -> None:
        r, (a, b), j = t.rank, t.pack, t.bwd
        crit, keep = j == self.nB - 1, self.modes[j]
        rows = self.rows_b(r, j)
        M = len(rows)
        got_x, got_dy = [0], [0]
        prod = None if crit else self.bwd[j + 1]
        dy_kept = prod is not None and self.kept(prod, self.rows_b(prod.rank, j + 1), t, rows)
        cons = self.bwd[j - 1] if a > 0 else None
        dx_kept = cons is not None and self.kept(t, rows, cons, self.rows_b(cons.rank, j - 1))

        def fetch_input(k):
            if keep:
                return [_ins(I, Tensor.SA, t.pack, Stream.SWAP_IN, rows[k], k)]
            if not crit:
                return [_move(I, Tensor.SX, a, rows[k], k)]
            out = []
            prev = self.fwd[-1] if self.fwd else None
            if a == 0 or prev.rank == r:
                out.append(_move(I, Tensor.X, a, rows[k], k))
            elif self.rows_f(prev.rank) == rows:
                out.append(self.recv(r, Tensor.X, a, rows[k], k, prev.rank))
            else:
                out += self._rebatched(r, Tensor.X, a, rows[k], k, prev.rank, self.rows_f(prev.rank), got_x)
            return out + [_move(I, Tensor.T, self.R - 1, rows[k], k)]

        def fetch_dy(k):
            if crit or dy_kept:
                return []
            prod_rows = self.rows_b(prod.rank, j + 1)
            if prod.rank == r:
                return [_move(I, Tensor.DY, b + 1, rows[k], k)]
            if prod_rows == rows:
                return [self.recv(r, Tensor.DY, b + 1, rows[k], k, prod.rank)]
            return self._rebatched(r, Tensor.DY, b + 1, rows[k], k, prod.rank, prod_rows, got_dy)

        for k, rk in enumerate(rows):
            self._ahead(t, k, M, lambda x: fetch_input(x) + fetch_dy(x))
            if not keep:
                self.emit(r, _ins(C, None, t.pack, Stream.COMPUTE, rk, k))
            self.emit(r, _ins(B, Tensor.SA if keep else None, t.pack, Stream.COMPUTE, rk, k))
            if a > 0 and not dx_kept:
                self.emit(r, _move(O, Tensor.DX, a, rk, k) if cons.rank == r
                          else self.send(r, Tensor.DX, a, rk, k, cons.rank))
            frees = [_free(Tensor.SA, t.pack, rk, k)]
            if not keep:
                frees.append(_free(Tensor.X if crit else Tensor.SX, (a, a), rk, k))
            frees.append(_free(Tensor.T, (self.R - 1, self.R - 1), rk, k) if crit
                         else _free(Tensor.DY, (b + 1, b + 1), rk, k))
            if a > 0 and not dx_kept:
                frees.append(_free(Tensor.DX, (a, a), rk, k))
            self.emit(r, *frees)
        self._finish_bwd(t)

    def _finish_bwd(self, t: Task) -> None:
        r, j = t.rank, t.bwd
        if self.all_reduce:
            self.emit(r, _ins(A, Tensor.DW, t.pack, Stream.COMPUTE))
        if j == self.nB - 1:
            self.emit(r, _ins(O, Tensor.B, t.pack, Stream.SWAP_OUT))
        owner = j % self.plan.gpus if self.plan.mode == "vDP" else r
        if owner == r:
            if self.plan.options[j].optimizer == "cpu":
                sweep, rows, last = (None, None, True) if self.sweep is None else self.sweep
                self.emit(r, _ins(O, Tensor.DW, t.pack, Stream.SWAP_OUT, rows, sweep))
                if last:
                    self.emit(r, _ins(U, None, t.pack, Stream.CPU))
            else:
                self.emit(r, _ins(I, Tensor.K, t.pack, Stream.SWAP_IN), _ins(U, None, t.pack, Stream.COMPUTE),
                          _ins(O, Tensor.W, t.pack, Stream.SWAP_OUT), _ins(O, Tensor.K, t.pack, Stream.SWAP_OUT),
                          _free(Tensor.K, t.pack))
        self.emit(r, *self.weights_out(t), _free(Tensor.DW, t.pack))


def _ranges(pack: tuple[int, int], exclude: set[int]) -> list[tuple[int, int]]:
    """The maximal runs of ``pack``'s layers not in ``exclude``."""
    runs, start = [], None
    for l in range(pack[0], pack[1] + 2):
        inside = l <= pack[1] and l not in exclude
        if inside and start is None:
            start = l
        elif not inside and start is not None:
            runs.append((start, l - 1))
            start = None
    return runs


def lower(plan: Plan, copies: list[list[Task]], modes: tuple[bool, ...]) -> list[list[Instr]]:
    """Drafts (no ids, no waits) of every rank's instructions, in issue order."""
    lw = _Lowering(plan, modes)
    for tasks in copies:
        if plan.input_batch_grouping:
            lw.run(tasks)
            continue
        sweeps = microbatch_rows(plan, "FWD", tasks[0].rank)     # vPP: every rank has the same rows
        for s, rows in enumerate(sweeps):
            lw.run(tasks, (s, rows, s == len(sweeps) - 1))
    return [lw.out.get(r, []) for r in range(plan.gpus)]


def _fifo(stream: Stream) -> bool:
    """Streams that run in issue order on one rank (message channels are per peer, so not p2p)."""
    return stream is not Stream.P2P


def dependencies(drafts: list[Instr], num_layers: int) -> list[set[int]]:
    """Per instruction, the earlier ones (by position) it must follow: the last writer of every
    device tensor it reads or changes; every reader of a tensor it changes or frees; every writer
    of host rows it reads; every reader of host rows it overwrites."""
    writer, readers = {}, defaultdict(list)
    host_w, host_r = defaultdict(list), defaultdict(list)
    out = []
    for i, x in enumerate(drafts):
        e: Effects = effects(x, num_layers)
        deps = set()
        for k in e.reads + e.updates + e.frees:
            if k in writer:
                deps.add(writer[k])
        for k in e.updates + e.frees:
            deps.update(readers.pop(k, []))
        for k in e.reads:
            readers[k].append(i)
        for k in e.updates + e.allocs:
            writer[k] = i
        for k in e.frees:
            writer.pop(k, None)
        for buf, rows in e.host_reads:
            deps.update(j for lo, n, j in host_w[buf] if _overlap(rows, lo, n))
            host_r[buf].append((rows, i))
        for buf, rows in e.host_writes:
            deps.update(j for rr, j in host_r[buf] if _overlap(rows, *(rr or (None, None))))
            host_w[buf].append((*(rows or (None, None)), i))
        deps.discard(i)
        out.append(deps)
    return out


def add_waits(drafts: list[Instr], num_layers: int) -> tuple[Instr, ...]:
    """Number the instructions and set ``waits_on`` to their :func:`dependencies`, leaving out
    those on an earlier instruction of the same (FIFO) stream: stream order implies them."""
    ins = [x.replace(id=i) for i, x in enumerate(drafts)]

    def implied(x: Instr, d: int) -> bool:
        return _fifo(x.stream) and ins[d].stream is x.stream
    return tuple(x.replace(waits_on=tuple(sorted(d for d in deps if not implied(x, d))))
                 for x, deps in zip(ins, dependencies(ins, num_layers)))


def instruction_key(x: Instr) -> str | None:
    """The name of a swap-in or swap-out in ``Plan.transfer_order``, as the simulator names the same
    transfer (``simulator.Expansion.key``); None for what a plan's order does not name (weights,
    buffers, optimizer state, targets, the host parking of re-batched activations)."""
    if x.kind is I and x.tensor in (Tensor.X, Tensor.SX, Tensor.DY, Tensor.SA):
        tensor = Tensor.SX if x.tensor is Tensor.SA else x.tensor       # a stashing pack's saved activations
    elif x.kind is O and x.tensor in (Tensor.Y, Tensor.SX, Tensor.DX, Tensor.DW):
        tensor = x.tensor
    elif x.kind is O and x.tensor is Tensor.W:                          # the GPU optimizer's write-back
        return transfer_key("WK", x.layers[0], 0, 0)
    else:
        return None
    return transfer_key(tensor.value, x.layers[0], x.offset or 0, x.size or 0)


def follow_order(drafts: list[Instr], plan: Plan, rank: int) -> tuple[list[Instr], list[str]]:
    """Issue ``rank``'s swap-ins and swap-outs in the plan's order (``Plan.transfer_order``).

    In each of those two streams the transfers the order names take the places the named ones
    held, in its order; the others keep theirs. Then the whole list is re-sorted, as close to the
    rule's issue order as the new stream orders and every dependency of the rule's order allow
    (a tensor is still written before it is read and read before it is freed), so the program
    computes the same thing. Frees may move later, to after the transfer that reads their tensor.
    Returns the new list and notes on named transfers this rank's program has no instruction for
    (the compiler moves some activations otherwise than the simulator: by P2P and host parking)."""
    orders = {s: keys for r, s, keys in plan.transfer_order or () if r == rank and s in ("swap_in", "swap_out")}
    if not orders:
        return drafts, []
    n = len(drafts)
    g = nx.DiGraph()
    g.add_nodes_from(range(n))
    for i, deps in enumerate(dependencies(drafts, plan.num_layers)):
        g.add_edges_from((d, i) for d in deps)
    notes = []
    for stream in filter(_fifo, Stream):
        seq = [i for i, x in enumerate(drafts) if x.stream is stream and x.kind is not D]     # a free waits on nothing
        keys = orders.get(stream.value)
        if keys:
            name = {i: instruction_key(drafts[i]) for i in seq}
            seq = in_order(seq, name.get, keys)
            missing = len(set(keys) - set(name.values()))
            if missing:
                notes.append(f"rank {rank}: {missing} of the {len(keys)} {stream.value.replace('_', '-')}s in the plan's "
                             f"order are not copies of their own in the program (a stashing pack's forward copies "
                             f"its saved activations itself, and activations can go to another GPU by a send); "
                             f"the others keep the plan's order")
        g.add_edges_from(zip(seq, seq[1:]))
    try:
        order = list(nx.lexicographical_topological_sort(g, key=lambda i: i))
    except nx.NetworkXUnfeasible:
        raise PlanError(f"plan field transfer_order: rank {rank}'s swaps cannot be issued in that order (a transfer "
                        f"would come before what it moves is made); re-plan, or drop transfer_order") from None
    return [drafts[i] for i in order], notes


def fit_swap_ins(drafts: list[Instr], num_layers: int, sizes: LayerBytes, cap: int) -> list[Instr]:
    """Issue each swap-in as early as the rule's order has it, but no earlier than where its bytes
    fit under ``cap`` until it is used, given what is live then (the simulator's rule, which
    reserves a task's memory when it starts and starts a swap-in when there is room), and at the
    latest just before the first instruction that uses its tensor or overwrites the host rows it
    reads. The swap-in stream keeps its order. Where even that last place does not fit, the
    validator names the instruction."""
    everything = [effects(x, num_layers) for x in drafts]
    rest = [x for x in drafts if x.kind is not I]
    eff = [e for x, e in zip(drafts, everything) if x.kind is not I]
    ins = [(x, e) for x, e in zip(drafts, everything) if x.kind is I]
    if not ins:
        return list(drafts)
    # for every swap-in: the gap (place before rest[g]) the rule's order gives it, and its last one
    first, seen = [], 0
    for x in drafts:
        if x.kind is I:
            first.append(seen)
        else:
            seen += 1
    last = []
    for (_, e), g0 in zip(ins, first):
        keys = set(e.allocs)
        last.append(next((g for g in range(g0, len(rest)) if _uses(eff[g], keys, e.host_reads)), len(rest)))
    need = [sum(sizes.alloc_bytes(x, k) for k in e.allocs) for x, e in ins]
    # live bytes at each instruction of ``rest`` with every swap-in just in time
    arrive = defaultdict(list)
    for i, g in enumerate(last):
        arrive[g].append(i)
    held: dict[tuple, int] = {}
    live, base = 0, [0] * len(rest)
    for g, e in enumerate(eff):
        for i in arrive[g]:
            x, xe = ins[i]
            for k in xe.allocs:
                held[k] = sizes.alloc_bytes(x, k)
                live += held[k]
        for k in e.allocs:
            held[k] = sizes.alloc_bytes(rest[g], k)
            live += held[k]
        base[g] = live
        for k in e.frees:
            live -= held.pop(k, 0)
    # earliest gap from which each swap-in fits until it is used, in stream order
    place, floor = [], 0
    for i in range(len(ins)):
        hi = last[i]
        lo = min(max(first[i], floor), hi)     # stream order, unless it would come after the tensor's use
        g, top = hi, 0
        for h in range(hi - 1, lo - 1, -1):
            top = max(top, base[h])
            if top + need[i] > cap:
                break
            g = h
        for h in range(g, hi):
            base[h] += need[i]
        place.append(g)
        floor = g
    out: list[Instr] = []
    by_gap = defaultdict(list)
    for i, g in enumerate(place):
        by_gap[g].append(ins[i][0])
    for g, x in enumerate(rest):
        out += by_gap[g]
        out.append(x)
    return out + by_gap[len(rest)]


def _uses(e: Effects, keys: set, host_reads: tuple) -> bool:
    """Whether an instruction with effects ``e`` needs a swap-in (allocating ``keys`` from the host
    rows ``host_reads``) done first: it uses the tensor or overwrites the rows."""
    if keys & set(e.reads + e.updates + e.frees):
        return True
    return any(buf == pb and (rows is None or prow is None or _overlap(rows, *prow))
               for buf, rows in e.host_writes for pb, prow in host_reads)


def _overlap(rows: Rows | None, lo: int | None, n: int | None) -> bool:
    if rows is None or lo is None:
        return True
    return rows[0] < lo + n and lo < rows[0] + rows[1]


def add_bytes(ins: tuple[Instr, ...], sizes: LayerBytes, num_layers: int) -> tuple[Instr, ...]:
    """Bytes each instruction moves (transfers), allocates (compute) or releases (free), exact
    (the allocator's rounding is the memory replay's: ``LayerBytes.alloc_bytes``)."""
    out = []
    for x in ins:
        e = effects(x, num_layers)
        keys = {O: e.reads, S: e.reads, A: e.updates, D: e.frees}.get(x.kind, e.allocs)
        if x.kind is U:
            keys = tuple(("W", l) for l in x.layer_range)
        out.append(x.replace(bytes=sum(sizes.tensor_bytes(x, k) for k in keys)))
    return tuple(out)


def _check_sweeps(plan: Plan) -> None:
    """Naive swapping on several vDP replicas all-reduces every sweep's gradients over all of
    them, so every replica must sweep as often (the simulator lets the shorter ones drop out)."""
    if plan.input_batch_grouping or plan.mode != "vDP" or plan.gpus == 1:
        return
    counts = [len(microbatch_rows(plan, "FWD", r)) for r in range(plan.gpus)]
    if len(set(counts)) > 1:
        raise PlanError(f"naive swapping (input_batch_grouping false) on {plan.gpus} GPUs needs as many microbatches "
                        f"on every GPU, but minibatch {plan.batch} at microbatch {plan.microbatch_fwd} gives "
                        f"{', '.join(map(str, counts))}; use a minibatch or microbatch size that splits evenly")


def issue_order(plan: Plan, layer_bytes: LayerBytes | None = None,
                memory_cap: int | None = None) -> tuple[list[list[Instr]], tuple[str, ...]]:
    """Passes 1-5: every rank's instructions in issue order (no ids, no waits), and the notes. What
    :func:`harmony_opt.compile.program_memory.program_memory` replays: the memory of a program is settled here."""
    if layer_bytes is not None and layer_bytes.num_layers != plan.num_layers:
        raise PlanError(f"layer bytes describe {layer_bytes.num_layers} layers but the plan has {plan.num_layers}")
    _check_sweeps(plan)
    copies = build_tasks(plan)
    modes, notes = stash_modes(plan, copies[0])
    drafts = lower(plan, copies, modes)
    for r, d in enumerate(drafts):
        drafts[r], more = follow_order(d, plan, r)
        notes += tuple(more)
    cap = memory_cap if memory_cap is not None else plan.memory_cap
    if layer_bytes is not None and cap:
        drafts = [fit_swap_ins(d, plan.num_layers, layer_bytes, int(cap)) for d in drafts]
    return drafts, notes


def compile_plan(plan: Plan, *, layer_bytes: LayerBytes | None = None, memory_cap: int | None = None) -> Program:
    """Lower ``plan`` to a Program (see the module docstring for the passes); with ``layer_bytes``,
    swap-ins wait for room under ``memory_cap`` (default: the plan's)."""
    drafts, notes = issue_order(plan, layer_bytes, memory_cap)
    ranks = [add_waits(d, plan.num_layers) for d in drafts]
    if layer_bytes is not None:
        ranks = [add_bytes(x, layer_bytes, plan.num_layers) for x in ranks]
    shares = plan.samples_per_gpu()
    offsets = [0] * plan.gpus if plan.mode == "vPP" else list(itertools.accumulate([0] + shares[:-1]))
    return Program(ranks=tuple(ranks), num_layers=plan.num_layers, mode=plan.mode, batch=plan.batch,
                   samples=tuple(shares), sample_offsets=tuple(offsets), plan_identity=plan_identity(plan),
                   layer_bytes=layer_bytes, notes=notes)
