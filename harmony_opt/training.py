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
plan (or a given Program) against the model, the first minibatch's size against the plan's
minibatch, one sample through every layer, the loss averaging over its samples, a
checkpoint against the plan and model. Minibatches stream: each later one is checked as
its step draws it.
"""
from __future__ import annotations

import collections.abc
import dataclasses
import itertools
import statistics
from pathlib import Path
from typing import Callable, Iterable, Iterator

import pandas as pd
import torch

from .compile.compiler import compile_plan
from .compile.program import Program, plan_identity
from .compile.validate import validate_program
from .core.errors import DataError, PlanError, ProgramError, RuntimeMemoryError, UsageError, first_line
from .core.plan import Plan
from .core.precision import resolve as resolve_precision
from .core.units import alloc_granularity
from .measure.models import MODEL_NAMES
from .sim.timeline import HOST_COLUMNS, Timeline

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclasses.dataclass
class TrainResult:
    weights: list[dict[str, torch.Tensor]]      # state dict of every layer after the last step
    losses: list[float]                         # minibatch loss of every step from step 0 (resumed runs too)
    samples_per_s: float                        # over the steps this call ran
    iteration_times: list[float]                # seconds per step this call ran (rank 0)
    peak_device_bytes: list[int]                # per rank: the memory guard's peak of live device tensors
    start_step: int
    steps: int                                  # the step the run ended at (start_step + steps this call ran)
    program: Program
    rank_pids: list[int] = dataclasses.field(default_factory=list)    # the process of each rank
    backend: str | None = None                  # torch.distributed backend of a multi-rank run
    bytes_moved: list[dict] = dataclasses.field(default_factory=list)   # per rank: h2d/d2h bytes, steps run
    device_peak_bytes: list = dataclasses.field(default_factory=list)  # per rank: CUDA allocator peak (None on CPU)
    traces: list[list[dict]] = dataclasses.field(default_factory=list)  # per rank, per traced step: timelines()
    traced: list[int] = dataclasses.field(default_factory=list)   # the traced steps, as indices of iteration_times

    @property
    def trace(self) -> list[dict]:
        """Per rank, the last traced step's events and memory steps (empty without a trace)."""
        return [t[-1] if t else {} for t in self.traces]

    def timelines(self) -> list[Timeline]:
        """Every traced step as measured (``train(..., trace=N)``), oldest first: Timelines like the
        simulator's, one event per instruction, so the two can be compared stream by stream or drawn
        alike; on a GPU with the host's issue times (``Timeline.host``)."""
        if not any(self.traces):
            raise UsageError("no trace was recorded: train with trace=True")
        return [Timeline.from_records([r for t in self.traces for r in t[i]["events"]], self.iteration_times[step],
                                      [m for t in self.traces for m in t[i]["memory"]], ranks=len(self.traces),
                                      meta={"source": "measured", "plan_identity": self.program.plan_identity},
                                      host=pd.DataFrame([r for t in self.traces for r in t[i].get("issue", [])],
                                                        columns=HOST_COLUMNS))
                for i, step in enumerate(self.traced)]

    def timeline(self) -> Timeline:
        """The last step as measured (``train(..., trace=True)``)."""
        return self.timelines()[-1]

    def settled_step_time(self) -> float | None:
        """The median of the steps this call ran after the first (warm-up), traced or not (tracing
        costs an instruction a few microseconds); None where there are none."""
        return statistics.median(self.iteration_times[1:]) if len(self.iteration_times) > 1 else None

    def untraced_step_time(self) -> float | None:
        """The median of the steps this call ran, the first (warm-up) and the traced ones aside; None
        where there are none."""
        skip = {0, *self.traced}
        times = [t for i, t in enumerate(self.iteration_times) if i not in skip]
        return statistics.median(times) if times else None


def batch_seed(seed: int, step: int) -> int:
    """The generator seed of step ``step``'s synthetic minibatch: independent of earlier steps, so
    a resumed run draws the same minibatches as an uninterrupted one."""
    return seed * 1_000_003 + step


