"""Training API: run a Plan on a model with real tensors.

::

    from harmony_opt.measure.models import build_model
    from harmony_opt.training import train

    model = build_model("gpt2-tiny")
    result = train(model, plan, steps=20, optimizer="adam", lr=1e-3, checkpoint_dir="ckpt")
    result.losses, result.samples_per_s, result.weights[3]["block.attn.c_attn.weight"]

The plan is compiled (:func:`harmony_opt.compile.compiler.compile_plan`), validated, and run by
the runtime executor, one process per GPU rank when the plan has more than one. The
result equals plain single-device training of the same model on the same minibatches:
each microbatch's loss is weighted by its share of the minibatch, so the gradients are
those of the minibatch mean; only the order in which microbatch gradients are summed
differs.

Everything that can be wrong with the inputs is checked before the first step: the
plan (or a given Program) against the model, every data batch's size against the plan's
minibatch, one sample through every layer, a checkpoint against the plan and model.
"""
from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from typing import Callable, Iterable

import torch

from .compile.compiler import compile_plan
from .compile.program import Program, plan_identity
from .compile.validate import validate_program
from .core.errors import DataError, PlanError, ProgramError, RuntimeMemoryError, UsageError
from .core.plan import Plan
from .measure.models import MODEL_NAMES
from .sim.timeline import Timeline

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass
class TrainResult:
    weights: list[dict[str, torch.Tensor]]      # state dict of every layer after the last step
    losses: list[float]                         # minibatch loss of every step from step 0 (resumed runs too)
    samples_per_s: float                        # over the steps this call ran
    iteration_times: list[float]                # seconds per step this call ran (rank 0)
    peak_device_bytes: list[int]                # per rank: the memory guard's peak of live device tensors
    start_step: int
    steps: int
    program: Program
    rank_pids: list[int] = dataclasses.field(default_factory=list)    # the process of each rank
    backend: str | None = None                  # torch.distributed backend of a multi-rank run
    bytes_moved: list[dict] = dataclasses.field(default_factory=list)   # per rank: h2d/d2h bytes, steps run
    device_peak_bytes: list = dataclasses.field(default_factory=list)  # per rank: CUDA allocator peak (None on CPU)
    trace: list[dict] = dataclasses.field(default_factory=list)   # per rank, with trace=True: see timeline()

    def timeline(self):
        """The last step as measured (``train(..., trace=True)``): a Timeline like the simulator's,
        one event per instruction, so the two can be compared stream by stream or drawn alike."""

        if not any(self.trace):
            raise UsageError("no trace was recorded: train with trace=True")
        return Timeline.from_records([r for t in self.trace for r in t["events"]], self.iteration_times[-1],
                                     [m for t in self.trace for m in t["memory"]], ranks=len(self.trace),
                                     meta={"source": "measured"})


def batch_seed(seed: int, step: int) -> int:
    """The generator seed of step ``step``'s synthetic minibatch: independent of earlier steps, so
    a resumed run draws the same minibatches as an uninterrupted one."""
    return seed * 1_000_003 + step


