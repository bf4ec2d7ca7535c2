"""The Program: per GPU rank, the ordered instruction list the runtime executes.

A Program is what :func:`harmony_opt.compile.compiler.compile_plan` lowers a Plan into and what
``runtime.Executor`` runs, one iteration at a time. Each instruction names its kind, the
layers it touches, its microbatch (index, first sample, size), the tensor it moves or
makes, the stream it runs on, its bytes, the instructions it waits on (ids on the same
rank) and, for a send or receive, the peer rank and the message tag::

    12:IW[4-7]@i=1048576            swap in the weights of layers 4..7 on the swap-in stream
    13:RX[4-4]#0(0+2)@p>0.3<9       receive the input of layer 4, microbatch 0 (samples 0..1), from rank 0
    14:F[4-7]#0(0+2)@c<12,13        forward layers 4..7 on microbatch 0 once 12 and 13 are done
    15:SY[8-8]#0(0+2)@p>1.4<14      send the output (the input of layer 8) to rank 1, tag 4

Activations (X, Y, sX, dX, dY) are named by their *boundary*: the layer whose input
they are, or whose input's gradient they are. ``str(instr)`` and
:meth:`Instr.from_str` round-trip (one regex), and a Program is versioned JSON.

What each instruction reads, allocates, updates and frees on the device, and which
host buffers it reads and writes, is defined once, in :func:`effects`; the compiler
derives ``waits_on`` from it, the validator checks programs against it and the
executor keeps its device table by it, so the three cannot drift apart.

:func:`harmony_opt.compile.validate.validate_program` replays a Program without running it and raises
:class:`~harmony_opt.core.errors.ProgramError` naming the instruction (and printing the
schedule around it) when a tensor is used before it arrives, a send has no receive,
the ranks deadlock (under both the GPU stream semantics and the in-order CPU
semantics), or, with byte sizes known, memory would exceed a cap.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from collections import Counter
from enum import Enum
from pathlib import Path

from ..core.errors import ProgramError
from ..core.io import atomic_write_text, read_json
from ..core.kinds import Tensor
from ..core.units import alloc_bytes

PROGRAM_VERSION = 1


class Kind(str, Enum):
    """Instruction kinds; the values are the one-letter codes of the compact form."""

    SWAP_IN = "I"       # host -> device
    SWAP_OUT = "O"      # device -> host
    SEND = "S"          # device -> peer rank (must be paired with its RECV)
    RECV = "R"          # peer rank -> device
    FWD = "F"           # forward of a sub-pack, no autograd (or, tensor sA, autograd with saved tensors to host)
    REC = "C"           # recompute: forward with autograd, keeping the graph for BWD
    BWD = "B"           # backward of a pack on one microbatch, accumulating dW
    UPD = "U"           # optimizer step of a pack (stream cpu: on the host; stream compute: on the device)
    ALL_REDUCE = "A"    # sum dW over all ranks (vDP)
    FREE = "D"          # drop a device tensor


class Stream(str, Enum):
    """The streams of a rank the runtime runs instructions on (Harmony's simulated streams are
    :class:`harmony_opt.harmony.Stream`)."""

    COMPUTE = "compute"
    SWAP_IN = "swap_in"
    SWAP_OUT = "swap_out"
    P2P = "p2p"
    CPU = "cpu"


STREAM_CODES = {Stream.COMPUTE: "c", Stream.SWAP_IN: "i", Stream.SWAP_OUT: "o", Stream.P2P: "p", Stream.CPU: "u"}
_CODE_STREAMS = {v: k for k, v in STREAM_CODES.items()}

#: Which stream each kind may run on.
ALLOWED_STREAMS = {
    Kind.SWAP_IN: {Stream.SWAP_IN}, Kind.SWAP_OUT: {Stream.SWAP_OUT},
    Kind.SEND: {Stream.P2P}, Kind.RECV: {Stream.P2P},
    Kind.FWD: {Stream.COMPUTE}, Kind.REC: {Stream.COMPUTE}, Kind.BWD: {Stream.COMPUTE},
    Kind.UPD: {Stream.CPU, Stream.COMPUTE}, Kind.ALL_REDUCE: {Stream.COMPUTE},
    Kind.FREE: set(Stream),
}

#: Tensors whose instructions carry a microbatch (index, first sample, size).
ROW_TENSORS = {Tensor.X, Tensor.Y, Tensor.DX, Tensor.DY, Tensor.T, Tensor.SX, Tensor.SA}
#: Tensors each kind may move or make (None: no tensor field).
ALLOWED_TENSORS = {
    Kind.SWAP_IN: {Tensor.W, Tensor.B, Tensor.K, Tensor.X, Tensor.SX, Tensor.DY, Tensor.T, Tensor.SA},
    Kind.SWAP_OUT: {Tensor.W, Tensor.B, Tensor.K, Tensor.DW, Tensor.X, Tensor.Y, Tensor.SX, Tensor.DX, Tensor.DY},
    Kind.SEND: {Tensor.Y, Tensor.X, Tensor.SX, Tensor.DX},
    Kind.RECV: {Tensor.X, Tensor.SX, Tensor.DY},
    Kind.FWD: {None, Tensor.SA}, Kind.REC: {None}, Kind.BWD: {None, Tensor.SA},
    Kind.UPD: {None}, Kind.ALL_REDUCE: {Tensor.DW},
    Kind.FREE: set(Tensor),
}
#: Message channels: a send and its receive must pair up in the same order on each (src, dst, channel).
CHANNELS = {Tensor.X: "act", Tensor.Y: "act", Tensor.SX: "stash", Tensor.DX: "grad", Tensor.DY: "grad"}


@dataclasses.dataclass(frozen=True, slots=True)
class Instr:
    """One instruction of one rank. ``waits_on`` holds ids of earlier instructions of the same rank."""

    id: int
    kind: Kind
    layers: tuple[int, int]
    stream: Stream
    tensor: Tensor | None = None
    mb: int | None = None           # microbatch index within its task
    offset: int | None = None       # first sample of the microbatch, within the rank's samples
    size: int | None = None         # samples in the microbatch
    bytes: int = 0                  # bytes moved (transfers) or allocated (compute); 0 when unknown
    waits_on: tuple[int, ...] = ()
    peer: int | None = None         # SEND/RECV: the other rank
    tag: int | None = None          # SEND/RECV: the message, the same on both sides

    @property
    def rows(self) -> tuple[int, int] | None:
        return None if self.offset is None else (self.offset, self.size)

    @property
    def layer_range(self) -> range:
        return range(self.layers[0], self.layers[1] + 1)

    def replace(self, **kw) -> "Instr":
        return dataclasses.replace(self, **kw)

    def __str__(self) -> str:
        s = f"{self.id}:{self.kind.value}{self.tensor.value if self.tensor else ''}[{self.layers[0]}-{self.layers[1]}]"
        if self.mb is not None:
            s += f"#{self.mb}({self.offset}+{self.size})"
        s += f"@{STREAM_CODES[self.stream]}"
        if self.peer is not None:
            s += f">{self.peer}.{self.tag}"
        if self.bytes:
            s += f"={self.bytes}"
        if self.waits_on:
            s += "<" + ",".join(map(str, self.waits_on))
        return s

    @classmethod
    def from_str(cls, text: str) -> "Instr":
        m = _INSTR_RE.match(text.strip())
        if not m:
            raise ProgramError(f"cannot read instruction {text!r}; expected e.g. 14:F[4-7]#0(0+2)@c<12,13")
        g = m.groupdict()
        opt = lambda k: None if g[k] is None else int(g[k])  # noqa: E731
        return cls(id=int(g["id"]), kind=Kind(g["kind"]), layers=(int(g["a"]), int(g["b"])),
                   stream=_CODE_STREAMS[g["stream"]], tensor=Tensor(g["tensor"]) if g["tensor"] else None,
                   mb=opt("mb"), offset=opt("off"), size=opt("size"), bytes=opt("bytes") or 0,
                   waits_on=tuple(int(x) for x in g["waits"].split(",")) if g["waits"] else (),
                   peer=opt("peer"), tag=opt("tag"))

    # -- JSON -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        d = {"id": self.id, "kind": self.kind.value, "layers": list(self.layers), "stream": self.stream.value}
        for k in ("mb", "offset", "size", "peer", "tag"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.tensor is not None:
            d["tensor"] = self.tensor.value
        if self.bytes:
            d["bytes"] = self.bytes
        if self.waits_on:
            d["waits_on"] = list(self.waits_on)
        return d

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "Instr":
        try:
            layers = d["layers"]
            if not (isinstance(layers, list) and len(layers) == 2 and all(isinstance(x, int) for x in layers)):
                raise ProgramError(f"{where}: field layers must be [first, last], got {layers!r}")
            ints = {k: d.get(k) for k in ("mb", "offset", "size", "peer", "tag")}
            for k, v in ints.items():
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                    raise ProgramError(f"{where}: field {k} must be a whole number >= 0, got {v!r}")
            waits = d.get("waits_on", [])
            if not isinstance(waits, list) or not all(isinstance(x, int) for x in waits):
                raise ProgramError(f"{where}: field waits_on must be a list of instruction ids")
            return cls(id=int(d["id"]), kind=Kind(d["kind"]), layers=(layers[0], layers[1]),
                       stream=Stream(d["stream"]), tensor=Tensor(d["tensor"]) if d.get("tensor") else None,
                       bytes=int(d.get("bytes", 0)), waits_on=tuple(waits), **ints)
        except KeyError as e:
            raise ProgramError(f"{where}: missing field {e.args[0]}") from None
        except ValueError as e:
            raise ProgramError(f"{where}: {e}") from None


_INSTR_RE = re.compile(
    r"^(?P<id>\d+):(?P<kind>[IOSRFCBUAD])(?P<tensor>dX|dY|dW|sX|sA|W|B|X|Y|K|T)?\[(?P<a>\d+)-(?P<b>\d+)\]"
    r"(?:#(?P<mb>\d+)\((?P<off>\d+)\+(?P<size>\d+)\))?@(?P<stream>[ciopu])"
    r"(?:>(?P<peer>\d+)\.(?P<tag>\d+))?(?:=(?P<bytes>\d+))?(?:<(?P<waits>\d+(?:,\d+)*))?$")


# -- sizes --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class LayerBytes:
    """Byte sizes per layer, enough to price every device tensor of a Program.

    ``input[l]``: bytes per sample of layer ``l``'s input (its gradient has the same
    size); ``saved[l]``: bytes per sample autograd keeps for layer ``l``'s backward,
    ``saved_storage[l]`` the same with each storage once, ``saved_input[l]`` and
    ``saved_output[l]`` how many of those are the layer's own input and output (empty: not
    known; a recompute is then priced as saved);
    ``target``: bytes per sample of the targets; ``saved_fixed[l]``: bytes layer ``l``'s graph saves
    once per microbatch whatever its size (under bf16 autocast, the bf16 copies of its weights;
    empty: none), on top of ``saved`` and ``saved_storage`` per sample.

    ``granularity``: what the device's allocator rounds each tensor up to (512 on CUDA,
    :func:`~harmony_opt.core.units.alloc_granularity`); above 1, :meth:`alloc_bytes` adds the
    rounding: ``weights_pad``, ``buffers_pad`` and ``optimizer_pad`` per layer (what rounding
    adds to its weights, buffers, optimizer state: exact when measured on the model, an upper
    bound from a profile's tensor counts), an activation or target rounded as the one tensor it
    is, and ``granularity - 1`` for each of the ``saved_tensors[l]`` tensors a saved graph holds
    per layer (an upper bound: their sizes scale with the microbatch; under bf16 the weight copies
    of ``saved_fixed`` are among them).
    """

    weights: tuple[int, ...]
    buffers: tuple[int, ...]
    optimizer: tuple[int, ...]
    input: tuple[float, ...]
    saved: tuple[float, ...]
    target: float = 0.0
    saved_storage: tuple[float, ...] = ()
    saved_input: tuple[float, ...] = ()
    saved_output: tuple[float, ...] = ()
    granularity: int = 1
    weights_pad: tuple[int, ...] = ()
    buffers_pad: tuple[int, ...] = ()
    optimizer_pad: tuple[int, ...] = ()
    saved_tensors: tuple[int, ...] = ()
    saved_fixed: tuple[float, ...] = ()

    def __post_init__(self):
        n = len(self.weights)
        if isinstance(self.granularity, bool) or not isinstance(self.granularity, int) or self.granularity < 1:
            raise ProgramError(f"layer bytes: granularity must be a whole number >= 1, got {self.granularity!r}")
        if any(len(getattr(self, f)) not in (0, n) for f in ("weights_pad", "buffers_pad", "optimizer_pad",
                                                                  "saved_tensors", "saved_fixed")):
            raise ProgramError("layer bytes: every per-layer list must have one entry per layer")
        if any(len(getattr(self, f)) != n for f in ("buffers", "optimizer", "input", "saved")) or \
                len(self.saved_input) not in (0, n) or len({len(self.saved_storage), len(self.saved_input), len(self.saved_output)}) > 1:
            raise ProgramError("layer bytes: every per-layer list must have one entry per layer")

    @property
    def num_layers(self) -> int:
        return len(self.weights)

    @classmethod
    def from_profile(cls, profile, u: int, granularity: int | None = None) -> "LayerBytes":
        """Sizes from a Profile at microbatch ``u`` (per-sample activations scale linearly; a bf16
        profile's weight copies, ``cast_bytes``, are taken out of the saved bytes as once per microbatch),
        rounded to ``granularity`` (default: the profile's ``alloc_granularity``) from its tensor counts
        (the weight copies are among the ``saved_tensors``)."""
        lay = profile.layers.sort_values("layer")
        bwd = profile.costs("BWD", u)
        rec = profile.recompute_saved_at(u)
        g = profile.alloc_granularity if granularity is None else granularity
        cast = [float(x) for x in profile.cast_bytes()]
        fixed = {"saved_fixed": tuple(cast)} if any(cast) else {}
        per = {} if rec is None else {f: tuple(float(x) / u for x in col) for f, col in
                                      zip(("saved_storage", "saved_input", "saved_output"), rec)}
        if fixed and per:
            per["saved_storage"] = tuple((float(x) - c) / u for x, c in zip(rec[0], cast))
        return cls(**profile.alloc_pads(g),
                   weights=tuple(int(x) for x in lay["param_bytes"]),
                   buffers=tuple(int(x) for x in lay["buffer_bytes"]),
                   optimizer=tuple(int(x) for x in lay["optimizer_state_bytes"]),
                   input=tuple(float(x) / u for x in profile.input_bytes_at(u)),
                   saved=tuple((float(x) - c) / u for x, c in zip(bwd.saved[:profile.num_layers], cast)),
                   target=float(profile.meta.get("target_bytes_per_sample", 0.0)), **per, **fixed)

    def key_bytes(self, key: tuple) -> int:
        """Bytes of one device tensor named by a key of :func:`effects`."""
        kind = key[0]
        if kind in ("W", "dW"):
            return self.weights[key[1]]
        if kind == "B":
            return self.buffers[key[1]]
        if kind == "K":
            return self.optimizer[key[1]]
        if kind in ("X", "sX", "dX"):
            return int(self.input[key[1]] * key[3])
        if kind == "T":
            return int(self.target * key[2])
        if kind == "G":
            return int(sum(self.saved[key[1]:key[2] + 1]) * key[4] + sum(self.saved_fixed[key[1]:key[2] + 1]))
        raise ProgramError(f"unknown device tensor {key!r}")

    def tensor_bytes(self, ins: "Instr", key: tuple) -> int:
        """Exact bytes of the tensors ``ins`` allocates for ``key`` (what a transfer of them moves). A
        recompute's graph keeps each storage once and holds the pack's input by reference, not
        again (the input is live on its own, as X or sX)."""
        if ins.kind is Kind.REC and key[0] == "G" and self.saved_input:
            a, b = key[1], key[2]
            shared = sum(min(self.saved_output[l - 1], self.saved_input[l]) for l in range(a + 1, b + 1))
            return int((sum(self.saved_storage[a:b + 1]) - self.saved_input[a] - shared) * key[4]
                       + sum(self.saved_fixed[a:b + 1]))
        return self.key_bytes(key)

    def alloc_bytes(self, ins: "Instr", key: tuple) -> int:
        """Bytes ``ins`` holds on the device for ``key``: :meth:`tensor_bytes` with each tensor
        rounded up to the allocator's ``granularity`` (see the class docstring)."""
        n = self.tensor_bytes(ins, key)
        g, kind = self.granularity, key[0]
        if g <= 1:
            return n
        if kind in ("X", "sX", "dX", "T"):
            return alloc_bytes(n, g)
        pad = {"W": self.weights_pad, "dW": self.weights_pad, "B": self.buffers_pad, "K": self.optimizer_pad}.get(kind)
        if pad is not None:
            return n + (pad[key[1]] if pad else 0)
        if kind == "G" and self.saved_tensors:
            a, b = key[1], key[2]
            count = sum(self.saved_tensors[a:b + 1])
            if ins.kind is Kind.REC and self.saved_input:     # the storages tensor_bytes leaves out
                count -= (self.saved_input[a] > 0) + sum(min(self.saved_output[l - 1], self.saved_input[l]) > 0
                                                         for l in range(a + 1, b + 1))
            return n + (g - 1) * max(int(count), 0)
        return n

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if not self.saved_fixed:        # fp32: the programs' JSON as it has always been
            del d["saved_fixed"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LayerBytes":
        try:
            return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})
        except TypeError as e:
            raise ProgramError(f"layer_bytes: {e}") from None


# -- effects: the one definition of what an instruction touches ----------------------------------

Key = tuple
HostRef = tuple  # (buffer, rows or None); buffer e.g. ("X", 4); rows (first, size)

#: Host buffers that hold valid data when an iteration starts (data, targets, model state).
INITIAL_HOST = {"W", "B", "K", "T", "data"}


@dataclasses.dataclass(frozen=True)
class Effects:
    reads: tuple[Key, ...] = ()
    allocs: tuple[Key, ...] = ()
    updates: tuple[Key, ...] = ()       # in-place writes of a live tensor
    frees: tuple[Key, ...] = ()
    host_reads: tuple[HostRef, ...] = ()
    host_writes: tuple[HostRef, ...] = ()


def _per_layer(kind: str, ins: Instr) -> tuple[Key, ...]:
    return tuple((kind, l) for l in ins.layer_range)


def _host_per_layer(kind: str, ins: Instr) -> tuple[HostRef, ...]:
    return tuple(((kind, l), None) for l in ins.layer_range)


#: One device key per boundary for a pack's output and the next pack's input (Y is X, dY is dX), so a
#: tensor handed on within one GPU (Plan.gpu_handoff) is read where it was written.
_DEVICE_NAME = {Tensor.Y: "X", Tensor.DY: "dX"}


def _act(kind: str, layer: int, ins: Instr) -> Key:
    return (kind, layer, ins.offset, ins.size)


def _host_act(kind: str, layer: int) -> tuple:
    """Host buffer of an activation; layer 0's input is the data itself."""
    return ("data",) if layer == 0 and kind in ("X", "sX") else (kind, layer)


@functools.lru_cache(maxsize=1 << 17)        # ranks and passes ask for the same instructions' effects
def effects(ins: Instr, num_layers: int) -> Effects:
    """What ``ins`` reads, allocates, updates and frees on the device, and reads and writes on the host.

    Device keys: ``(W|B|K|dW, layer)``, ``(X|sX|dX, boundary, first, size)`` (Y is the next
    pack's X, dY the previous pack's dX), ``(T, first, size)`` and ``(G, a, b, first, size)``
    (a pack's autograd graph).
    """
    k, t, (a, b) = ins.kind, ins.tensor, ins.layers
    rows = ins.rows
    last = num_layers - 1
    if k is Kind.SWAP_IN:
        if t in (Tensor.W, Tensor.B, Tensor.K):
            return Effects(allocs=_per_layer(t.value, ins), host_reads=_host_per_layer(t.value, ins))
        if t is Tensor.T:
            return Effects(allocs=(("T",) + rows,), host_reads=((("T",), rows),))
        if t is Tensor.SA:
            return Effects(allocs=(("G", a, b) + rows,), host_reads=((("sA", a), rows),))
        if t is Tensor.DY:
            return Effects(allocs=(_act("dX", a, ins),), host_reads=((("dX", a), rows),))
        return Effects(allocs=(_act(t.value, a, ins),), host_reads=((_host_act(t.value, a), rows),))
    if k is Kind.SWAP_OUT:
        if t is Tensor.DW and ins.mb:       # a later naive-swap sweep adds to the host gradients
            return Effects(reads=_per_layer("dW", ins), host_reads=_host_per_layer("dW", ins),
                           host_writes=_host_per_layer("dW", ins))
        if t in (Tensor.W, Tensor.B, Tensor.K, Tensor.DW):
            return Effects(reads=_per_layer(t.value, ins), host_writes=_host_per_layer(t.value, ins))
        if t in (Tensor.DX, Tensor.DY):
            return Effects(reads=(_act("dX", a, ins),), host_writes=((("dX", a), rows),))
        return Effects(reads=(_act("X", a, ins),), host_writes=(((("sX" if t is Tensor.SX else "X"), a), rows),))
    if k is Kind.SEND:
        return Effects(reads=(_act("dX" if t is Tensor.DX else "X", a, ins),))
    if k is Kind.RECV:
        return Effects(allocs=(_act("dX" if t is Tensor.DY else "X", a, ins),))
    if k is Kind.FWD:
        host = ((("sA", a), rows),) if t is Tensor.SA else ()
        return Effects(reads=(_act("X", a, ins),) + _per_layer("W", ins), allocs=(_act("X", b + 1, ins),),
                       updates=_per_layer("B", ins), host_writes=host)
    if k is Kind.REC:
        crit = b == last
        reads = (_act("X" if crit else "sX", a, ins),) + _per_layer("W", ins) + ((("T",) + rows,) if crit else ())
        return Effects(reads=reads, allocs=(("G", a, b) + rows,), updates=_per_layer("B", ins))
    if k is Kind.BWD:
        reads = (("G", a, b) + rows,) + _per_layer("W", ins) + ((_act("dX", b + 1, ins),) if b < last else ())
        dx = (_act("dX", a, ins),) if a > 0 else ()
        dw = _per_layer("dW", ins)
        return Effects(reads=reads, allocs=dx + (dw if ins.mb == 0 else ()), updates=() if ins.mb == 0 else dw)
    if k is Kind.ALL_REDUCE:
        return Effects(updates=_per_layer("dW", ins))
    if k is Kind.UPD:
        if ins.stream is Stream.CPU:
            return Effects(host_reads=_host_per_layer("dW", ins),
                           host_writes=_host_per_layer("W", ins) + _host_per_layer("K", ins))
        return Effects(reads=_per_layer("dW", ins), updates=_per_layer("W", ins) + _per_layer("K", ins))
    if k is Kind.FREE:
        if t in (Tensor.W, Tensor.B, Tensor.K, Tensor.DW):
            return Effects(frees=_per_layer(t.value, ins))
        if t is Tensor.SA:
            return Effects(frees=(("G", a, b) + rows,))
        if t is Tensor.T:
            return Effects(frees=(("T",) + rows,))
        return Effects(frees=(_act(_DEVICE_NAME.get(t, t.value), a, ins),))
    raise ProgramError(f"instruction {ins}: unknown kind {k!r}")


def trace_name(ins: Instr) -> tuple[str, str, int]:
    """(kind, pack, microbatch) under which a trace names ``ins``, in the simulator's vocabulary where
    it has one (:mod:`harmony_opt.sim.matching`): a copy by its tensor, a pack as "first-last", a
    whole-pack instruction as microbatch -1."""
    kind = ins.tensor.value if ins.kind in (Kind.SWAP_IN, Kind.SWAP_OUT, Kind.SEND, Kind.RECV) else ins.kind.name
    return kind, f"{ins.layers[0]}-{ins.layers[1]}", -1 if ins.mb is None else ins.mb


def channel(ins: Instr, rank: int) -> tuple[int, int, str]:
    """The (source, destination, class) queue a SEND or RECV belongs to."""
    src, dst = (rank, ins.peer) if ins.kind is Kind.SEND else (ins.peer, rank)
    return (src, dst, CHANNELS[ins.tensor])


def replay_memory(instrs, num_layers: int, sizes: LayerBytes, cap: int | None = None) -> tuple[int, tuple | None]:
    """Live device bytes of one rank's instructions in issue order (what the caching allocator sees):
    the peak, and (index, bytes) of the first instruction over ``cap`` (None if none)."""
    live, peak, held, over = 0, 0, {}, None
    for i, x in enumerate(instrs):
        e = effects(x, num_layers)
        for k in e.allocs:
            held[k] = sizes.alloc_bytes(x, k)
            live += held[k]
        peak = max(peak, live)
        if cap is not None and live > cap and over is None:
            over = (i, live)
        for k in e.frees:
            live -= held.pop(k, 0)
    return peak, over


# -- the Program ----------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Program:
    """Per rank (0..gpus-1) the instruction list of one training iteration."""

    ranks: tuple[tuple[Instr, ...], ...]
    num_layers: int
    mode: str
    batch: int                          # minibatch size (loss scaling divides by it)
    samples: tuple[int, ...]            # samples each rank processes per iteration
    sample_offsets: tuple[int, ...]     # each rank's first sample within the minibatch
    plan_identity: str = ""
    layer_bytes: LayerBytes | None = None
    notes: tuple[str, ...] = ()
    version: int = PROGRAM_VERSION

    @property
    def gpus(self) -> int:
        return len(self.ranks)

    def __str__(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(map(str, ins)) for r, ins in enumerate(self.ranks))

    def counts(self, rank: int | None = None) -> Counter:
        """Instruction counts by compact code (``IW``, ``F``, ``SY``, ...), over one or all ranks."""
        ranks = range(self.gpus) if rank is None else [rank]
        return Counter(f"{i.kind.value}{i.tensor.value if i.tensor else ''}" for r in ranks for i in self.ranks[r])

    # -- JSON -------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"version": self.version, "mode": self.mode, "num_layers": self.num_layers, "batch": self.batch,
                "samples": list(self.samples), "sample_offsets": list(self.sample_offsets),
                "plan_identity": self.plan_identity, "notes": list(self.notes),
                "layer_bytes": self.layer_bytes.to_dict() if self.layer_bytes else None,
                "ranks": [[i.to_dict() for i in ins] for ins in self.ranks]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def save(self, path: str | Path) -> Path:
        return atomic_write_text(path, self.to_json())

    @classmethod
    def from_dict(cls, d: dict, source: str = "program") -> "Program":
        if not isinstance(d, dict):
            raise ProgramError(f"{source}: a program is a JSON object")
        if d.get("version") != PROGRAM_VERSION:
            raise ProgramError(f"{source}: field version {d.get('version')!r} is not supported "
                               f"(this tool reads {PROGRAM_VERSION})")
        try:
            ranks = tuple(tuple(Instr.from_dict(x, f"{source}: ranks[{r}][{i}]") for i, x in enumerate(ins))
                          for r, ins in enumerate(d["ranks"]))
            lb = d.get("layer_bytes")
            return cls(ranks=ranks, num_layers=int(d["num_layers"]), mode=str(d["mode"]), batch=int(d["batch"]),
                       samples=tuple(d["samples"]), sample_offsets=tuple(d["sample_offsets"]),
                       plan_identity=str(d.get("plan_identity", "")), notes=tuple(d.get("notes", ())),
                       layer_bytes=LayerBytes.from_dict(lb) if lb else None)
        except KeyError as e:
            raise ProgramError(f"{source}: missing field {e.args[0]}") from None
        except TypeError as e:
            raise ProgramError(f"{source}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> "Program":
        path = Path(path)
        d = read_json(path, "program file", ProgramError, "give the program JSON that `harmony-opt compile` wrote")
        return cls.from_dict(d, str(path))


def plan_identity(plan) -> str:
    """Hash of what fixes a Program: mode, GPUs, batch, microbatches, packs, options, layers."""
    d = plan.to_dict()
    core = {k: d[k] for k in ("mode", "gpus", "batch", "microbatch", "packs", "options", "num_layers", "prefetch")}
    if plan.gpu_handoff:        # only when set, so the programs of earlier plans keep their identity
        core["gpu_handoff"] = True
    if plan.transfer_order is not None:
        core["transfer_order"] = d["transfer_order"]
    return hashlib.sha256(json.dumps(core, sort_keys=True).encode()).hexdigest()[:16]
