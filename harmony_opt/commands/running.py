"""`harmony-opt compile` (Plan -> Program) and `harmony-opt run` (train a model as a plan says)."""
from __future__ import annotations

from pathlib import Path

from ..core.errors import PlanError, UsageError
from ..core.plan import Plan
from ..core.precision import resolve as resolve_precision
from ..core.units import alloc_granularity, fmt_bytes, parse_bytes
from .common import MODEL_HELP, plan_hardware, plan_profile, writable_file, writable_folder
from .measure import add_overrides, add_precision, parse_overrides


def register(sub):
    c = sub.add_parser("compile", help="lower a plan to a per-GPU instruction program and validate it")
    c.add_argument("plan", help="plan JSON")
    c.add_argument("-o", "--output", required=True, help="program JSON to write")
    c.add_argument("--model", default=None,
                   help="measure the model's tensor sizes so that the program carries bytes and the memory cap "
                        "is checked: " + MODEL_HELP)
    add_overrides(c, " (with --model; the same as the profile the plan was made from took)")
    c.add_argument("--memory-cap", default=None, help="bytes per GPU to check against (default: the plan's)")
    c.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the program will run (with --model): on cuda every tensor is counted as the caching "
                        "allocator holds it, rounded up to 512 bytes")
    c.set_defaults(func=_compile)

    r = sub.add_parser("run", help="train a model with the plan's schedule (real tensors, CPU or GPUs)")
    r.add_argument("plan", help="plan JSON")
    r.add_argument("--model", required=True, help=MODEL_HELP)
    add_overrides(r, " (the same as the profile the plan was made from took)")
    r.add_argument("--program", default=None, metavar="FILE",
                   help="run this compiled program (from `harmony-opt compile`) instead of compiling the plan; "
                        "it must come from the same plan and, when it carries sizes, the same model")
    r.add_argument("--steps", type=int, default=None,
                   help="total steps, counted from step 0 (default: 20, or with --data every minibatch of "
                        "--epochs passes)")
    r.add_argument("--batch-data", choices=["synthetic"], default="synthetic",
                   help="without --data: the model's seeded synthetic minibatches")
    r.add_argument("--data", metavar="FILE", default=None,
                   help="train on a .pt file holding a dict with tensors 'inputs' and 'targets' (samples on dim "
                        "0): consecutive slices of the plan's minibatch, a last shorter slice dropped")
    r.add_argument("--epochs", type=int, default=None, help="passes over --data (default 1)")
    r.add_argument("--save", metavar="DIR", default=None,
                   help="write the trained weights to DIR/model.pt: one state dict, keys prefixed with the layer "
                        "index")
    r.add_argument("--checkpoint", metavar="DIR", default=None, help="write a checkpoint here (atomically)")
    r.add_argument("--checkpoint-every", type=int, default=None, metavar="N", help="also every N steps")
    r.add_argument("--resume", action="store_true", help="continue from the checkpoint in --checkpoint")
    r.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    r.add_argument("--optimizer", default=None, help="adam, sgd or adamw (default: the model's)")
    r.add_argument("--lr", type=float, default=1e-3)
    r.add_argument("--clip-grad-norm", type=float, default=None, metavar="MAX",
                   help="clip the gradients to this global 2-norm, as torch.nn.utils.clip_grad_norm_ on the whole "
                        "model (every pack's optimizer on the CPU)")
    r.add_argument("--seed", type=int, default=0)
    add_precision(r, "train in (default: the plan's, which its profile was measured in; another is refused)")
    r.add_argument("--memory-cap", default=None, help="live device bytes per rank (default: the plan's)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--trace", metavar="FILE", default=None,
                   help="write when every instruction of the last step ran, as a Chrome/Perfetto trace (JSON)")
    r.add_argument("--plot", metavar="PNG", default=None,
                   help="draw the last step as measured: a Gantt chart per rank and stream, like `simulate --plot`")
    r.add_argument("--no-compare", action="store_true",
                   help="do not time the last step's instructions nor compare them with the plan's simulation (by "
                        "default the run ends with the simulated and measured step time and busy time by kind of "
                        "work)")
    r.set_defaults(func=_run)