def train(model, plan: Plan, data: Iterable[Batch] | None = None, *,
          optimizer: str | Callable | None = None, lr: float = 1e-3, steps: int | None = None,
          epochs: int | None = None, scheduler: Callable | None = None, clip_grad_norm: float | None = None,
          checkpoint_dir: str | Path | None = None, checkpoint_every: int | None = None, resume: bool = False,
          device: str = "cpu", memory_cap: int | None = None, progress: bool = True, seed: int = 0,
          program: Program | None = None, trace: bool | int = False, granularity: int | None = None,
          precision: str | None = None) -> TrainResult:
    """Train ``model`` (a LayeredModel) as ``plan`` says; steps are counted from step 0.

    Data: ``data`` is any iterable of ``(inputs, targets)`` minibatches of ``plan.batch`` samples
    (a list, a generator, a torch ``DataLoader`` with ``drop_last=True``), read as the steps run.
    The stream is ``epochs`` passes over it (default 1; more need a re-iterable such as a list or
    a DataLoader). ``steps`` given: run up to step ``steps`` and refuse data that holds fewer
    minibatches; ``steps`` left out: run the whole stream. Without ``data``, step ``s``'s
    minibatch is ``model.make_batch(plan.batch, generator seeded by (seed, s))`` and ``steps``
    defaults to 10. A resumed run skips the minibatches of the steps already done (given data
    should then yield the same minibatches in the same order). Step 0's minibatch is checked
    (sizes, shapes, the loss averaging over samples, the program's memory at the model's real
    sizes) before anything changes; a later minibatch that is wrong stops the run at its step.

    ``optimizer`` is ``"adam"``, ``"sgd"``, ``"adamw"`` or a picklable factory ``params ->
    torch.optim.Optimizer`` (e.g. ``functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)``);
    the default is the model's ``meta["optimizer"]``. ``scheduler``: a picklable factory
    ``optimizer -> torch.optim.lr_scheduler.LRScheduler``, one per pack's optimizer, stepped once
    per step. ``clip_grad_norm``: clip the gradients to this global 2-norm over every layer, as
    ``torch.nn.utils.clip_grad_norm_`` on the whole model (the updates then wait for the step's
    last gradient; refused for plans with a pack stepping on the GPU). ``memory_cap`` (default:
    the plan's) bounds live device bytes per rank. With ``checkpoint_dir``, a checkpoint is written
    atomically after the last step and every ``checkpoint_every`` steps; ``resume=True``
    continues from it. With ``trace=True`` the result holds when every instruction of the last
    step ran (:meth:`TrainResult.timeline`); with ``trace=N``, of the last step and every other one
    before it, N at most (``runtime.worker.traced_steps``; :meth:`TrainResult.timelines`), the
    steps between them untraced (:meth:`TrainResult.untraced_step_time`). ``granularity``: what the
    device's allocator rounds each tensor up to, for the memory check and the guard (default: 512
    on CUDA, exact on the CPU).
    ``precision`` (default: the plan's, which its profile was measured in) is "fp32" or "bf16":
    forwards and recomputes under bf16 autocast, weights, gradients and optimizer state fp32
    (:mod:`harmony_opt.core.precision`); one other than the plan's is refused.
    """
    from harmony_opt.runtime.checkpoint import load_checkpoint, restore_layers
    from harmony_opt.runtime.optim import check_scheduler, make_factory, optimizer_states
    from harmony_opt.runtime.tied import tie_schedule
    from harmony_opt.measure.shapes import boundary_shapes, check_mean_loss, measure_layer_bytes
    from harmony_opt.runtime.worker import Job, run_job
    from harmony_opt.runtime.launch import torchrun_env

    layers = list(model.layers)
    check_plan(model, plan)
    precision = resolve_precision(plan, precision)
    launched = torchrun_env()        # under torchrun: this process is one rank (docs/runtime.md "torchrun")
    if launched:
        launched.check(plan.gpus, device)
    _check_device(device, plan.gpus if launched is None else 0)
    steps = _check_counts(plan, data, steps, epochs, clip_grad_norm)
    if resume and checkpoint_dir is None:
        raise UsageError("resume needs a checkpoint folder")
    cap = memory_cap if memory_cap is not None else plan.memory_cap
    granularity = alloc_granularity(device) if granularity is None else granularity
    if isinstance(granularity, bool) or not isinstance(granularity, int) or granularity < 1:
        raise UsageError(f"granularity must be a whole number of bytes >= 1, got {granularity!r}")
    factory = make_factory(optimizer or model.meta.get("optimizer", "adam"), lr)
    check_scheduler(scheduler, factory)
    ident = plan_identity(plan) if program is None else program.plan_identity
    state = load_checkpoint(checkpoint_dir, plan_identity=ident, layers=layers) if resume else None
    start = state["step"] if state else 0
    if state and start > 0 and (scheduler is None) != ("schedulers" not in state):
        was = "with" if scheduler is None else "without"
        raise DataError(f"the checkpoint in {checkpoint_dir} was written by a run {was} an LR scheduler; resume "
                        f"with the scheduler it was written with")
    stream = _stream(model, plan, data, start, steps, epochs or 1, seed)
    first = next(stream, None)
    if first is None and data is not None and start == 0 and steps is None:
        raise DataError("the data holds no minibatch")
    batches = itertools.chain([first], stream) if first is not None else None
    if first is not None:
        shapes = boundary_shapes(layers, *first, precision=precision)
        check_mean_loss(layers, *first)
        # the whole program against the model's real sizes, before any weight changes
        sizes = measure_layer_bytes(layers, *first, optimizer_states=optimizer_states(factory),
                                    granularity=granularity, precision=precision)
    else:
        shapes, sizes = [], None
    program = _program(plan, layers, program, sizes, cap)
    tie_schedule(program, layers)       # tied weights (an LM head and its embedding): one exact update, or refused
    if state:
        restore_layers(layers, state)
    for layer in layers:
        layer.train()
    _place_host_state(layers, device, plan.gpus if launched is None else 1)    # torchrun: nothing shared
    job = Job(program=program, layers=layers, start_step=start, factory=factory, shapes=shapes,
              device=device, memory_cap=cap, granularity=granularity, seed=seed,
              progress=progress, optimizer_state=state["optimizer"] if state else None,
              scheduler_state=state.get("schedulers") if state else None,
              checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None, checkpoint_every=checkpoint_every,
              plan=plan.to_dict(), losses_before=list(state["losses"]) if state else [], trace=trace,
              total=steps if steps is not None else _known_length(data, epochs or 1),
              scheduler=scheduler, clip_grad_norm=clip_grad_norm, precision=precision)
    results = run_job(job, batches) if batches is not None else []
    times = results[0].iteration_times if results else []
    return TrainResult(
        weights=[{k: v.detach().clone() for k, v in layer.state_dict().items()} for layer in layers],
        losses=results[0].losses if results else job.losses_before,
        samples_per_s=plan.batch * len(times) / sum(times) if times else 0.0,
        iteration_times=times, peak_device_bytes=[r.peak_bytes for r in results],
        start_step=start, steps=start + len(times), program=program,
        rank_pids=[r.pid for r in results], backend=results[0].backend if results else None,
        bytes_moved=[r.bytes_moved for r in results], device_peak_bytes=[r.device_peak_bytes for r in results],
        traces=[r.traces for r in results],
        traced=[t["step"] - start for t in results[0].traces] if results else [])


