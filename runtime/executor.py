"""Execute one rank's instructions of a Program with real tensors.

::

    ex = Executor(program, rank=0, layers=model.layers, optimizers=PackOptimizers(...),
                  shapes=boundary_shapes(model.layers, x[:1]), device="cpu", memory_cap=None)
    loss = ex.run_iteration(step, inputs, targets)

One class per instruction kind would only repeat the Program's own types, so the
dispatch table ``_HANDLERS`` maps each :class:`~harmony_opt.compile.program.Kind` to a method;
an unknown kind is an error. Each handler returns the device tensors it allocates,
keyed as :func:`harmony_opt.compile.program.effects` names them, and the executor's device
table does the rest: it refuses a read of a tensor that is not there, and its memory
guard stops the first instruction that would hold more live device bytes than the cap
(:class:`~harmony_opt.core.errors.RuntimeMemoryError`, naming the instruction). Each
instruction runs inside ``record_function("H:<instruction>")`` while a torch profiler
records, so its trace shows the schedule (otherwise not: the range and the instruction's
name cost about 7 us per instruction, a tenth of a tiny model's L2L step on the CPU).

Streams (docs/runtime.md): on a GPU every instruction runs on its named CUDA stream
(compute, swap_in, swap_out, p2p) after waiting on the CUDA events of the instructions
in its ``waits_on``; receives are waited on through their ``Work``; the CPU stream's
optimizer steps run on a worker thread, and an instruction that depends on one waits
for its future. On the CPU every stream is the host itself and the instructions run in
order, which is the same program with the overlap taken out.

Weights, buffers and optimizer state stay on the host (the master copy); the device
gets copies for as long as a pack runs. With ``precision="bf16"`` every forward and
recompute runs under ``torch.autocast(device type, torch.bfloat16)``, one autocast region
per instruction (so autocast's cached bf16 weight copies live for that instruction, or in
the graph a recompute keeps); the backward runs outside it, as torch runs a backward, in
the dtypes the forward chose. Weights, gradients and optimizer state stay fp32.
"""
from __future__ import annotations

import contextlib
import hashlib
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.autograd.profiler import record_function
from torch.func import functional_call

from harmony_opt.core.errors import HarmonyOptError, ProgramError, RuntimeMemoryError
from harmony_opt.core.kinds import Tensor
from harmony_opt.core.precision import autocast, inner_view
from harmony_opt.core.units import alloc_bytes, alloc_granularity
from harmony_opt.compile.program import CHANNELS, Effects, Instr, Kind, Program, Stream, effects, trace_name
from harmony_opt.compile.validate import format_schedule
from harmony_opt.sim.timeline import memory_steps

from .buffers import HostBuffers
from .graph import CountSaved, Offload, PackGraph
from .optim import PackOptimizers


def nbytes(value, granularity: int = 1) -> int:
    """Device bytes of a table entry: a tensor, a dict of them, or a pack graph; with ``granularity``
    each tensor rounded up to a multiple of it, as the device's caching allocator holds it."""
    if isinstance(value, torch.Tensor):
        return alloc_bytes(value.numel() * value.element_size(), granularity)
    if isinstance(value, dict):
        return sum(nbytes(v, granularity) for v in value.values())
    if isinstance(value, PackGraph):
        return value.alloc_bytes(granularity)
    return 0


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, PackGraph) and value.saved is not None:
        yield from (s.device for s in value.saved if s.device is not None)


class DeviceTable:
    """Live device tensors by key, with the memory guard; each tensor counts its bytes rounded up to
    the allocator's ``granularity`` (512 on CUDA, :func:`~harmony_opt.core.units.alloc_granularity`)."""

    def __init__(self, rank: int, cap: int | None, granularity: int = 1):
        self.rank, self.cap, self.granularity = rank, cap, granularity
        self.values: dict[tuple, object] = {}
        self.sizes: dict[tuple, int] = {}
        self.live = 0
        self.peak = 0

    def get(self, key: tuple, ins: Instr):
        try:
            return self.values[key]
        except KeyError:
            raise ProgramError(f"rank {self.rank}: instruction {ins} reads device tensor {key} which is not on the "
                               f"device (used before it arrived, or after it was freed)") from None

    def size(self, value) -> int:
        """Bytes ``value`` holds on the device (:func:`nbytes` at the table's granularity)."""
        return nbytes(value, self.granularity)

    def reserve(self, extra: int, ins: Instr) -> None:
        """Fail before allocating when ``extra`` more bytes would exceed the cap."""
        if self.cap is not None and self.live + extra > self.cap:
            raise RuntimeMemoryError(
                f"rank {self.rank}: instruction {ins} would hold {self.live + extra} bytes on the device, over the "
                f"memory cap of {self.cap} bytes ({self.live} live before it)")

    def put(self, key: tuple, value, ins: Instr) -> None:
        if key in self.values:
            raise ProgramError(f"rank {self.rank}: instruction {ins} allocates {key}, which is already on the device")
        size = self.size(value)
        self.values[key], self.sizes[key] = value, size
        self.live += size
        self.peak = max(self.peak, self.live)
        if self.cap is not None and self.live > self.cap:
            raise RuntimeMemoryError(f"rank {self.rank}: instruction {ins} holds {self.live} bytes on the device "
                                     f"after it ran, over the memory cap of {self.cap} bytes")

    def resize(self, key: tuple) -> None:
        """Re-measure an entry that grew or shrank in place."""
        size = self.size(self.values[key])
        self.live += size - self.sizes[key]
        self.sizes[key] = size
        self.peak = max(self.peak, self.live)

    def pop(self, key: tuple, ins: Instr):
        if key not in self.values:
            raise ProgramError(f"rank {self.rank}: instruction {ins} frees {key}, which is not on the device")
        self.live -= self.sizes.pop(key)
        return self.values.pop(key)