def train(model, plan: Plan, data: Iterable[Batch] | None = None, *,
          optimizer: str | Callable | None = None, lr: float = 1e-3, steps: int = 10,
          checkpoint_dir: str | Path | None = None, checkpoint_every: int | None = None, resume: bool = False,
          device: str = "cpu", memory_cap: int | None = None, progress: bool = True, seed: int = 0,
          program: Program | None = None, trace: bool = False) -> TrainResult:
    """Train ``model`` (a LayeredModel) for ``steps`` steps (counted from step 0) as ``plan`` says.

    ``data`` yields ``(inputs, targets)`` minibatches of ``plan.batch`` samples from step 0
    on (a resumed run skips those already done); without it, minibatches come from
    ``model.make_batch`` with a generator seeded per step. ``optimizer`` is ``"adam"``,
    ``"sgd"``, ``"adamw"`` or a picklable factory ``params -> torch.optim.Optimizer`` (e.g.
    ``functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)``); the default is the
    model's ``meta["optimizer"]``. ``memory_cap`` (default: the plan's) bounds live device
    bytes per rank. With ``checkpoint_dir``, a checkpoint is written atomically at the last
    step and every ``checkpoint_every`` steps; ``resume=True`` continues from it. With
    ``trace=True`` the result holds when every instruction of the last step ran
    (:meth:`TrainResult.timeline`).
    """
    from harmony_opt.runtime.checkpoint import load_checkpoint, restore_layers
    from harmony_opt.runtime.optim import make_factory
    from harmony_opt.runtime.optim import optimizer_states
    from harmony_opt.measure.shapes import boundary_shapes, measure_layer_bytes
    from harmony_opt.runtime.worker import Job, run_job

    layers = list(model.layers)
    check_plan(model, plan)
    _check_device(device, plan.gpus)
    if steps < 0:
        raise UsageError(f"steps must be >= 0, got {steps}")
    if resume and checkpoint_dir is None:
        raise UsageError("resume needs a checkpoint folder")
    cap = memory_cap if memory_cap is not None else plan.memory_cap
    factory = make_factory(optimizer or model.meta.get("optimizer", "adam"), lr)
    ident = plan_identity(plan) if program is None else program.plan_identity
    state = load_checkpoint(checkpoint_dir, plan_identity=ident, layers=layers) if resume else None
    start = state["step"] if state else 0
    batches = _batches(model, plan, data, start, steps, seed)
    shapes = boundary_shapes(layers, *batches[0]) if batches else []
    # the whole program against the model's real sizes, before any weight changes
    sizes = measure_layer_bytes(layers, *batches[0], optimizer_states=optimizer_states(factory)) if batches else None
    program = _program(plan, layers, program, sizes, cap)
    if state:
        restore_layers(layers, state)
    for layer in layers:
        layer.train()
    _place_host_state(layers, device, plan.gpus)
    job = Job(program=program, layers=layers, batches=batches, start_step=start, factory=factory, shapes=shapes,
              device=device, memory_cap=cap, seed=seed,
              progress=progress, optimizer_state=state["optimizer"] if state else None,
              checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None, checkpoint_every=checkpoint_every,
              plan=plan.to_dict(), losses_before=list(state["losses"]) if state else [], trace=trace)
    results = run_job(job) if batches else []
    times = results[0].iteration_times if results else []
    return TrainResult(
        weights=[{k: v.detach().clone() for k, v in layer.state_dict().items()} for layer in layers],
        losses=results[0].losses if results else job.losses_before,
        samples_per_s=plan.batch * len(times) / sum(times) if times else 0.0,
        iteration_times=times, peak_device_bytes=[r.peak_bytes for r in results],
        start_step=start, steps=max(steps, start), program=program,
        rank_pids=[r.pid for r in results], backend=results[0].backend if results else None,
        bytes_moved=[r.bytes_moved for r in results], device_peak_bytes=[r.device_peak_bytes for r in results],
        trace=[r.trace for r in results])


def check_plan(model, plan: Plan) -> None:
    """Refuse a plan made for another model: another layer count, or another built-in model's profile."""

    if not isinstance(plan, Plan):
        raise UsageError(f"plan must be a harmony_opt Plan, got {type(plan).__name__}")
    made_for = str((plan.profile or {}).get("name", ""))
    norm = lambda n: n.strip().lower().replace("_", "-")  # noqa: E731  (gpt2_xl profile = gpt2-xl model)
    if norm(made_for) in MODEL_NAMES and norm(model.name) in MODEL_NAMES and norm(made_for) != norm(model.name):
        raise PlanError(f"the plan was made from a profile of {made_for!r}, not of model {model.name!r}; "
                        f"plan for the model you run")
    if plan.num_layers != len(model.layers):
        raise PlanError(f"the plan has {plan.num_layers} layers but model {model.name!r} has {len(model.layers)}; "
                        f"the plan was made for another model (or another cut of it)")