def _model(spec: str, items: list[str], trust_remote_code: bool = False):
    """The model ``--model`` names (a built-in name, a Hugging Face folder, ``file.py:function`` or
    ``module:function``) with the ``--set`` overrides ``items`` (as `profile --set` reads them)."""
    from ..measure.models import resolve_model
    return resolve_model(spec, trust_remote_code=trust_remote_code, **parse_overrides(items))


def _warn_on_threads(plan, args) -> None:
    """One line where the run's intra-op threads differ from those its profile was timed with (its
    times then do not hold); nothing where the plan's profile is not at hand."""
    from ..core.errors import HarmonyOptError
    from ..measure.flags import thread_note
    try:
        meta = plan_profile(plan, Path(args.plan), None).meta
    except HarmonyOptError:
        return
    note = thread_note(meta, args.device, plan.gpus)
    if note:
        print(f"warning: {note}")


def _compile(args):
    from ..compile.compiler import compile_plan
    from ..compile.validate import validate_program

    if args.overrides and not args.model:
        raise UsageError("--set changes the model's spec: give it with --model")
    plan = Plan.load(args.plan)
    sizes = None
    if args.model:
        import torch

        from harmony_opt.measure.shapes import measure_layer_bytes

        from ..training import check_plan

        model = _model(args.model, args.overrides, args.trust_remote_code)
        try:
            check_plan(model, plan)
        except PlanError as e:
            raise PlanError(f"{args.plan}: {e}") from None
        x, y = model.batch(1, torch.Generator().manual_seed(0))
        states = 2 if model.meta.get("optimizer", "adam") in ("adam", "adamw") else 1
        sizes = measure_layer_bytes(model.layers, x, y, optimizer_states=states,
                                    granularity=alloc_granularity(args.device), precision=plan.precision)
    cap = parse_bytes(args.memory_cap, "--memory-cap") if args.memory_cap else plan.memory_cap
    program = compile_plan(plan, layer_bytes=sizes, memory_cap=cap)
    stats = validate_program(program, cap_bytes=cap if sizes else None)
    out = program.save(args.output)
    for r, n in enumerate(stats.instructions):
        peak = f", peak {fmt_bytes(stats.peak_bytes[r])}" if stats.peak_bytes else ""
        print(f"rank {r}: {n} instructions{peak}")
    for note in program.notes:
        print(f"note: {note}")
    print(f"wrote {out}")