class Tracer:
    """When and where every instruction of the traced iterations ran, as :class:`~harmony_opt.sim.timeline.Timeline`
    event rows (seconds from the iteration's start). On a GPU from CUDA events on each instruction's
    stream (the device's clock, from an event recorded as the iteration starts); on the CPU, and for
    the CPU optimizer's steps, from the wall clock. Frees take no time and are left out, as are
    sends and receives on a GPU (their time is the communication library's). On the CPU, the time a
    rank waits for another rank's message is traced on a ``wait`` stream. On a GPU, also when the
    thread issued each instruction (wall clock; ``issue`` rows): where the GPU waits for the host,
    those set the step (``Hardware.host_instruction_s``). Memory: the live
    device bytes as each instruction leaves them, from its end (a free's, from the end of the
    device instruction before it: exact on the CPU, where they run in order; on a GPU, where
    streams overlap, an approximation)."""

    def __init__(self, rank: int, cuda: bool):
        self.rank, self.cuda = rank, cuda
        self._wall: list[tuple[Instr, float, float]] = []     # (instruction, start, end) from the wall clock
        self._waits: list[tuple[Instr, float, float]] = []    # (receive, start, end) waited for on the CPU
        self._gpu: list[tuple[Instr, torch.cuda.Event, torch.cuda.Event]] = []
        self._issue: list[tuple[Instr, float, float]] = []    # (instruction, start, end) of its issue on a GPU
        self.bytes: dict[int, int] = {}       # instruction id -> bytes it copied between host and device
        self._memory: list[tuple[int | None, int]] = []     # (id whose end it happens at, change in bytes)
        self._last: int | None = None
        self._done: list[tuple] = []          # the finished iterations' raw records, oldest first

    def begin(self, step: int = 0) -> None:
        self.step = step
        self._wall, self._gpu, self._waits, self.bytes, self._memory, self._last = [], [], [], {}, [], None
        self._issue = []
        self.t0 = time.perf_counter()
        self.base = None
        if self.cuda:
            self.base = torch.cuda.Event(enable_timing=True)
            self.base.record()

    def timed(self, ins: Instr) -> bool:
        return ins.kind is not Kind.FREE and not (self.cuda and ins.kind in (Kind.SEND, Kind.RECV))

    def memory(self, ins: Instr, change: int) -> None:
        if self.timed(ins) and ins.stream is not Stream.CPU:    # CPU steps end out of program order
            self._last = ins.id
        if change:
            self._memory.append((self._last, change))

    def row(self, ins: Instr, start: float, end: float, moved: dict[int, int]) -> tuple:
        kind, pack, mb = trace_name(ins)
        return self.rank, ins.stream.value, kind, str(ins), pack, mb, start, end, moved.get(ins.id, 0)

    def wall(self, ins: Instr, start: float, end: float) -> None:
        self._wall.append((ins, start - self.t0, end - self.t0))   # list.append: safe from the CPU thread

    def wait(self, recv: Instr, start: float, end: float) -> None:
        """Time a rank spent waiting for a message from another rank (the CPU device): traced on a
        ``wait`` stream, so that it is not taken for the executor's own work between instructions."""
        self._waits.append((recv, start - self.t0, end - self.t0))

    def gpu(self, ins: Instr, start: "torch.cuda.Event", end: "torch.cuda.Event") -> None:
        self._gpu.append((ins, start, end))

    def issue(self, ins: Instr, start: float, end: float) -> None:
        """The host's time issuing a GPU instruction (wall clock, from the iteration's start): where
        the GPU waits for the host rather than the host for the GPU, these set the step."""
        self._issue.append((ins, start - self.t0, end - self.t0))

    def finish(self, keep: int = 1) -> None:
        """Keep the iteration's raw record (call after the device is synchronized), and at most the
        ``keep`` newest. Rows are made from it by :meth:`result`, outside the timed iteration:
        formatting them every step cost a tiny model's CPU step about 3 %."""
        self._done.append((self.step, self._wall, self._gpu, self._waits, self.bytes, self._memory, self.base,
                           self._issue))
        del self._done[:-keep]

    def results(self) -> list[dict[str, list[tuple]]]:
        """Every kept iteration's :meth:`result`, oldest first."""
        return [self.result(i) for i in range(len(self._done))]

    def result(self, i: int = -1) -> dict:
        """A finished iteration's step, event rows in start order, and memory steps (rank, time,
        bytes): the last one's by default; empty before the first."""
        if not self._done:
            return {}
        step, wall, gpu, waits, moved, memory, base, issue = self._done[i]
        times = wall + [(ins, base.elapsed_time(a) / 1e3, base.elapsed_time(b) / 1e3) for ins, a, b in gpu]
        rows = [self.row(ins, a, b, moved) for ins, a, b in times]
        for ins, a, b in waits:
            kind, pack, mb = trace_name(ins)
            rows.append((self.rank, "wait", kind, f"wait {ins}", pack, mb, a, b, 0))
        ends = {ins.id: b for ins, _, b in times}
        steps = memory_steps(self.rank, [(ends.get(i, 0.0), change) for i, change in memory])
        return {"step": step, "events": sorted(rows, key=lambda r: (r[6], r[7])), "memory": steps,
                "issue": [(self.rank, str(ins), ins.kind.name.lower(), a, b) for ins, a, b in issue]}


