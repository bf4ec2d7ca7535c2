"""The Plan: what every planner returns and every simulator, compiler and runtime consumes.

A plan fixes the execution mode (vPP: packs dealt round-robin over the GPUs like a
pipeline; vDP: every GPU runs every pack on its share of the minibatch), the number
of GPUs, the forward and backward microbatch sizes, and the forward and backward
layer packs (inclusive ``[first, last]`` ranges). As in Harmony, the forward packs cover
layers ``0 .. first(last backward pack) - 1``: the last backward pack holds the loss
and runs its own forward as its recompute; when the whole model is one backward pack
the forward packs are empty.

Per backward pack, ``options`` choose recompute (keep only the pack's input from the
forward, recompute the rest) or stash (keep every activation the backward needs, in
host memory), and whether the optimizer step runs on the CPU or on the GPU.

``gpu_handoff`` (off by default, and off in Harmony's plans): the activation gradient passed
between two consecutive backward packs on one GPU stays on that GPU when both run the same
single microbatch, instead of Harmony's round trip through host memory (swapped out by one
pack and back in by the next). With several microbatches the producer's whole group would
have to stay resident, so those still go through host memory. Forward activations always do:
a forward pack holds its memory until its stashed inputs have left for host memory, so
starting the next pack earlier only makes the one after wait for memory (measured on vgg416).

``transfer_order`` (none by default, and none in Harmony's plans): per GPU, the order in which
its activation swap-ins (``swap_in``) and swap-outs (``swap_out``) run, where it is not
Harmony's rule (the task order, microbatch by microbatch). The planner's timeline model
chooses it (solver_models/event_schedule.py); the simulator plays it and the compiler issues the
transfers in it. The transfers an order names take the places the named ones held in their
stream, in its order; those it does not name keep theirs. Each transfer is named by
:func:`transfer_key`: ``Y[12]@8+8`` is the output activation of layer 11 (input of 12) for the
8 samples from sample 8 of the GPU's share. The
``free`` stream, the simulator's bookkeeping of when a task's memory is released, may be ordered
too (keys ``F[0-3]@0``: the task's name).

Plans are JSON with a ``version`` field (``to_json`` / ``from_json``); loading checks
every field and names the one that is wrong.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from .errors import PlanError
from .io import atomic_write_text, read_json
from .precision import PRECISIONS

PLAN_VERSION = 1
MODES = ("vPP", "vDP")
OPTIMIZER_PLACES = ("cpu", "gpu")
#: The streams whose order a plan may carry (``Plan.transfer_order``)
ORDERED_STREAMS = ("swap_in", "swap_out", "free")

Pack = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class PackOptions:
    """Choices for one backward pack."""

    recompute: bool = True      # False: stash the pack's activations during the forward instead
    optimizer: str = "cpu"      # "cpu": dW to host, step on the CPU; "gpu": step on the GPU

    def to_dict(self) -> dict:
        return {"recompute": self.recompute, "optimizer": self.optimizer}


DEFAULT_OPTIONS = PackOptions()


def backward_instructions(recompute: bool) -> int:
    """Instructions the executor issues per microbatch of a backward pack (each pays the hardware's
    ``issue_overhead_s``): its recompute and its backward, or the backward alone (a stash)."""
    return 2 if recompute else 1


def forward_instructions(packs_fwd, packs_bwd) -> dict[tuple[int, int], int]:
    """Per forward pack [a, b], the instructions the executor issues per microbatch: one per piece, the
    compiler cutting the pack at the first layer of every backward pack inside it (where that pack's
    input or saved activations leave for its backward). Once per plan, by binary search: the
    simulator asks for every forward task."""
    starts = sorted(x for x, _ in packs_bwd)
    return {(a, b): 1 + bisect.bisect_right(starts, b) - bisect.bisect_right(starts, a) for a, b in packs_fwd}


def transfer_key(tensor: str, layer: int, offset: int, size: int) -> str:
    """The name of one transfer in ``Plan.transfer_order``: ``Y[12]@8+8``, tensor Y at layer 12, the
    microbatch of 8 samples from sample 8 of its GPU's share (whole-pack transfers: ``dW[4]@0+0``)."""
    return f"{tensor}[{layer}]@{offset}+{size}"


