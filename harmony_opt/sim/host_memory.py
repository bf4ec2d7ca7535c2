"""Host memory a plan needs, against the Hardware's ``host_memory_bytes`` and ``pinned_memory_bytes``.

The runtime (docs/runtime.md, "Memory") keeps in host memory, for the whole machine:

* the master weights and buffers, once (shared by the rank processes; pinned);
* every pack's optimizer state, once (each pack is stepped by one rank; pageable);
* a gradient buffer per parameter, once (pinned: dW is swapped into it);
* the activation buffers the Program names, one row per sample: the data, forward outputs handed
  on through host memory (X), every backward pack's stashed input or saved activations
  (sX, sA), gradients handed on through host memory (dX); pinned.

The first three are the same for every plan of a model (``model_host_memory``): a model whose
weights, gradients and optimizer state do not fit has no plan on that machine. Only the
activations depend on the plan (``host_memory``, from the task graph's flows through host memory).

On several servers each server's host memory is its own budget (``host_memory_per_server``): a
layer's weights live on every server whose GPUs run a pack of it (in vPP a layer whose forward and
backward packs run on different servers has a copy on each; in vDP every server holds them all),
its gradient buffer and optimizer state where it is stepped (in vDP each server its ranks' shards),
and an activation buffer on the server of each GPU task that writes or reads it (both, where the
two are on different servers).
"""
from __future__ import annotations

import dataclasses
import functools

import numpy as np

from ..core.errors import InfeasibleError
from ..core.hardware import Hardware
from ..core.kinds import Medium, TaskKind, Tensor
from ..core.plan import Plan
from ..core.profile import Profile
from ..core.units import fmt_bytes


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """Bytes in host memory during an iteration, by what holds them."""

    weights: int        # master weights and buffers
    optimizer: int      # optimizer state
    gradients: int      # host gradient buffers
    activations: int    # activation buffers of the plan (0: the model alone)
    server: int | None = None   # on several servers: the server whose host memory this is

    @property
    def total(self) -> int:
        return self.weights + self.optimizer + self.gradients + self.activations

    @property
    def pinned(self) -> int:
        """Page-locked on a GPU machine: everything but the optimizer state."""
        return self.total - self.optimizer

    def parts(self) -> str:
        named = [("weights and buffers", self.weights), ("optimizer state", self.optimizer),
                 ("gradient buffers", self.gradients), ("activation buffers", self.activations)]
        return ", ".join(f"{name} {fmt_bytes(b)}" for name, b in named if b)

    def check(self, hw: Hardware, what: str) -> None:
        """InfeasibleError naming what does not fit, by how much, against which budget (and server)."""
        where = f"hardware {hw.name}" if self.server is None else f"server {self.server} of hardware {hw.name}"
        for need, have, kind, budget, held in (
                (self.total, hw.host_memory_bytes, "host", "host_memory_bytes", self.parts()),
                (self.pinned, hw.pinned_memory_bytes, "pinned host", "pinned_memory_bytes", "all but the optimizer state")):
            if need > have:
                raise InfeasibleError(
                    f"{what} needs {fmt_bytes(need)} ({need} bytes) of {kind} memory ({held}), more than the "
                    f"{fmt_bytes(have)} ({have} bytes) of {where} ({budget}); use a hardware file with "
                    f"more host memory"
                    + (", or a smaller minibatch" if self.activations else ", or a smaller model"),
                    needed_bytes=int(need), cap_bytes=int(have))


def model_host_memory(profile: Profile) -> HostMemory:
    """What every plan of ``profile`` keeps in host memory, activations aside."""
    last = profile.num_layers - 1
    weights = int(profile.param_bytes(0, last) + profile.buffer_bytes(0, last))
    return HostMemory(weights, int(profile.optimizer_bytes(0, last)), int(profile.grad_bytes(0, last)), 0)


def host_memory(plan: Plan, profile: Profile, hw: Hardware) -> HostMemory:
    """What ``plan`` keeps in host memory: the model's share and one buffer per activation that
    leaves a GPU for host memory (the bytes of all its microbatches, on every replica), plus the data."""
    from .taskgraph import D2H_MEDIA, compose

    acts = 0
    for node in compose(plan, profile, hw):
        for f in node.inputs:
            if f.medium == Medium.DAT and f.tensor == Tensor.X:
                acts += f.total             # the data: every sample once
            elif f.tensor == Tensor.SX and not (f.layers[0] == 0 and plan.options[node.bwd_index].recompute):
                acts += f.total             # a stashed input or saved activations (layer 0's input is the data)
        for f in node.outputs:
            if f.tensor in (Tensor.Y, Tensor.DX) and f.medium in D2H_MEDIA:
                acts += f.total
    return dataclasses.replace(model_host_memory(profile), activations=int(acts))