def _check_counts(plan: Plan, data, steps: int | None, epochs: int | None, clip: float | None) -> int | None:
    """Refuse bad step, epoch and clipping options; the number of steps (None: the data's end)."""
    if steps is not None and (not isinstance(steps, int) or steps < 0):
        raise UsageError(f"steps must be a whole number >= 0, got {steps!r}")
    if epochs is not None:
        if data is None:
            raise UsageError("epochs counts passes over the data: give data, or steps for the model's own batches")
        if not isinstance(epochs, int) or epochs < 1:
            raise UsageError(f"epochs must be a whole number >= 1, got {epochs!r}")
        if epochs > 1 and isinstance(data, collections.abc.Iterator):
            raise UsageError(f"epochs={epochs} needs data that can be read again (a list, a DataLoader), "
                             f"not a one-pass {type(data).__name__}")
    if data is None and steps is None:
        steps = 10
    if data is not None and steps is not None:
        n = _known_length(data, epochs or 1)
        if n is not None and n < steps:
            raise DataError(f"the data has {n} minibatches but {steps} steps were asked for")
    if clip is not None:
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0:
            raise UsageError(f"clip_grad_norm must be a number > 0, got {clip!r}")
        gpu = [f"{a}-{b}" for (a, b), o in zip(plan.packs_bwd, plan.options) if o.optimizer == "gpu"]
        if gpu:
            raise UsageError(f"clip_grad_norm needs every gradient before the first update, but pack(s) "
                             f"{', '.join(gpu)} step on the GPU inside the backward; plan with the optimizer on "
                             f"the CPU for every pack, or train without clipping")
    return steps


def _known_length(data, epochs: int) -> int | None:
    """Minibatches in ``epochs`` passes over ``data`` where it says (len), else None."""
    if data is None:
        return None
    try:
        return len(data) * epochs
    except TypeError:
        return None


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