#: One stream's order in ``Plan.transfer_order``: (rank, stream, the transfers' keys in order)
StreamOrder = tuple[int, str, tuple[str, ...]]


def in_order(items: list, name, keys: tuple[str, ...]) -> list:
    """``items`` (one stream, in the rule's order) in a ``transfer_order`` stream's order: those ``keys``
    names (``name(item)``) take the places the named ones held, in its order; the rest keep theirs.
    The simulator and the compiler order their streams with it."""
    place = {k: p for p, k in enumerate(keys)}
    named = iter(sorted((x for x in items if name(x) in place), key=lambda x: place[name(x)]))
    return [next(named) if name(x) in place else x for x in items]


def split_microbatches(total: int, u: int) -> list[int]:
    """``[u] * (total // u)`` plus the remainder, if any (Harmony's ``ubatchszs``)."""
    if u < 1:
        raise PlanError(f"microbatch size must be >= 1, got {u}")
    return [u] * (total // u) + ([total % u] if total % u else [])


def data_shares(batch: int, gpus: int) -> list[int]:
    """Samples per GPU in vDP: ``floor(D/N)`` plus one for the first ``D % N`` GPUs."""
    return [batch // gpus + (1 if n < batch % gpus else 0) for n in range(gpus)]


@dataclasses.dataclass(frozen=True)
class Plan:
    planner: str
    mode: str
    gpus: int
    batch: int
    microbatch_fwd: int
    microbatch_bwd: int
    packs_fwd: tuple[Pack, ...]
    packs_bwd: tuple[Pack, ...]
    num_layers: int
    options: tuple[PackOptions, ...] = ()   # one per backward pack; empty means all defaults
    prefetch: bool = True
    input_batch_grouping: bool = True       # False: every microbatch sweeps all packs (naive swapping)
    allow_uneven: bool = False              # microbatch sizes need not divide the batch
    gpu_handoff: bool = False               # keep single-microbatch gradient handoffs on one GPU (keeps_on_gpu)
    transfer_order: tuple[StreamOrder, ...] | None = None   # None: Harmony's rule (see the module docstring)
    cost_model: str = "default"
    memory_cap: int | None = None
    # {"name", "identity"[, "precision"][, "path"]} (bundled.profile_ident)
    profile: dict = dataclasses.field(default_factory=dict)
    hardware: dict = dataclasses.field(default_factory=dict)   # Hardware.to_dict()
    simulated_iteration_time_s: float | None = None
    search_time_s: float | None = None
    solver: dict | None = None
    stats: dict = dataclasses.field(default_factory=dict)
    version: int = PLAN_VERSION

    def __post_init__(self):
        object.__setattr__(self, "packs_fwd", tuple(tuple(int(x) for x in p) for p in self.packs_fwd))
        object.__setattr__(self, "packs_bwd", tuple(tuple(int(x) for x in p) for p in self.packs_bwd))
        if not self.options:
            object.__setattr__(self, "options", tuple(DEFAULT_OPTIONS for _ in self.packs_bwd))
        if self.transfer_order is not None:
            object.__setattr__(self, "transfer_order", _stream_orders(self.transfer_order))
        self.validate()
        # the loss pack runs its forward as its recompute whatever its option says (compile.stash_modes):
        # the option says so, so that every reader charges what runs (the simulator charged a loss pack
        # without recompute only its backward from a kept graph, its forward nowhere)
        if not self.options[-1].recompute:
            object.__setattr__(self, "options", (*self.options[:-1],
                                                 dataclasses.replace(self.options[-1], recompute=True)))

    # -- derived ---------------------------------------------------------------------------
    @property
    def microbatch(self) -> dict:
        return {"fwd": self.microbatch_fwd, "bwd": self.microbatch_bwd}

    def samples_per_gpu(self) -> list[int]:
        """Samples each GPU processes per iteration (vPP: all of them pass every GPU)."""
        return [self.batch] * self.gpus if self.mode == "vPP" else data_shares(self.batch, self.gpus)

    def microbatches(self, phase: str, rank: int = 0) -> list[int]:
        """Microbatch sizes of a phase on a rank, in order."""
        u = self.microbatch_fwd if phase.upper() == "FWD" else self.microbatch_bwd
        return split_microbatches(self.samples_per_gpu()[rank], u)

    def keeps_on_gpu(self, sent, received) -> bool:
        """Whether a gradient handed between two consecutive backward tasks of one GPU, whose
        microbatch sizes are ``sent`` (producer) and ``received`` (consumer), stays on the GPU
        (see ``gpu_handoff``)."""
        return self.gpu_handoff and len(sent) == 1 and tuple(sent) == tuple(received)

    @property
    def precision(self) -> str:
        """The precision of the profile the plan was made from: the runtime's ("fp32" without the key)."""
        return (self.profile or {}).get("precision", "fp32")

    def option(self, bwd_index: int) -> PackOptions:
        return self.options[bwd_index]

    def replace(self, **kw) -> "Plan":
        return dataclasses.replace(self, **kw)

    # -- validation --------------------------------------------------------------------------
    def validate(self) -> "Plan":
        """Structural checks that need no profile: coverage, sizes, options."""
        if self.version != PLAN_VERSION:
            raise PlanError(f"plan field version: {self.version!r} is not supported (this tool reads {PLAN_VERSION})")
        if self.mode not in MODES:
            raise PlanError(f"plan field mode: {self.mode!r} is not one of {', '.join(MODES)}")
        for f in ("gpus", "batch", "microbatch_fwd", "microbatch_bwd", "num_layers"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"plan field {_json_name(f)}: must be a whole number >= 1, got {v!r}")
            if v > _MAX_COUNT:
                raise PlanError(f"plan field {_json_name(f)}: {v} is implausibly large (at most {_MAX_COUNT}); "
                                f"was the file edited by hand?")
        R = self.num_layers
        if not self.packs_bwd:
            raise PlanError("plan field packs.bwd: empty; the backward packs must cover every layer")
        _check_cover(self.packs_bwd, 0, R - 1, "packs.bwd")
        fwd_end = self.packs_bwd[-1][0] - 1
        if fwd_end < 0:
            if self.packs_fwd:
                raise PlanError("plan field packs.fwd: must be empty when one backward pack holds the whole model")
        else:
            if not self.packs_fwd:
                raise PlanError(f"plan field packs.fwd: empty; the forward packs must cover layers 0..{fwd_end} "
                                f"(up to the first layer of the last backward pack)")
            _check_cover(self.packs_fwd, 0, fwd_end, "packs.fwd")
        if len(self.options) != len(self.packs_bwd):
            raise PlanError(f"plan field options: {len(self.options)} entries for {len(self.packs_bwd)} backward packs")
        for i, o in enumerate(self.options):
            if not isinstance(o, PackOptions):
                raise PlanError(f"plan field options[{i}]: not a pack option")
            if o.optimizer not in OPTIMIZER_PLACES:
                raise PlanError(f"plan field options[{i}].optimizer: {o.optimizer!r} is not cpu or gpu")
            if not isinstance(o.recompute, bool):
                raise PlanError(f"plan field options[{i}].recompute: must be true or false")
        shares = self.samples_per_gpu()
        if min(shares) < 1:
            raise PlanError(f"plan: batch {self.batch} is smaller than the {self.gpus} GPUs of vDP; "
                            f"every GPU needs at least one sample")
        for phase, u in (("fwd", self.microbatch_fwd), ("bwd", self.microbatch_bwd)):
            if u > max(shares):
                raise PlanError(f"plan field microbatch.{phase}: {u} is larger than the {max(shares)} samples "
                                f"per GPU")
            if not self.allow_uneven and any(s % u for s in shares):
                raise PlanError(f"plan field microbatch.{phase}: {u} does not divide the {shares[0]} samples per "
                                f"GPU; choose a divisor or set allow_uneven (the last microbatch is then smaller)")
        if not self.input_batch_grouping and self.microbatch_fwd != self.microbatch_bwd:
            raise PlanError("plan field microbatch: without input-batch grouping every microbatch sweeps the "
                            "whole model, so fwd and bwd sizes must be equal")
        if not self.input_batch_grouping and any(o.optimizer == "gpu" for o in self.options):
            raise PlanError("plan field options: an optimizer step on the GPU needs input-batch grouping (without "
                            "it every microbatch sweep would step the weights: not synchronous SGD); use "
                            "optimizer \"cpu\" or set input_batch_grouping")
        if self.memory_cap is not None and (not isinstance(self.memory_cap, int) or self.memory_cap <= 0):
            raise PlanError(f"plan field memory_cap: must be a positive number of bytes, got {self.memory_cap!r}")
        seen = set()
        for i, (rank, stream, keys) in enumerate(self.transfer_order or ()):
            where = f"plan field transfer_order[{i}]"
            if not 0 <= rank < self.gpus:
                raise PlanError(f"{where}: rank {rank} is not one of the plan's {self.gpus} GPUs")
            if stream not in ORDERED_STREAMS:
                raise PlanError(f"{where}: stream {stream!r} is not one of {', '.join(ORDERED_STREAMS)}")
            if (rank, stream) in seen:
                raise PlanError(f"{where}: rank {rank} stream {stream} is ordered twice")
            seen.add((rank, stream))
            if len(set(keys)) != len(keys):
                dup = next(k for k in keys if keys.count(k) > 1)
                raise PlanError(f"{where}: transfer {dup} is named twice")
        return self

    def check_against(self, profile=None, hardware=None) -> "Plan":
        """Checks that need the profile or hardware: layer count, identity, GPU count, profiled sizes."""
        if profile is not None:
            if profile.num_layers != self.num_layers:
                raise PlanError(f"plan has {self.num_layers} layers but profile {profile.name} has "
                                f"{profile.num_layers}; the plan was made for another model")
            ident = self.profile.get("identity")
            if ident and ident != profile.identity:
                raise PlanError(f"plan was made for profile {self.profile.get('name')!r} ({ident}), not "
                                f"{profile.name!r} ({profile.identity}); re-plan with this profile")
            made = self.profile.get("precision", "fp32")
            if made != profile.precision:
                raise PlanError(f"plan was made from a profile measured in {made}, but profile {profile.name!r} was "
                                f"measured in {profile.precision}; re-plan with this profile")
            for phase, u in (("FWD", self.microbatch_fwd), ("BWD", self.microbatch_bwd)):
                if phase == "FWD" and not self.packs_fwd:
                    continue    # one backward pack runs its own forward: the FWD size is never looked up
                lo, hi = profile.size_range(phase)
                sizes = set(self.microbatches(phase, 0)) | set(self.microbatches(phase, self.gpus - 1))
                if min(sizes) < lo or max(sizes) > hi:
                    raise PlanError(f"plan field microbatch.{phase.lower()}: sizes {sorted(sizes)} are outside "
                                    f"the profiled {phase} range {lo}..{hi}")
        if hardware is not None and self.gpus > hardware.gpus:
            raise PlanError(f"plan field gpus: {self.gpus} GPUs but hardware {hardware.name!r} has "
                            f"{hardware.gpus}")
        if (hardware is not None and self.mode == "vDP" and self.gpus > 1 and hardware.servers_used(self.gpus) > 1
                and not hardware.can_allreduce(self.gpus)):
            raise PlanError(f"plan field mode: vDP on several servers all-reduces the gradients on GPU links, and "
                            f"hardware {hardware.name!r} has no GPU-to-GPU link inside a server (p2p_bandwidth); "
                            f"use vPP")
        if (hardware is not None and self.mode == "vDP" and self.gpus > 1 and not hardware.can_allreduce(self.gpus)
                and any(o.optimizer == "gpu" for o in self.options)):
            raise PlanError(f"plan field options: vDP replicas step the optimizer on their GPUs only after an "
                            f"all-reduce, and hardware {hardware.name!r} has no GPU-to-GPU link; use optimizer "
                            f"\"cpu\" (the CPU sums the replicas' gradients)")
        return self

    # -- JSON ----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {
            "version": self.version,
            "planner": self.planner,
            "mode": self.mode,
            "gpus": self.gpus,
            "batch": self.batch,
            "microbatch": {"fwd": self.microbatch_fwd, "bwd": self.microbatch_bwd},
            "packs": {"fwd": [list(p) for p in self.packs_fwd], "bwd": [list(p) for p in self.packs_bwd]},
            "options": [o.to_dict() for o in self.options],
            "num_layers": self.num_layers,
            "prefetch": self.prefetch,
            "input_batch_grouping": self.input_batch_grouping,
            "allow_uneven": self.allow_uneven,
            "gpu_handoff": self.gpu_handoff,
            "cost_model": self.cost_model,
            "memory_cap": self.memory_cap,
            "profile": self.profile,
            "hardware": self.hardware,
            "simulated_iteration_time_s": self.simulated_iteration_time_s,
            "search_time_s": self.search_time_s,
            "solver": self.solver,
            "stats": self.stats,
        }
        if self.transfer_order is not None:     # only when set: plans in Harmony's order read as before
            d["transfer_order"] = [{"rank": r, "stream": s, "order": list(k)} for r, s, k in self.transfer_order]
        return d

    def to_json(self) -> str:
        """The plan file: the same inputs, seed and worker count give the same bytes.

        Wall-clock measurements (``search_time_s``, any ``wall_time_s``) describe the machine
        and its load, not the plan, so they are written as null (the Plan object and the
        command's output keep them); NaN and infinities, which JSON lacks, become null too."""
        return json.dumps(_canonical(self.to_dict()), indent=2, allow_nan=False) + "\n"

    def save(self, path: str | Path) -> Path:
        return atomic_write_text(path, self.to_json())

    @classmethod
    def from_dict(cls, d: dict, source: str = "plan") -> "Plan":
        if not isinstance(d, dict):
            raise PlanError(f"{source}: a plan is a JSON object")
        try:
            mb, packs = d["microbatch"], d["packs"]
            kw = dict(
                planner=_get(d, "planner", str, source), mode=_get(d, "mode", str, source),
                gpus=_get(d, "gpus", int, source), batch=_get(d, "batch", int, source),
                microbatch_fwd=_get(mb, "fwd", int, source, "microbatch."),
                microbatch_bwd=_get(mb, "bwd", int, source, "microbatch."),
                packs_fwd=_packs(packs, "fwd", source), packs_bwd=_packs(packs, "bwd", source),
                num_layers=_get(d, "num_layers", int, source),
            )
        except KeyError as e:
            raise PlanError(f"{source}: missing field {e.args[0]}") from None
        except TypeError:
            raise PlanError(f"{source}: fields microbatch and packs must be objects with fwd and bwd") from None
        opts = d.get("options") or []
        if not isinstance(opts, list):
            raise PlanError(f"{source}: field options must be a list")
        parsed = []
        for i, o in enumerate(opts):
            if not isinstance(o, dict) or set(o) - {"recompute", "optimizer"}:
                raise PlanError(f"{source}: field options[{i}] must be an object with recompute and optimizer")
            parsed.append(PackOptions(recompute=o.get("recompute", True), optimizer=o.get("optimizer", "cpu")))
        kw["options"] = tuple(parsed)
        for k in ("prefetch", "input_batch_grouping", "allow_uneven", "gpu_handoff"):
            if k in d:
                if not isinstance(d[k], bool):
                    raise PlanError(f"{source}: field {k} must be true or false")
                kw[k] = d[k]
        if d.get("transfer_order") is not None:
            kw["transfer_order"] = _read_orders(d["transfer_order"], source)
        for k in ("cost_model", "memory_cap", "profile", "hardware", "simulated_iteration_time_s",
                  "search_time_s", "solver", "stats", "version"):
            if k in d and d[k] is not None:
                kw[k] = d[k]
        for k in ("profile", "hardware", "stats"):
            if not isinstance(kw.get(k, {}), dict):
                raise PlanError(f"{source}: field {k} must be an object, got {type(kw[k]).__name__}")
        if kw.get("profile", {}).get("precision", "fp32") not in PRECISIONS:
            raise PlanError(f"{source}: field profile.precision must be one of {', '.join(PRECISIONS)}, got "
                            f"{kw['profile']['precision']!r}")
        if kw.get("cost_model", "default") not in ("default", "harmony"):
            raise PlanError(f"{source}: field cost_model must be default or harmony, got {kw['cost_model']!r}")
        try:
            return cls(**kw)
        except PlanError as e:
            raise PlanError(f"{source}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> "Plan":
        path = Path(path)
        d = read_json(path, "plan file", PlanError, "give the plan JSON that `harmony-opt plan` or `baseline` wrote",
                      "was the file cut short?")
        return cls.from_dict(d, str(path))


#: Largest GPU count, batch, microbatch or layer count a plan may hold (beyond it, a typo or a hand edit).
_MAX_COUNT = 2**31 - 1

#: Keys whose values are wall-clock times: never written to a plan file (see Plan.to_json).
WALL_CLOCK_KEYS = frozenset({"search_time_s", "wall_time_s"})


def _canonical(v, key: str | None = None):
    if key in WALL_CLOCK_KEYS:
        return None
    if isinstance(v, dict):
        return {k: _canonical(x, k) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_canonical(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def _json_name(field: str) -> str:
    return {"microbatch_fwd": "microbatch.fwd", "microbatch_bwd": "microbatch.bwd"}.get(field, field)


def _get(d: dict, key: str, typ, source: str, prefix: str = ""):
    v = d[key]
    if typ is int and (isinstance(v, bool) or not isinstance(v, int)):
        raise PlanError(f"{source}: field {prefix}{key} must be a whole number, got {v!r}")
    if typ is str and not isinstance(v, str):
        raise PlanError(f"{source}: field {prefix}{key} must be a string, got {v!r}")
    return v


def _packs(packs: dict, key: str, source: str) -> tuple[Pack, ...]:
    v = packs[key]
    if not isinstance(v, list):
        raise PlanError(f"{source}: field packs.{key} must be a list of [first, last] pairs")
    out = []
    for i, p in enumerate(v):
        if (not isinstance(p, list) or len(p) != 2
                or any(isinstance(x, bool) or not isinstance(x, int) for x in p)):
            raise PlanError(f"{source}: field packs.{key}[{i}] must be [first, last] layer indices, got {p!r}")
        out.append((p[0], p[1]))
    return tuple(out)


def _stream_orders(orders) -> tuple[StreamOrder, ...]:
    try:
        return tuple((r, s, tuple(k)) for r, s, k in orders)
    except (TypeError, ValueError):
        raise PlanError("plan field transfer_order: must be (rank, stream, keys) triples") from None


def _read_orders(v, source: str) -> tuple[StreamOrder, ...]:
    if not isinstance(v, list):
        raise PlanError(f"{source}: field transfer_order must be a list of {{rank, stream, order}} objects")
    out = []
    for i, o in enumerate(v):
        if (not isinstance(o, dict) or set(o) != {"rank", "stream", "order"} or isinstance(o["rank"], bool)
                or not isinstance(o["rank"], int) or not isinstance(o["stream"], str)
                or not isinstance(o["order"], list) or not all(isinstance(k, str) for k in o["order"])):
            raise PlanError(f"{source}: field transfer_order[{i}] must be an object with rank (a whole number), "
                            f"stream (a name) and order (a list of transfer names)")
        out.append((o["rank"], o["stream"], tuple(o["order"])))
    return tuple(out)


def _check_cover(packs, first: int, last: int, field: str) -> None:
    expect = first
    for i, (a, b) in enumerate(packs):
        if a != expect:
            kind = "overlaps the previous pack" if a < expect else f"leaves layers {expect}..{a - 1} uncovered"
            raise PlanError(f"plan field {field}[{i}] = [{a}, {b}] {kind}; packs must cover layers "
                            f"{first}..{last} in order, each exactly once")
        if b < a:
            raise PlanError(f"plan field {field}[{i}] = [{a}, {b}]: last layer before first")
        expect = b + 1
    if expect != last + 1:
        raise PlanError(f"plan field {field}: packs end at layer {expect - 1} but must end at layer {last}")