def host_memory_per_server(plan: Plan, profile: Profile, hw: Hardware) -> list[HostMemory]:
    """``host_memory`` of each server the plan's ranks span (the module docstring), ``server`` set."""
    from .taskgraph import D2H_MEDIA, compose

    nodes = compose(plan, profile, hw)
    servers = hw.servers_used(plan.gpus)
    on = hw.server_of
    acts = [0] * servers
    weights = [set() for _ in range(servers)]       # layers whose weights each server holds
    stepped = [set() for _ in range(servers)]       # layers whose gradients and state it keeps (vPP)
    for node in nodes:
        here = on(node.rank)
        if node.kind != TaskKind.UPD:
            weights[here].update(range(node.pack[0], node.pack[1] + 1))
        if node.kind == TaskKind.BWD:
            stepped[here].update(range(node.pack[0], node.pack[1] + 1))
        for f in node.inputs:
            if f.medium == Medium.DAT and f.tensor == Tensor.X:
                acts[here] += f.total
            elif f.tensor == Tensor.SX and not (f.layers[0] == 0 and plan.options[node.bwd_index].recompute):
                for s in {here, on(f.peer.rank)}:
                    acts[s] += f.total
        for f in node.outputs:
            if f.tensor in (Tensor.Y, Tensor.DX) and f.medium in D2H_MEDIA:
                for s in {here} | ({on(f.peer.rank)} if f.peer is not None else set()):
                    acts[s] += f.total

    def layers_bytes(fn, layers) -> int:
        return sum(int(fn(l, l)) for l in layers)
    out = []
    n = plan.gpus
    for s in range(servers):
        ranks = sum(1 for r in range(n) if on(r) == s)
        if plan.mode == "vDP":
            model = model_host_memory(profile)
            part = HostMemory(model.weights, -(-model.optimizer * ranks // n), -(-model.gradients * ranks // n), 0)
        else:
            part = HostMemory(layers_bytes(profile.param_bytes, weights[s]) + layers_bytes(profile.buffer_bytes, weights[s]),
                              layers_bytes(profile.optimizer_bytes, stepped[s]),
                              layers_bytes(profile.grad_bytes, stepped[s]), 0)
        out.append(dataclasses.replace(part, activations=int(acts[s]), server=s))
    return out


@functools.lru_cache(maxsize=8)
def _per_sample(profile: Profile) -> tuple[np.ndarray, np.ndarray]:
    """Per layer, the most input and saved-activation bytes per sample at any profiled size (built
    once per profile: every configuration's task table asks, tasks.host_budget)."""
    sizes = [profile.costs(phase, u) for phase in ("FWD", "BWD") for u in profile.sizes(phase)]
    return (np.max([c.input.astype(float) / c.u for c in sizes], axis=0),
            np.max([c.saved.astype(float) / c.u for c in sizes], axis=0))


def activation_ceiling(profile: Profile, batch: int, boundaries=None, stashed=None) -> int:
    """More activation bytes than any plan of ``batch`` samples keeps in host memory (of a plan whose
    packs start or end at ``boundaries``, stashing the layers ``stashed``; default: every one): at each
    boundary an output, a stashed input and a gradient (X, sX, dX) of every sample, and the saved
    activations (sA) of the stashed layers; activation bytes grow in proportion to the samples."""
    inputs, saved = _per_sample(profile)
    at = slice(None) if boundaries is None else np.asarray(sorted(set(boundaries)), int)
    layers = slice(None) if stashed is None else np.asarray(sorted(set(stashed)), int)
    return int(batch * (3 * inputs[at].sum() + saved[layers].sum())) + 1 + int(batch * inputs[0])


def overrun(plan: Plan, profile: Profile, hw: Hardware) -> HostMemory | None:
    """What ``plan`` needs where that exceeds the host's budgets, else None; counted exactly
    (``host_memory``) only where a quick ceiling of its buffers does not already fit."""
    packs = [*plan.packs_fwd, *plan.packs_bwd]
    stashed = [l for (a, b), o in zip(plan.packs_bwd, plan.options) if not o.recompute for l in range(a, b + 1)]
    quick = dataclasses.replace(model_host_memory(profile), activations=activation_ceiling(
        profile, plan.batch, [a for a, _ in packs] + [b + 1 for _, b in packs if b + 1 < profile.num_layers], stashed))
    if quick.total <= hw.host_memory_bytes and quick.pinned <= hw.pinned_memory_bytes:
        return None     # on several servers too: no server holds more than the whole model and every buffer
    if hw.servers_used(plan.gpus) > 1:
        return next((need for need in host_memory_per_server(plan, profile, hw)
                     if need.total > hw.host_memory_bytes or need.pinned > hw.pinned_memory_bytes), None)
    need = host_memory(plan, profile, hw)
    return None if need.total <= hw.host_memory_bytes and need.pinned <= hw.pinned_memory_bytes else need


def require_fits(plan: Plan, profile: Profile, hw: Hardware, what: str) -> None:
    """InfeasibleError naming the budget ``plan`` (called ``what``) exceeds and by how much, if any."""
    need = overrun(plan, profile, hw)
    if need is not None:
        need.check(hw, what)


def may_bind(profile: Profile, hw: Hardware, batch: int) -> bool:
    """Whether some plan of ``batch`` samples could exceed the host's budgets (else none needs checking)."""
    ceiling = dataclasses.replace(model_host_memory(profile), activations=activation_ceiling(profile, batch))
    return ceiling.total > hw.host_memory_bytes or ceiling.pinned > hw.pinned_memory_bytes