def _run(args):
    from ..compile.program import Program
    from ..training import load_samples, save_pretrained, save_weights, train

    if args.steps is not None and args.steps < 0:
        raise UsageError(f"--steps must be >= 0, got {args.steps}")
    if args.resume and not args.checkpoint:
        raise UsageError("--resume needs --checkpoint DIR")
    if args.epochs is not None and not args.data:
        raise UsageError("--epochs counts passes over --data FILE: give one, or --steps for synthetic data")
    plan = Plan.load(args.plan)
    try:
        resolve_precision(plan, args.precision)       # refused before the model is built
    except UsageError as e:
        raise UsageError(f"{args.plan}: {e}") from None
    _warn_on_threads(plan, args)
    program = Program.load(args.program) if args.program else None
    for option, path, example in (("--trace", args.trace, "trace.json"), ("--plot", args.plot, "gantt.png")):
        if path:                # a bad output path fails now, not after the training
            writable_file(path, option, example)
    if args.save:
        writable_file(str(writable_folder(args.save, f"--save {args.save}") / "model.pt"), "--save")
    data = load_samples(args.data, plan.batch) if args.data else None
    steps = args.steps if args.steps is not None or data is not None else 20
    model = _model(args.model, args.overrides, args.trust_remote_code)
    cap = parse_bytes(args.memory_cap, "--memory-cap") if args.memory_cap else None
    res = train(model, plan, data, optimizer=args.optimizer, lr=args.lr, steps=steps, epochs=args.epochs,
                checkpoint_dir=Path(args.checkpoint) if args.checkpoint else None,
                checkpoint_every=args.checkpoint_every, resume=args.resume, device=args.device, memory_cap=cap,
                progress=not args.no_progress, seed=args.seed, program=program, clip_grad_norm=args.clip_grad_norm,
                trace=bool(args.trace or args.plot or not args.no_compare), precision=args.precision)
    from harmony_opt.runtime.launch import torchrun_rank
    if torchrun_rank():         # under torchrun the summary, trace and plot come from rank 0 only
        return
    if args.save and hasattr(model.source, "save_pretrained"):
        # a Hugging Face model: the layers trained its own parameters (a tied head is the embedding's)
        print(f"wrote {save_pretrained(model.source, args.save)} (Hugging Face save_pretrained)")
    elif args.save:
        print(f"wrote {save_weights(Path(args.save) / 'model.pt', res.weights)}")
    ran = res.steps - res.start_step
    if ran == 0:
        print(f"nothing to do: the checkpoint is at step {res.start_step}" + (f" of {steps}" if steps else ""))
        return
    peak = ", ".join(fmt_bytes(b) for b in res.peak_device_bytes)
    if data is not None and len(data) * plan.batch < data.inputs.shape[0]:
        print(f"note: {args.data}: the last {data.inputs.shape[0] - len(data) * plan.batch} samples of each epoch "
              f"fill no whole minibatch of {plan.batch} and are not used")
    print(f"{model.name}: steps {res.start_step}..{res.steps - 1}, loss {res.losses[res.start_step]:.4f} -> "
          f"{res.losses[-1]:.4f}, {res.samples_per_s:.1f} samples/s, peak device memory per rank {peak}")
    for note in res.program.notes:
        print(f"note: {note}")
    if args.trace or args.plot:
        measured = res.timeline()
        busy = ", ".join(f"{s} {sum(measured.busy_time(s).values()):.3f} s"
                         for s in sorted(set(measured.events.stream)))
        print(f"last step {measured.iteration_time:.3f} s; busy per stream (all ranks): {busy}")
        if args.trace:
            print(f"wrote {measured.to_chrome_trace(args.trace)}")
        if args.plot:
            print(f"wrote {measured.plot(args.plot, title=f'{model.name}: last step as measured')}")
    if not args.no_compare:
        if not any(res.trace):
            print("note: not compared with the plan's simulation: the last step was not traced")
            return
        for line in promise_lines(plan, Path(args.plan), res.timeline(), res.untraced_step_time(),
                                  len(res.iteration_times) - 1 - len(res.traced)):
            print(line)


def promise_lines(plan, plan_path: Path, measured, median: float | None = None, untraced: int = 0) -> list[str]:
    """Whether the run kept the plan's promise: the measured step time against the plan's simulation
    (its recorded profile and hardware), and busy time by kind of work (the traced last step's); one
    note line where the plan's profile or hardware is not at hand. The step time is ``median``, of
    the ``untraced`` steps after the first (warm-up), where there are any, else the last step's."""
    from ..calibrate import format_table, idle_time, promise
    from ..core.errors import HarmonyOptError
    from ..sim.simulator import simulate
    try:
        profile = plan_profile(plan, plan_path, None)
        hw = plan_hardware(plan, plan_path, None)
        simulated = simulate(plan, profile, hw)
    except HarmonyOptError as e:
        why = " ".join(str(e).split())
        return [f"note: not compared with the plan's simulation: {why}"]
    took = measured.iteration_time if median is None else median
    ratio = took / simulated.iteration_time if simulated.iteration_time > 0 else float("nan")
    which = (f"the {untraced} untraced step(s) after the first took a median of {took:.4f} s "
             f"({ratio:.2f}x), the traced last {measured.iteration_time:.4f} s" if median is not None else
             f"the last step took {took:.4f} s ({ratio:.2f}x)")
    return [f"the plan's promise: {simulated.iteration_time:.4f} s per step simulated on {hw.name}; {which}; "
            f"busy time by kind of work in the last step (all ranks):",
            format_table(promise(measured, simulated)),
            f"no event running on rank 0: measured {idle_time(measured) * 1e3:.3f} ms, simulated "
            f"{idle_time(simulated) * 1e3:.3f} ms (the executor's own work between instructions)"]