def _stream(model, plan: Plan, data, start: int, steps: int | None, epochs: int, seed: int) -> Iterator[Batch]:
    """The minibatches of steps ``start`` on (up to ``steps``, or the data's end), each checked as it
    is drawn: a pair of tensors of the plan's minibatch size, shaped like the first one."""
    if data is None:
        raw = _made(model, plan, start, steps, seed)
    else:
        passes = itertools.chain.from_iterable(itertools.repeat(data, epochs))
        raw = itertools.islice(passes, start, steps)
    first, step = None, start
    for b in raw:
        if not (isinstance(b, (tuple, list)) and len(b) == 2 and all(isinstance(t, torch.Tensor) for t in b)):
            raise DataError(f"data batch {step}: expected a pair (inputs, targets) of tensors, got {type(b).__name__}")
        x, y = b
        for what, t in (("inputs", x), ("targets", y)):
            if t.dim() == 0 or t.shape[0] != plan.batch:
                raise DataError(f"data batch {step}: {what} hold {t.shape[0] if t.dim() else 0} samples but the "
                                f"plan's minibatch is {plan.batch}; every minibatch must hold exactly that many "
                                f"(a DataLoader: batch_size={plan.batch}, drop_last=True)")
        sig = (x.shape[1:], x.dtype, y.shape[1:], y.dtype)
        if first is None:
            first = sig
        elif sig != first:
            raise DataError(f"data batch {step}: samples of shape {tuple(x.shape[1:])} / {tuple(y.shape[1:])} "
                            f"differ from batch {start}'s {tuple(first[0])} / {tuple(first[2])}")
        yield x.detach().cpu(), y.detach().cpu()
        step += 1
    if steps is not None and step < steps:
        raise DataError(f"the data has {step} minibatches but {steps} steps were asked for")


def _made(model, plan: Plan, start: int, steps: int, seed: int) -> Iterator[Batch]:
    """``model.make_batch`` of each step, seeded per step; one that ignores its size is refused."""
    for s in range(start, steps):
        yield model.batch(plan.batch, torch.Generator().manual_seed(batch_seed(seed, s)), DataError)


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


class SampleSlices:
    """Minibatches of ``batch`` consecutive samples of ``inputs`` and ``targets`` (samples on dim 0),
    in order; the last slice, when shorter, is dropped. Re-iterable, with a length, so ``train(...,
    epochs=n)`` reads it ``n`` times."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor, batch: int):
        self.inputs, self.targets, self.batch = inputs, targets, batch

    def __len__(self) -> int:
        return self.inputs.shape[0] // self.batch

    def __iter__(self) -> Iterator[Batch]:
        for k in range(len(self)):
            rows = slice(k * self.batch, (k + 1) * self.batch)
            yield self.inputs[rows], self.targets[rows]


def load_samples(path: str | Path, batch: int) -> SampleSlices:
    """A data file's minibatches: a ``.pt`` file holding a dict with tensors ``inputs`` and ``targets``
    (samples on dim 0), read with ``torch.load(weights_only=True)`` (data, never code); refused with
    a DataError naming the file where it is not that, or holds fewer than ``batch`` samples."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} does not exist" if not path.exists() else f"data file {path} is a folder")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise DataError(f"data file {path}: not a readable torch file of tensors ({first_line(e)})") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(k), torch.Tensor) for k in ("inputs", "targets")):
        keys = sorted(map(str, data)) if isinstance(data, dict) else type(data).__name__
        raise DataError(f"data file {path}: expected a dict with tensors 'inputs' and 'targets', got {keys}")
    x, y = data["inputs"], data["targets"]
    if x.dim() == 0 or y.dim() == 0 or x.shape[0] != y.shape[0]:
        raise DataError(f"data file {path}: inputs {tuple(x.shape)} and targets {tuple(y.shape)} must hold the same "
                        f"number of samples on dimension 0")
    if x.shape[0] < batch:
        raise DataError(f"data file {path} holds {x.shape[0]} samples, fewer than one minibatch of {batch}")
    return SampleSlices(x, y, batch)


def save_pretrained(hf_model, folder: str | Path) -> Path:
    """``hf_model.save_pretrained(folder)``, each file replaced atomically (written in a temporary
    folder beside it first), so an interrupted save leaves the files as they were."""
    from .core.io import atomic_folder
    return atomic_folder(folder, hf_model.save_pretrained)


def save_weights(path: str | Path, weights: list[dict[str, torch.Tensor]]) -> Path:
    """Every layer's state dict (``TrainResult.weights``) as one, keys prefixed with the layer's index
    (``"3.weight"``: as ``nn.Sequential(*model.layers).state_dict()`` names them), written atomically."""
    import io

    from .core.io import atomic_write_bytes

    state = {f"{l}.{k}": v.detach().cpu().clone() for l, sd in enumerate(weights) for k, v in sd.items()}
    buf = io.BytesIO()
    torch.save(state, buf)
    return atomic_write_bytes(path, buf.getvalue())