class Streams:
    """Named CUDA streams ordered by events; on the CPU, plain in-order execution."""

    def __init__(self, device: torch.device, tracer: Tracer | None = None):
        self.cuda = device.type == "cuda"
        self.streams = {s: torch.cuda.Stream(device) for s in Stream if s is not Stream.CPU} if self.cuda else {}
        self.events: dict[int, torch.cuda.Event] = {}
        self.tracer = tracer

    def on(self, ins: Instr):
        """Run on the instruction's stream after the events of what it waits on. A free only
        drops references (every use was recorded on its stream, so the allocator reuses the
        memory only after those uses), so it neither waits nor records. On the CPU, nothing
        to enter (a context of its own per instruction cost 2 us)."""
        if not self.cuda or ins.stream is Stream.CPU or ins.kind is Kind.FREE:
            return _NOTHING
        return self._on(ins)

    @contextlib.contextmanager
    def _on(self, ins: Instr):
        s = self.streams[ins.stream]
        for w in ins.waits_on:
            ev = self.events.get(w)
            if ev is not None:
                s.wait_event(ev)
        timed = self.tracer is not None and ins.kind not in (Kind.SEND, Kind.RECV)
        if timed:
            start = torch.cuda.Event(enable_timing=True)
            start.record(s)
        with torch.cuda.stream(s):
            yield s
        if ins.kind not in (Kind.SEND, Kind.RECV):
            ev = torch.cuda.Event(enable_timing=timed)
            ev.record(s)
            self.events[ins.id] = ev
            if timed:
                self.tracer.gpu(ins, start, ev)

    def finish(self, device: torch.device) -> None:
        if self.cuda:
            torch.cuda.synchronize(device)
        self.events.clear()


_NOTHING = contextlib.nullcontext()      # entered where there is no stream and no profiler range


def _profiling() -> bool:
    """Whether a torch profiler records now (then each instruction is a named range in its trace)."""
    return torch._C._autograd._profiler_enabled()


def is_stochastic(layer: nn.Module) -> bool:
    """Whether a layer draws random numbers (dropout with p > 0): only then is its RNG forked."""
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in layer.modules())


