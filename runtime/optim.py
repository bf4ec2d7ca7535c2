"""Optimizers of the packs a rank updates: master weights, gradients and state on the host.

Every pack that a rank updates gets its own ``torch.optim`` optimizer over the host
(master) parameters of its layers. Splitting one optimizer into one per pack changes
nothing numerically: SGD and Adam update each parameter from its own gradient and
state. The step runs either on the host (``step_host``, called on the executor's CPU
worker thread as soon as the pack's gradients are in host memory, while later packs
still run their backward) or on the device (``step_device``: the pack's weights,
gradients and optimizer state are on the device; the step runs there and the compiler
swaps weights and state back out).

Named optimizers run fused (one kernel per step) where this torch has fused CPU kernels
(2.4 on), and a rank on a GPU steps with two cores fewer than its share (``host_threads``).
Measured on the H100 machine's 16 cores, an Adam step over one GPT-2 XL block (30.7 M
parameters; benchmarks/bench_cpu_step.py, results/cpu_step.md): with 16 threads and the
per-parameter loop, 0.033 s alone, 0.12 s beside host<->GPU copies and 0.44 s beside copies
and a thread issuing kernels (the step's OpenMP team spins against them; 0.60 s beside the
copies in an earlier run); fused with 14 threads 0.007 / 0.011 / 0.009 s.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
from torch import nn

from harmony_opt.core.errors import UsageError
from harmony_opt.core.hardware import usable_cores

from .buffers import host_copy, host_empty
from .tied import Ties

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]

OPTIMIZERS = {"adam": torch.optim.Adam, "sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


def make_factory(optimizer: str | OptimizerFactory, lr: float, **options) -> OptimizerFactory:
    """An optimizer factory from a name (``adam``, ``sgd``, ``adamw``; fused where :func:`fused_on_cpu`)
    or a callable ``params -> Optimizer`` (used as given)."""
    if callable(optimizer):
        return optimizer
    name = str(optimizer).lower()
    if name not in OPTIMIZERS:
        raise UsageError(f"optimizer {optimizer!r} is not one of {', '.join(OPTIMIZERS)} (or pass a factory "
                         f"params -> torch.optim.Optimizer)")
    if fused_on_cpu():
        options.setdefault("fused", True)
    return functools.partial(OPTIMIZERS[name], lr=lr, **options)


def check_scheduler(scheduler: SchedulerFactory | None, factory: OptimizerFactory) -> None:
    """Refuse, before any step, a scheduler factory that does not make an LRScheduler from an optimizer."""
    if scheduler is None:
        return
    if not callable(scheduler):
        raise UsageError(f"scheduler must be a factory optimizer -> torch.optim.lr_scheduler.LRScheduler "
                         f"(e.g. functools.partial(StepLR, step_size=10)), got {type(scheduler).__name__}")
    made = scheduler(factory([torch.nn.Parameter(torch.zeros(8))]))
    if not isinstance(made, (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
        raise UsageError(f"the scheduler factory returned {type(made).__name__}, not a "
                         f"torch.optim.lr_scheduler.LRScheduler")


def optimizer_states(factory: OptimizerFactory) -> int:
    """How many tensors the size of a weight the optimizer keeps per weight (Adam 2, SGD with
    momentum 1, plain SGD 0), from one step on a probe weight."""
    p = torch.nn.Parameter(torch.zeros(8))
    opt = factory([p])
    p.grad = torch.zeros(8)
    opt.step()
    return sum(1 for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.numel() == p.numel())


@functools.cache
def fused_on_cpu() -> bool:
    """Whether this torch has fused Adam, AdamW and SGD kernels for CPU tensors (2.4 on)."""
    try:
        torch.optim.Adam([torch.zeros(1, requires_grad=True)], fused=True)
    except (RuntimeError, TypeError, ValueError):
        return False
    return True


def host_threads(world: int, device: str, current: int | None = None) -> int:
    """Intra-op threads of a rank (``world`` ranks share the cores): on a GPU, two cores fewer, left
    to the thread that issues GPU work and to the copies' host side; never more than ``current``."""
    n = max(1, usable_cores() // world - (2 if device == "cuda" else 0))
    return min(n, current) if current else n


@contextlib.contextmanager
def intra_op_threads(n: int | None):
    """``torch.set_num_threads(n)`` for the block (``None``: as set), the caller's setting put back."""
    before = torch.get_num_threads()
    torch.set_num_threads(n or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pack_name(pack: tuple[int, int]) -> str:
    return f"{pack[0]}-{pack[1]}"


class PackOptimizers:
    """One optimizer per pack over host parameters, plus the host gradient buffers dW is swapped into;
    with a scheduler factory, one LR scheduler per optimizer, stepped once per training step (a
    schedule of the step count gives every pack the learning rate one optimizer would have)."""

    def __init__(self, layers: list[nn.Module], packs: list[tuple[int, int]], factory: OptimizerFactory,
                 scheduler: SchedulerFactory | None = None, ties: Ties | None = None):
        self.layers = layers
        self.ties = ties or Ties()
        self.params: dict[tuple, list[tuple[int, str, nn.Parameter]]] = {}
        self.opts: dict[tuple, torch.optim.Optimizer | None] = {}
        self.scheds: dict[tuple, object] = {}
        self.grads: dict[tuple[int, str], torch.Tensor] = {}
        for pack in packs:
            every = [(l, n, p) for l in range(pack[0], pack[1] + 1)
                     for n, p in layers[l].named_parameters() if p.requires_grad]
            for l, n, p in every:
                self.grads[(l, n)] = host_empty(p.shape, p.dtype)
            # a tied parameter is stepped once, by its owner copy's pack (runtime.tied)
            ps = [(l, n, p) for l, n, p in every if (l, n) not in self.ties.skip]
            self.params[pack] = ps
            self.opts[pack] = factory([p for _, _, p in ps]) if ps else None
            if scheduler is not None and self.opts[pack] is not None:
                self.scheds[pack] = scheduler(self.opts[pack])

    def step_schedulers(self, loss: float) -> None:
        """One scheduler step after a training step's updates (ReduceLROnPlateau gets the step's loss)."""
        for s in self.scheds.values():
            if isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau):
                s.step(loss)
            else:
                s.step()

    def clip_and_step(self, packs: list[tuple[int, int]], max_norm: float, comm=None) -> float:
        """Gradient clipping as ``torch.nn.utils.clip_grad_norm_(all parameters, max_norm)`` computes it,
        then the host steps of ``packs``: the 2-norm over the gradients of the packs this rank updates
        (every pack is updated by exactly one rank), summed over the ranks, so each gradient counts
        once; returns the global norm."""
        squares = sum(float(torch.linalg.vector_norm(self._summed(l, n)).double() ** 2)
                      for pack in self.params for l, n, _ in self.params[pack])
        total = (comm.sum_float(squares) if comm else squares) ** 0.5
        coef = min(1.0, max_norm / (total + 1e-6))
        if coef < 1.0:
            for g in self.grads.values():
                g.mul_(coef)
        for pack in packs:
            self.step_host(pack)
        return total

    def _summed(self, layer: int, name: str) -> torch.Tensor:
        """A parameter's gradient as its update sees it: a tied one's summed over its copies."""
        g = self.grads[(layer, name)]
        others = self.ties.others.get((layer, name), ())
        return g if not others else g + sum(self.grads[c] for c in others)

    def grad_buffer(self, layer: int, name: str) -> torch.Tensor:
        return self.grads[(layer, name)]

    def _pack(self, layers: tuple[int, int]):
        try:
            return self.params[layers], self.opts[layers]
        except KeyError:
            raise UsageError(f"no optimizer for pack {pack_name(layers)} on this rank") from None

    # -- on the host -------------------------------------------------------------------------------
    def step_host(self, layers: tuple[int, int]) -> None:
        """``opt.step()`` with each host parameter's gradient taken from its host buffer."""
        ps, opt = self._pack(layers)
        if opt is None:
            return
        for l, n, p in ps:
            p.grad = self.grads[(l, n)]
            for c in self.ties.others.get((l, n), ()):     # a tied parameter: all its copies' gradients, summed
                p.grad.add_(self.grads[c])
        opt.step()
        for _, _, p in ps:
            p.grad = None

    # -- on the device -----------------------------------------------------------------------------
    def state_to_device(self, layers: tuple[int, int], device: torch.device) -> dict:
        """Device copies of the pack's per-parameter state tensors: {layer: {name: {key: tensor}}}."""
        ps, opt = self._pack(layers)
        out = {l: {} for l in range(layers[0], layers[1] + 1)}
        for l, n, p in ps:
            st = opt.state.get(p, {}) if opt else {}
            out[l][n] = {k: torch.empty_like(v, device=device).copy_(v, non_blocking=True)
                         for k, v in st.items() if _is_param_state(v, p)}
        return out

    def step_device(self, layers: tuple[int, int], weights: dict, grads: dict, state: dict) -> None:
        """Run the pack's step on device tensors: weights[l][name] is updated in place, state[l][name] refreshed."""
        ps, opt = self._pack(layers)
        if opt is None:
            return
        homes = []
        fused = any(g.get("fused") for g in opt.param_groups)
        for l, n, p in ps:
            homes.append(p.data)
            p.data = weights[l][n].detach()
            p.grad = grads[l][n]
            st = opt.state[p]
            st.update(state[l][n])
            if fused:   # fused kernels read the step count on the weights' device (a checkpoint loads it on the host)
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.dim() == 0 and v.device != p.device:
                        st[k] = v.to(p.device)
        try:
            opt.step()
        finally:
            for (l, n, p), home in zip(ps, homes):
                state[l][n] = {k: v for k, v in opt.state[p].items() if _is_param_state(v, p)}
                p.data, p.grad = home, None

    def state_to_host(self, layers: tuple[int, int], state: dict) -> None:
        """Copy device state back into the optimizer's host state (allocated on first use)."""
        ps, opt = self._pack(layers)
        for l, n, p in ps:
            st = opt.state[p]
            for k, v in state[l][n].items():
                home = st.get(k)
                if home is None or home.device.type != "cpu" or home.shape != v.shape:
                    st[k] = host_copy(v)
                else:
                    home.copy_(v, non_blocking=v.is_cuda)

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dicts(self) -> dict[str, dict]:
        return {pack_name(k): opt.state_dict() for k, opt in self.opts.items() if opt is not None}

    def scheduler_state_dicts(self) -> dict[str, dict]:
        return {pack_name(k): s.state_dict() for k, s in self.scheds.items()}

    def load_state_dicts(self, states: dict[str, dict], schedulers: dict[str, dict] | None = None) -> None:
        """Optimizer states first, then the schedulers' (PyTorch's order for resuming)."""
        for k, opt in self.opts.items():
            if opt is not None and pack_name(k) in states:
                opt.load_state_dict(states[pack_name(k)])
        for k, s in self.scheds.items():
            if schedulers and pack_name(k) in schedulers:
                s.load_state_dict(schedulers[pack_name(k)])


def _is_param_state(v, p: torch.Tensor) -> bool:
    """State with the parameter's shape moves with it (Adam's moments); scalars such as ``step`` stay."""
    return isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == p.shape