def _check_device(device: str, gpus: int) -> None:
    if device not in ("cpu", "cuda"):
        raise UsageError(f"device must be cpu or cuda, got {device!r}")
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("device cuda was asked for but CUDA is not available; use device cpu")
        if torch.cuda.device_count() < gpus:
            raise UsageError(f"the plan needs {gpus} GPUs but {torch.cuda.device_count()} are visible")


def _program(plan: Plan, layers: list, program: Program | None, sizes=None, cap: int | None = None) -> Program:
    """The plan's program (or the given one, checked against the plan and model), validated with the
    model's measured ``sizes`` against ``cap``: a run the memory guard would stop is refused here."""

    if program is None:
        program = compile_plan(plan, layer_bytes=sizes, memory_cap=cap)
    else:
        ident = plan_identity(plan)
        if program.plan_identity != ident:
            raise ProgramError(f"the program was compiled from another plan (identity {program.plan_identity}, "
                               f"this plan is {ident}); compile this plan")
        if program.num_layers != len(layers):
            raise ProgramError(f"the program has {program.num_layers} layers but the model has {len(layers)}")
        if program.layer_bytes is not None:
            for l, layer in enumerate(layers):
                have = sum(p.numel() * p.element_size() for p in layer.parameters())
                if have != program.layer_bytes.weights[l]:
                    raise ProgramError(f"the program was compiled for a model whose layer {l} has "
                                       f"{program.layer_bytes.weights[l]} weight bytes; this model's has {have}")
    try:
        validate_program(program, cap_bytes=cap if sizes is not None else None, sizes=sizes)
    except ProgramError as e:
        if "over the cap" not in str(e):
            raise
        raise RuntimeMemoryError(f"the run would exceed the memory cap, so no step ran: {str(e).splitlines()[0]}") from None
    return program


def _batches(model, plan: Plan, data, start: int, steps: int, seed: int) -> list[Batch]:
    """The minibatches of steps ``start .. steps-1``, each checked against the plan's minibatch size."""
    if data is None:
        out = [model.make_batch(plan.batch, torch.Generator().manual_seed(batch_seed(seed, s)))
               for s in range(start, steps)]
    else:
        out = list(itertools.islice(iter(data), start, steps))
        if len(out) < steps - start:
            raise DataError(f"the data has {start + len(out)} minibatches but {steps} steps were asked for")
    first = None
    for k, b in enumerate(out):
        step = start + k
        if not (isinstance(b, (tuple, list)) and len(b) == 2 and all(isinstance(t, torch.Tensor) for t in b)):
            raise DataError(f"data batch {step}: expected a pair (inputs, targets) of tensors, got {type(b).__name__}")
        x, y = b
        for what, t in (("inputs", x), ("targets", y)):
            if t.dim() == 0 or t.shape[0] != plan.batch:
                raise DataError(f"data batch {step}: {what} hold {t.shape[0] if t.dim() else 0} samples but the "
                                f"plan's minibatch is {plan.batch}")
        sig = (x.shape[1:], x.dtype, y.shape[1:], y.dtype)
        if first is None:
            first = sig
        elif sig != first:
            raise DataError(f"data batch {step}: samples of shape {tuple(x.shape[1:])} / {tuple(y.shape[1:])} "
                            f"differ from batch {start}'s {tuple(first[0])} / {tuple(first[2])}")
        out[k] = (x.detach().cpu(), y.detach().cpu())
    return out


def _place_host_state(layers: list, device: str, gpus: int) -> None:
    """Master weights and buffers: shared memory across rank processes, pinned for a lone GPU."""
    if gpus > 1:
        for layer in layers:
            layer.share_memory()
    elif device == "cuda":
        for layer in layers:
            for t in list(layer.parameters()) + list(layer.buffers()):
                if not t.is_pinned():
                    t.data = t.data.pin_memory()