@contextlib.contextmanager
def seeded(key: str, device: torch.device):
    """The generators a layer on ``device`` draws from (the CPU's, and on CUDA the GPU's), seeded
    from ``key`` for the block and restored after it (a stochastic layer's forward: its dropout
    masks replay exactly in the recompute of the same samples). Each generator is seeded by itself:
    ``torch.manual_seed`` seeds every backend's, at 96 us a call on a 2-core CPU against 1 us, once
    per dropout layer per forward and recompute."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & (2**63 - 1)
    gens = [torch.default_generator]
    if device.type == "cuda":
        torch.cuda.init()
        gens.append(torch.cuda.default_generators[device.index if device.index is not None
                                                  else torch.cuda.current_device()])
    states = [g.get_state() for g in gens]
    for g in gens:
        g.manual_seed(seed)
    try:
        yield
    finally:
        for g, state in zip(gens, states):
            g.set_state(state)


def run_layer(layer: nn.Module, state: dict, args: tuple, key: str | None, device: torch.device):
    """One layer on one microbatch as the executor runs it: ``functional_call`` over ``state`` (its
    weights and buffers), under ``seeded(key)`` where ``key`` is given (a stochastic layer). The
    profiler times layers through it too: on a 2-core CPU ``functional_call`` costs a BERT-tiny block
    0.13 ms beside its 0.62 ms of kernels (microbatch 8), which a direct call does not show."""
    if key is None:
        return functional_call(layer, state, args)
    with seeded(key, device):
        return functional_call(layer, state, args)


class Executor:
    """Runs one rank's instruction list, one iteration per :meth:`run_iteration`."""

    def __init__(self, program: Program, rank: int, layers: list[nn.Module], optimizers: PackOptimizers,
                 shapes: list[tuple[tuple[int, ...], torch.dtype]], *, device: str | torch.device = "cpu",
                 comm=None, memory_cap: int | None = None, seed: int = 0, trace: int = 0,
                 defer_updates: bool = False, granularity: int | None = None, precision: str = "fp32"):
        self.program, self.rank, self.layers = program, rank, layers
        # with defer_updates, a CPU update only records its pack here; the caller steps them after the
        # iteration (gradient clipping needs every gradient before the first step)
        self.deferred: list[tuple[int, int]] | None = [] if defer_updates else None
        self.instrs = program.ranks[rank]
        self.R = program.num_layers
        self.device = torch.device(device)
        self.precision = precision
        self.optim, self.shapes, self.comm, self.seed = optimizers, shapes, comm, seed
        # the guard's rounding: the device's allocator's unless given (a test prices CUDA on the CPU)
        self.table = DeviceTable(rank, memory_cap,
                                 alloc_granularity(self.device.type) if granularity is None else granularity)
        # trace: keep the records of that many newest traced iterations (True: the last one)
        self.tracer = self._tracer = Tracer(rank, self.device.type == "cuda") if trace else None
        self._keep = int(trace)
        self.streams = Streams(self.device, self.tracer)
        self.host = HostBuffers(program.samples[rank])
        self.weights = [{n: p.detach() for n, p in layer.named_parameters()} for layer in layers]
        self.trainable = [{n: p.requires_grad for n, p in layer.named_parameters()} for layer in layers]
        self.buffers = [{n: b for n, b in layer.named_buffers()} for layer in layers]
        self.stochastic = [is_stochastic(layer) for layer in layers]
        self.effects = [effects(x, self.R) for x in self.instrs]
        self._recvs = {x.id: x for x in self.instrs if x.kind is Kind.RECV}   # what a wait on the CPU waits for
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"cpu-optimizer-{rank}")
        self.kept: dict[tuple, PackGraph] = {}
        self.step = 0
        self._pending: dict[int, object] = {}
        self._sends: list = []
        self._inline_out: tuple | None = None   # (swap-out of sA, bytes, seconds) of a forward copying in line
        self._loss = None
        self.times: list[float] = []
        self.moved = {"h2d": 0, "d2h": 0}     # bytes copied host->device and device->host, all iterations
        self._host_adds: list[Future] = []    # naive swapping's gradient additions on the CPU thread

    def close(self) -> None:
        self.pool.shutdown(wait=True)

    @property
    def traces(self) -> list[dict]:
        """With trace=N: the N newest traced iterations' steps, events and memory steps, oldest first
        (:meth:`Tracer.result`)."""
        return self._tracer.results() if self._tracer else []

    def tracing(self, on: bool) -> None:
        """Time the next iterations' instructions or not (an executor made with trace=True): the
        worker times only the steps it was asked to trace (:func:`traced_steps`) where it knows
        which steps those are."""
        self.tracer = self.streams.tracer = self._tracer if on else None

    # -- one iteration -----------------------------------------------------------------------------
    def run_iteration(self, step: int, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Run every instruction once on this rank's share of ``(inputs, targets)``; returns the
        rank's part of the minibatch loss (the loss rank's sum of scaled microbatch losses)."""
        t0 = time.perf_counter()
        if self.tracer:
            self.tracer.begin(step)
        self.step = step
        lo, n = self.program.sample_offsets[self.rank], self.program.samples[self.rank]
        self.host.stage(("data",), inputs[lo:lo + n])
        self.host.stage(("T",), targets[lo:lo + n])
        self._loss = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, ins in enumerate(self.instrs):
            self._execute(i, ins)
        loss = self._finish()
        self.times.append(time.perf_counter() - t0)
        return loss

    def _trace_wall(self, ins: Instr, start: float, end: float) -> None:
        """Trace a CPU-device instruction (CPU steps time themselves). A forward that copied its saved
        activations to the host in line is traced as the forward, then a swap-out of sA of the copies'
        summed time: the work the simulator charges to each."""
        inline, self._inline_out = self._inline_out, None
        if inline is None:
            self.tracer.wall(ins, start, end)
            return
        copies, out, secs = inline
        split = max(start, end - secs)
        self.tracer.bytes[ins.id] -= out
        self.tracer.wall(ins, start, split)
        self.tracer.wall(copies, split, end)

    def _execute(self, i: int, ins: Instr) -> None:
        e: Effects = self.effects[i]
        try:
            handler = _HANDLERS.get(ins.kind)
            if handler is None:
                raise ProgramError(f"rank {self.rank}: the executor does not understand instruction {ins}")
            named = record_function(f"H:{ins}") if _profiling() else _NOTHING
            with self.streams.on(ins) as stream, named:
                for w in ins.waits_on:
                    self._wait(w)
                if self.tracer is None:
                    made = handler(self, ins, e) or {}
                else:
                    t_start, moved = time.perf_counter(), sum(self.moved.values())
                    made = handler(self, ins, e) or {}
                    self.tracer.bytes[ins.id] = sum(self.moved.values()) - moved
                    if self.streams.cuda:
                        self.tracer.issue(ins, t_start, time.perf_counter())
                    elif self.tracer.timed(ins) and ins.stream is not Stream.CPU:
                        self._trace_wall(ins, t_start, time.perf_counter())
                if stream is not None:
                    for k in e.reads + e.updates:
                        for t in _tensors(self.table.values.get(k)):
                            t.record_stream(stream)
            live = self.table.live
            for k in e.allocs:
                self.table.put(k, made[k], ins)
            for k in e.updates:
                self.table.resize(k)
            for k in e.frees:
                self._release(self.table.pop(k, ins))
            if self.tracer:
                self.tracer.memory(ins, self.table.live - live)
        except HarmonyOptError as err:
            raise type(err)(f"{err}\n{format_schedule(self.program, self.rank, i)}") from None
        except Exception as err:
            raise RuntimeError(f"rank {self.rank}: instruction {ins} failed: {type(err).__name__}: {err}\n"
                               f"{format_schedule(self.program, self.rank, i)}") from err

    def _wait(self, dep: int) -> None:
        """Wait for a receive or a CPU update. On a GPU waiting on a receive makes the current
        stream wait, so every consumer waits for itself; on the CPU a completed receive is done
        for everyone (and Gloo's wait must not be repeated: it would wait for another message)."""
        got = self._pending.get(dep) if self.streams.cuda else self._pending.pop(dep, None)
        if isinstance(got, Future):
            got.result()
        elif got is not None:
            if self.tracer is None or self.streams.cuda:
                got.wait()
                return
            start = time.perf_counter()
            got.wait()
            self.tracer.wait(self._recvs[dep], start, time.perf_counter())

    def _finish(self) -> float:
        for dep in list(self._pending):
            self._wait(dep)
        self._pending.clear()
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        for f in self._host_adds:
            f.result()
        self._host_adds.clear()
        self.streams.finish(self.device)
        if self.tracer:
            self.tracer.finish(self._keep)
        if self.table.values:
            left = ", ".join(map(str, list(self.table.values)[:5]))
            raise ProgramError(f"rank {self.rank}: the iteration ends with tensors still on the device ({left}); "
                               f"the program does not free everything it allocates")
        self.kept.clear()
        return float(self._loss.item())

    @staticmethod
    def _release(value) -> None:
        if isinstance(value, PackGraph):
            value.release()

    # -- helpers -------------------------------------------------------------------------------------
    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        self.moved["h2d"] += nbytes(t)
        return torch.empty_like(t, device=self.device).copy_(t, non_blocking=True)

    def _to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.moved["d2h"] += nbytes(src)
        dst.copy_(src, non_blocking=True)

    def _add_to_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """``dst += src`` for a host ``dst``: on a GPU, ``src`` is copied into a pinned staging
        buffer and the CPU worker thread adds it once the copy is done; that thread runs the
        CPU optimizer steps too, in submission order, so every addition precedes the step."""
        if not self.streams.cuda:
            self.moved["d2h"] += nbytes(src)
            dst.add_(src)
            return
        staging = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
        self._to_host(staging, src)
        done = torch.cuda.Event()
        done.record()

        def add():
            done.synchronize()
            dst.add_(staging)

        self._host_adds.append(self.pool.submit(add))

    def _autocast(self):
        """The precision's autocast region on this device (none for fp32): the loss layer inside it
        too, which autocast computes in fp32 (cross-entropy, log-softmax are on its fp32 list)."""
        return autocast(self.device.type, self.precision)

    def _state(self, layer: int, ins: Instr) -> dict:
        return {**self.table.get(("W", layer), ins), **self.table.get(("B", layer), ins)}

    def _rng_key(self, layer: int, ins: Instr) -> str | None:
        """Dropout draws from a generator seeded by (seed, step, layer, samples), so a recompute
        of the same samples replays the forward's masks exactly; None for a layer without dropout."""
        if not self.stochastic[layer]:
            return None
        first = self.program.sample_offsets[self.rank] + ins.offset
        return f"{self.seed}/{self.step}/{layer}/{first}/{ins.size}"

    def _chain(self, a: int, b: int, x: torch.Tensor, ins: Instr) -> torch.Tensor:
        """Layers a..b (the loss layer excluded) on one microbatch."""
        for layer in range(a, min(b, self.R - 2) + 1):
            x = run_layer(self.layers[layer], self._state(layer, ins), (x,), self._rng_key(layer, ins), self.device)
            if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] != ins.size:
                raise ProgramError(f"layer {layer} ({type(self.layers[layer]).__name__}) returned "
                                   f"{type(x).__name__} {tuple(getattr(x, 'shape', ()))} for a microbatch of "
                                   f"{ins.size}: layers must return one tensor with the batch as first dimension")
        return x

    def _leaves(self, a: int, b: int, ins: Instr) -> tuple[list[torch.Tensor], list[tuple[int, str]]]:
        ws, names = [], []
        for layer in range(a, b + 1):
            for n, t in self.table.get(("W", layer), ins).items():
                if self.trainable[layer][n]:
                    ws.append(t)
                    names.append((layer, n))
        return ws, names

    def _input_leaf(self, x: torch.Tensor, layer: int, copy: bool) -> torch.Tensor:
        leaf = (x.detach().clone() if copy else x.detach())
        return leaf.requires_grad_(layer > 0 and leaf.is_floating_point())

    # -- handlers: IO ----------------------------------------------------------------------------------
    def _swap_in(self, ins: Instr, e: Effects) -> dict:
        """Roughly: ``device[key] = host[buffer][rows].to(device)``; weights and buffers per layer,
        optimizer state from the pack's optimizer, a kept graph's saved activations back in."""
        t = ins.tensor
        if t in (Tensor.W, Tensor.B):
            out = {}
            for layer in ins.layer_range:
                src = (self.weights if t is Tensor.W else self.buffers)[layer]
                self.table.reserve(self.table.size(src), ins)
                dev = {n: self._to_device(h) for n, h in src.items()}
                if t is Tensor.W:
                    for n, d in dev.items():
                        d.requires_grad_(self.trainable[layer][n])
                out[(t.value, layer)] = dev
            return out
        if t is Tensor.K:
            state = self.optim.state_to_device(ins.layers, self.device)
            self.moved["h2d"] += nbytes(state)
            return {("K", layer): state[layer] for layer in ins.layer_range}
        if t is Tensor.SA:
            key = e.allocs[0]
            graph = self.kept.pop(key[1:], None)
            if graph is None:
                raise ProgramError(f"rank {self.rank}: instruction {ins}: no graph was kept for layers "
                                   f"{list(ins.layers)}, samples {ins.offset}+{ins.size} (its forward with tensor sA "
                                   f"did not run)")
            self.table.reserve(sum(self.table.size(s.host) for s in graph.saved), ins)
            graph.to_device(self.device)
            self.moved["h2d"] += sum(nbytes(s.host) for s in graph.saved)
            return {key: graph}
        (buf, _), = e.host_reads
        src = self.host.get(buf)[ins.offset:ins.offset + ins.size]
        self.table.reserve(self.table.size(src), ins)
        return {e.allocs[0]: self._to_device(src)}

    def _swap_out(self, ins: Instr, e: Effects) -> None:
        """Roughly: ``host[buffer][rows].copy_(device[key])``; dW into the optimizer's gradient
        buffers, weights, buffers and state into the master copies."""
        t = ins.tensor
        if t is Tensor.DW:
            for layer in ins.layer_range:
                for n, g in self.table.get(("dW", layer), ins).items():
                    if ins.mb:      # a later sweep of naive swapping: add to the earlier sweeps' sum
                        self._add_to_host(self.optim.grad_buffer(layer, n), g)
                    else:
                        self._to_host(self.optim.grad_buffer(layer, n), g)
        elif t in (Tensor.W, Tensor.B):
            for layer in ins.layer_range:
                home = (self.weights if t is Tensor.W else self.buffers)[layer]
                for n, d in self.table.get((t.value, layer), ins).items():
                    self._to_host(home[n], d.detach())
        elif t is Tensor.K:
            self.moved["d2h"] += sum(nbytes(self.table.get(("K", layer), ins)) for layer in ins.layer_range)
            self.optim.state_to_host(ins.layers, {layer: self.table.get(("K", layer), ins)
                                                  for layer in ins.layer_range})
        else:
            src = self.table.get(e.reads[0], ins)
            (buf, _), = e.host_writes
            self._to_host(self.host.for_rows(buf, src)[ins.offset:ins.offset + ins.size], src)

    def _send(self, ins: Instr, e: Effects) -> None:
        """Roughly: ``isend(device[key], peer, tag)``; the tensor is kept alive until the send completes."""
        t = self.table.get(e.reads[0], ins)
        self._sends.append((self.comm.isend(t, ins.peer, ins.tag, CHANNELS[ins.tensor]), t))

    def _recv(self, ins: Instr, e: Effects) -> dict:
        """Roughly: ``device[key] = irecv(empty(size, *shape of the layer's input), peer, tag)``;
        consumers wait for it through ``waits_on``."""
        tail, dtype = self.shapes[ins.layers[0]]
        buf = torch.empty((ins.size,) + tuple(tail), dtype=dtype, device=self.device)
        self.table.reserve(self.table.size(buf), ins)
        self._pending[ins.id] = self.comm.irecv(buf, ins.peer, ins.tag, CHANNELS[ins.tensor])
        return {e.allocs[0]: buf}

    def _free(self, ins: Instr, e: Effects) -> None:
        """Roughly: ``del device[key]``. Weights also lose their storage at once: a kept graph
        still references them as autograd leaves, for their shapes only."""
        if ins.tensor is Tensor.W:
            for layer in ins.layer_range:
                for t in self.table.get(("W", layer), ins).values():
                    t.untyped_storage().resize_(0)

    # -- handlers: compute -------------------------------------------------------------------------------
    def _forward(self, ins: Instr, e: Effects) -> dict:
        """Roughly: ``device[X(b+1)] = layers[a..b](device[X(a)])`` without autograd; with tensor
        sA, with autograd, keeping the graph and moving its saved tensors to the host."""
        x = self.table.get(e.reads[0], ins)
        a, b = ins.layers
        if ins.tensor is not Tensor.SA:
            with torch.no_grad(), self._autocast():
                return {e.allocs[0]: self._chain(a, b, x, ins)}
        weights, names = self._leaves(a, b, ins)
        hooks = Offload({w.untyped_storage().data_ptr(): n for w, n in zip(weights, names)}, x.device,
                        self.streams.streams.get(Stream.SWAP_OUT), timed=self.tracer is not None)
        leaf = self._input_leaf(x, a, copy=True)
        with torch.enable_grad(), saved_tensors_hooks(hooks.pack, hooks.unpack), self._autocast():
            y = self._chain(a, b, inner_view(leaf), ins)
        graph = PackGraph(y, [leaf] + weights, names, saved=hooks.saved, copied=hooks.copied())
        out = sum(nbytes(s.host) for s in hooks.saved)
        self.moved["d2h"] += out
        copies = ins.replace(id=-1 - ins.id, kind=Kind.SWAP_OUT, stream=Stream.SWAP_OUT)
        if hooks.started is not None and graph.copied is not None:     # traced as a swap-out of sA
            self.tracer.bytes[copies.id] = out
            self.tracer.gpu(copies, hooks.started, graph.copied)
        elif hooks.inline_s:        # copied in line: traced as a swap-out of sA after the forward
            self.tracer.bytes[copies.id] = out
            self._inline_out = (copies, out, hooks.inline_s)
        hooks.graph = graph
        if leaf.untyped_storage().data_ptr() != y.untyped_storage().data_ptr():
            leaf.untyped_storage().resize_(0)
        self.kept[(a, b, ins.offset, ins.size)] = graph
        return {e.allocs[0]: y.detach()}

    def _recompute(self, ins: Instr, e: Effects) -> dict:
        """Roughly: ``device[G] = graph of layers[a..b](device[sX(a)])``; the loss pack ends with
        ``loss(out, targets) * size / batch``, so gradients are those of the minibatch mean."""
        a, b = ins.layers
        x = self.table.get(e.reads[0], ins)
        weights, names = self._leaves(a, b, ins)
        leaf = self._input_leaf(x, a, copy=False)
        # what the table holds already (weights, frozen or not, buffers, the input) is not counted again
        held = [t for l in range(a, b + 1) for k in ("W", "B") for t in self.table.get((k, l), ins).values()]
        count = CountSaved({t.untyped_storage().data_ptr() for t in held + [x]}, self.table.granularity)
        with torch.enable_grad(), saved_tensors_hooks(count.pack, count.unpack), self._autocast():
            y = self._chain(a, b, inner_view(leaf), ins)
            if b == self.R - 1:
                targets = self.table.get(("T", ins.offset, ins.size), ins)
                loss = run_layer(self.layers[b], self._state(b, ins), (y, targets), None, self.device)
                if loss.dim() != 0:
                    raise ProgramError(f"the loss layer {b} ({type(self.layers[b]).__name__}) returned shape "
                                       f"{tuple(loss.shape)}; it must return the mean loss as a scalar")
                y = loss * (ins.size / self.program.batch)
                self._loss += y.detach().double()
        return {e.allocs[0]: PackGraph(y, [leaf] + weights, names, saved_bytes=count.bytes)}

    def _backward(self, ins: Instr, e: Effects) -> dict:
        """Roughly: ``dX, dW_mb = grad(G, [input, weights], dY)``; ``dW = dW_mb`` on the first
        microbatch of the pack, ``dW += dW_mb`` after."""
        a, b = ins.layers
        graph: PackGraph = self.table.get(e.reads[0], ins)
        if graph.saved is not None:
            graph.weights = lambda layer, n: self.table.get(("W", layer), ins)[n]
        dy = self.table.get(e.reads[-1], ins) if b < self.R - 1 else None
        grads = graph.gradients(dy)
        out = {}
        if a > 0:
            x = graph.inputs[0]
            dx = grads[0]
            out[("dX", a, ins.offset, ins.size)] = dx if dx is not None else torch.zeros(
                x.shape, dtype=x.dtype if x.is_floating_point() else torch.float32, device=self.device)
        first = ins.mb == 0
        acc = {layer: ({} if first else self.table.get(("dW", layer), ins)) for layer in ins.layer_range}
        for (layer, n), g, w in zip(graph.params, grads[1:], graph.inputs[1:]):
            g = torch.zeros(w.shape, dtype=w.dtype, device=self.device) if g is None else g
            if first:
                acc[layer][n] = g
            else:
                acc[layer][n].add_(g)
        if first:
            out.update({("dW", layer): acc[layer] for layer in ins.layer_range})
        return out

    def _all_reduce(self, ins: Instr, e: Effects) -> None:
        """Roughly: ``dW = sum over ranks of dW`` (vDP)."""
        self.comm.all_reduce([g for layer in ins.layer_range for g in self.table.get(("dW", layer), ins).values()])

    def _update(self, ins: Instr, e: Effects) -> None:
        """Roughly: ``optimizer[pack].step()``: on the CPU worker thread over the host weights
        (stream cpu), or on the device over the swapped-in weights and state (stream compute)."""
        if ins.stream is Stream.CPU and self.deferred is not None:
            self.deferred.append(ins.layers)
            return
        if ins.stream is Stream.CPU:
            # a tied parameter's owner also waits for the other copies' dW (runtime.tied)
            deps = (*ins.waits_on, *self.optim.ties.waits.get(ins.id, ()))
            events = [self.streams.events[w] for w in deps if w in self.streams.events]

            def step():
                for ev in events:
                    ev.synchronize()
                t_start = time.perf_counter()
                self.optim.step_host(ins.layers)
                if self.tracer:
                    self.tracer.wall(ins, t_start, time.perf_counter())

            self._pending[ins.id] = self.pool.submit(step)
            return
        layers = ins.layer_range
        self.optim.step_device(ins.layers, {l: self.table.get(("W", l), ins) for l in layers},
                               {l: self.table.get(("dW", l), ins) for l in layers},
                               {l: self.table.get(("K", l), ins) for l in layers})


_HANDLERS = {
    Kind.SWAP_IN: Executor._swap_in,
    Kind.SWAP_OUT: Executor._swap_out,
    Kind.SEND: Executor._send,
    Kind.RECV: Executor._recv,
    Kind.FREE: Executor._free,
    Kind.FWD: Executor._forward,
    Kind.REC: Executor._recompute,
    Kind.BWD: Executor._backward,
    Kind.ALL_REDUCE: Executor._all_reduce,
    Kind.UPD: Executor._update,
}
