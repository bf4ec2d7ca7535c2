"""One process per GPU rank: the training loop around the Executor, and the launcher.

:func:`run_job` runs rank 0 in the calling process when the Program has one rank;
otherwise it spawns one process per rank (``torch.multiprocessing``, spawn) joined by
``torch.distributed`` (NCCL on GPUs, Gloo on the CPU). Minibatches stream: the launcher
draws them as the ranks run (a thread in the launcher puts each into every rank's bounded
queue, two steps ahead at most), so data is never all in memory at once and an error in
the data stops the run at the step that draws it. The master weights and buffers
are in shared host memory (the caller moves them there), so every rank reads what the
rank owning a pack's update wrote; each rank's optimizer state stays in its process,
because a pack is always updated by the same rank. Between iterations every rank waits
for its own updates and then for the others (the loss all-reduce), so no iteration
reads weights that an update of the previous one is still writing.

Under torchrun nothing is spawned and nothing is shared: :mod:`.launch` runs this process's
rank and keeps the ranks' host copies of the weights equal.

If a rank fails, the launcher stops the other ranks and raises the failing rank's
error with its own type when it is one of harmony_opt's.
"""
from __future__ import annotations

import dataclasses
import os
import queue as queue_mod
import socket
import threading
import time
import traceback
from datetime import timedelta

import torch
from torch import nn

from harmony_opt.core import errors
from harmony_opt.compile.program import Kind, Program

from .buffers import keep_freed_memory, pin_in_place
from .checkpoint import save_checkpoint
from .comm import Comm
from .executor import Executor
from .optim import OptimizerFactory, PackOptimizers, SchedulerFactory, host_threads, intra_op_threads
from .tied import tie_schedule


@dataclasses.dataclass
class Job:
    """Everything a rank needs but its minibatches (picklable: it travels to spawned processes)."""

    program: Program
    layers: list[nn.Module]
    start_step: int
    factory: OptimizerFactory
    shapes: list
    device: str = "cpu"
    memory_cap: int | None = None
    granularity: int | None = None                      # the guard's rounding (default: the device's allocator's)
    seed: int = 0
    progress: bool = True
    optimizer_state: dict | None = None                 # pack name -> optimizer state_dict
    scheduler_state: dict | None = None                 # pack name -> LR scheduler state_dict
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None                 # also always at the last step
    plan: dict | None = None
    losses_before: list[float] = dataclasses.field(default_factory=list)
    timeout_s: float = 300.0
    trace: int = 0                                      # record the instruction times of this many steps
                                                        # (traced_steps; True: the last one)
    total: int | None = None                            # the step the run ends at, where known (progress bar)
    scheduler: SchedulerFactory | None = None           # optimizer -> LR scheduler, stepped once per step
    clip_grad_norm: float | None = None                 # max global 2-norm of the gradients
    precision: str = "fp32"                             # "bf16": forwards under bf16 autocast (core.precision)


@dataclasses.dataclass
class RankResult:
    rank: int
    losses: list[float]
    iteration_times: list[float]
    peak_bytes: int
    device_peak_bytes: int | None
    pid: int                    # the process that ran the rank
    backend: str | None         # torch.distributed backend ("gloo", "nccl"); None in a one-rank run
    bytes_moved: dict = dataclasses.field(default_factory=dict)    # "h2d"/"d2h" bytes over the steps run
    traces: list = dataclasses.field(default_factory=list)         # the traced steps' steps, events and memory


def traced_steps(start: int, end: int, count: int) -> list[int]:
    """The steps of a run from ``start`` to ``end`` (exclusive) that are traced when ``count`` are
    asked for: the last, and every other step before it down to the run's second, at most
    ``count`` (the first warms up; only a one-step run traces it). Between them the untraced steps
    time the plan as it runs, and the traced ones sample the same stretch of the machine's drift."""
    if count < 1 or end <= start:
        return []
    if end - start == 1:
        return [start]
    return sorted(range(end - 1, start, -2))[-count:]


def updated_packs(program: Program, rank: int) -> list[tuple[int, int]]:
    return [x.layers for x in program.ranks[rank] if x.kind is Kind.UPD]


def run_rank(rank: int, job: Job, comm: Comm | None, batches) -> RankResult:
    """The training loop of one rank over ``batches`` (an iterable of minibatches, from start_step
    on); a checkpoint every ``checkpoint_every`` steps and after the last one."""
    device = torch.device(job.device if job.device != "cuda" else f"cuda:{comm.local_rank if comm else rank}")
    keep_freed_memory()
    optim = PackOptimizers(job.layers, updated_packs(job.program, rank), job.factory, job.scheduler,
                           tie_schedule(job.program, job.layers, rank))
    if job.optimizer_state:
        optim.load_state_dicts(job.optimizer_state, job.scheduler_state)
    ex = Executor(job.program, rank, job.layers, optim, job.shapes, device=device, comm=comm,
                  memory_cap=job.memory_cap, granularity=job.granularity, seed=job.seed, trace=job.trace,
                  defer_updates=job.clip_grad_norm is not None, precision=job.precision)
    losses = list(job.losses_before)
    bar = _progress(job, rank, job.total)
    ok, step, saved = False, job.start_step, job.start_step
    # the steps to trace, where the run's length is known (else every step, the newest kept)
    traced = set(traced_steps(job.start_step, job.total, int(job.trace))) if job.trace and job.total else None
    try:
        for x, y in batches:
            if traced is not None:
                ex.tracing(step in traced)
            part = ex.run_iteration(step, x, y)
            if ex.deferred is not None:     # every gradient of the step is in: clip, then the updates
                optim.clip_and_step(ex.deferred, job.clip_grad_norm, comm)
                ex.deferred.clear()
            losses.append(comm.sum_float(part) if comm else part)
            optim.step_schedulers(losses[-1])
            step += 1
            if bar is not None:
                bar.update(1)
                bar.set_postfix_str(f"loss {losses[-1]:.4f}, {x.shape[0] / ex.times[-1]:.1f} samples/s")
            due = bool(job.checkpoint_dir and job.checkpoint_every and step % job.checkpoint_every == 0)
            if comm:        # under torchrun: updated weights to the ranks that read them (launch.py)
                comm.after_step(everything=due)
            if due:
                _checkpoint(job, rank, comm, optim, step, losses)
                saved = step
        if comm:            # every rank runs as many steps: the last weights everywhere
            comm.after_step(everything=True)
        if job.checkpoint_dir and step != saved:
            _checkpoint(job, rank, comm, optim, step, losses)
        ok = True
    finally:
        ex.close()
        if bar is not None:
            bar.leave = ok          # a failed run erases its bar: the error stays the one line on stderr
            bar.close()
    cuda_peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    backend = comm.backend_in_use() if comm else None
    return RankResult(rank, losses, ex.times, ex.table.peak, cuda_peak, os.getpid(), backend, dict(ex.moved),
                      ex.traces)


def _progress(job: Job, rank: int, total: int):
    if not job.progress or rank != 0:
        return None
    from tqdm import tqdm
    return tqdm(total=total, initial=job.start_step, desc="train", unit="step")


def _checkpoint(job: Job, rank: int, comm: Comm | None, optim: PackOptimizers, step: int, losses: list[float]):
    mine = (optim.state_dicts(), optim.scheduler_state_dicts())
    states = comm.gather_objects(mine) if comm else [mine]
    if rank == 0:
        merged = {k: v for s, _ in states for k, v in s.items()}
        scheds = {k: v for _, s in states for k, v in s.items()} if job.scheduler is not None else None
        save_checkpoint(job.checkpoint_dir, step=step, layers=job.layers, optimizer=merged, losses=losses,
                        plan_identity=job.program.plan_identity, plan=job.plan or {}, seed=job.seed,
                        schedulers=scheds)
    if comm:
        comm.barrier()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _queued(rank: int, inbox, timeout_s: float):
    """The minibatches the launcher puts in this rank's queue, until its end mark (None)."""
    while True:
        try:
            item = inbox.get(timeout=timeout_s)
        except queue_mod.Empty:
            raise errors.DataError(f"rank {rank}: no minibatch came from the launcher in {timeout_s:.0f} s") from None
        if item is None:
            return
        if isinstance(item, str):            # the launcher raises the data's own error
            raise errors.DataError(f"rank {rank}: {_DATA_FAILED}")
        yield item


def _rank_main(rank: int, world: int, port: int, job: Job, results, inbox) -> None:
    """Entry point of a spawned rank: join the process group, train, report."""
    import torch.distributed as dist

    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(host_threads(world, job.device))
        backend = "nccl" if job.device == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(rank)
            for layer in job.layers:
                for t in list(layer.parameters()) + list(layer.buffers()):
                    pin_in_place(t)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=job.timeout_s))
        try:
            comm = Comm(rank, world, backend, job.program, job.timeout_s)
            results.put(("ok", rank, run_rank(rank, job, comm, _queued(rank, inbox, job.timeout_s))))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # reported to the launcher, which re-raises it
        results.put(("error", rank, type(e).__name__, str(e), traceback.format_exc()))


#: Modules the fork server imports once, so that every later rank process starts warm.
_PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "harmony_opt.compile.program", "harmony_opt.runtime.worker"]


def layer_modules(layers: list[nn.Module]) -> list[str]:
    """Modules defining the layers' classes: a rank must import them to unpickle its layers
    (transformers' GPT-2 takes seconds), so the fork server imports them once instead."""
    names = {type(m).__module__ for layer in layers for m in layer.modules()}
    return sorted(n for n in names if n != "__main__" and not n.startswith("torch."))


def _context(modules: list[str]):
    """Processes come from a fork server that has imported torch, this package and ``modules``
    once (a clean, single-threaded process: safe to fork, CUDA untouched), so each run skips the
    seconds a freshly spawned interpreter spends importing them; spawn where there is no fork
    server. A fork server already running without ``modules`` is restarted with them."""
    mp = torch.multiprocessing
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    from multiprocessing import forkserver

    want = list(dict.fromkeys(_PRELOAD + modules))
    server = forkserver._forkserver
    have = getattr(server, "_preload_modules", None)
    if have is not None and not set(want) <= set(have) and getattr(server, "_forkserver_pid", None):
        server._stop()      # private, but the only way to change what a running fork server preloads
    ctx = mp.get_context("forkserver")
    if have is None or not set(want) <= set(have):
        keep = [m for m in have or [] if m != "__main__"]     # never re-run the caller's script there
        ctx.set_forkserver_preload(list(dict.fromkeys(keep + want)))
    return ctx


_DATA_FAILED = "the launcher's data failed"


class _Feeder(threading.Thread):
    """Draws the minibatches in the launcher and puts each into every rank's bounded queue, then
    the end mark. An error of the data (a DataError of batch k) is kept for the launcher to raise
    and a mark takes the batch's place in the queues, so the ranks run every step before it, as
    a single rank does, and stop there."""

    def __init__(self, batches, inboxes):
        super().__init__(name="harmony-opt-feeder", daemon=True)
        self.batches, self.inboxes = batches, inboxes
        self.stop, self.error = threading.Event(), None

    def _put(self, item) -> bool:
        for inbox in self.inboxes:
            while True:
                if self.stop.is_set():
                    return False
                try:
                    inbox.put(item, timeout=0.5)
                    break
                except queue_mod.Full:
                    continue
        return True

    def run(self) -> None:
        try:
            for x, y in self.batches:       # copies: the queue moves what it sends into shared memory
                if not self._put((x.clone(), y.clone())):
                    return
            self._put(None)
        except BaseException as e:          # noqa: BLE001  (re-raised by the launcher)
            self.error = e
            self._put(_DATA_FAILED)


def run_job(job: Job, batches) -> list[RankResult]:
    """Run ``job`` on every rank of its Program over the minibatches ``batches`` yields (drawn as
    the steps run); results ordered by rank. Under torchrun this process runs its own rank only
    (every rank draws the same minibatches itself), and a rank other than 0 gets its own result
    alone."""
    world = job.program.gpus
    from .launch import run_torchrun, torchrun_env
    env = torchrun_env()
    if env is not None and world > 1:       # started by torchrun: join its group as this process's rank
        return run_torchrun(job, env, batches)
    if world == 1:
        with intra_op_threads(host_threads(1, job.device, torch.get_num_threads())):
            return [run_rank(0, job, None, batches)]
    ctx = _context(layer_modules(job.layers))
    results = ctx.Queue()
    inboxes = [ctx.Queue(maxsize=2) for _ in range(world)]
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, job, results, inboxes[r]),
                         name=f"harmony-opt-rank{r}") for r in range(world)]
    for p in procs:
        p.start()
    feeder = _Feeder(batches, inboxes)
    feeder.start()
    got: dict[int, RankResult] = {}
    try:
        while len(got) < world:
            try:
                msg = results.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
                if dead:
                    raise RuntimeError(f"rank process {dead[0].name} died with exit code {dead[0].exitcode} before "
                                       f"reporting (if its error mentions the bootstrapping phase: call train() "
                                       f"under `if __name__ == \"__main__\":`, as any torch.multiprocessing code)")
                continue
            if msg[0] == "error":
                if feeder.error is not None and msg[3].endswith(_DATA_FAILED):
                    raise feeder.error
                _, rank, name, text, tb = msg
                cls = getattr(errors, name, None)
                if isinstance(cls, type) and issubclass(cls, errors.HarmonyOptError):
                    raise cls(text if text.startswith(f"rank {rank}:") else f"rank {rank}: {text}")
                raise RuntimeError(f"rank {rank} failed: {name}: {text}\n{tb}")
            got[msg[1]] = msg[2]
    finally:
        feeder.stop.set()
        feeder.join(timeout=5)    # a data loader blocked in a read is left to end with the process (daemon)
        for inbox in inboxes:
            inbox.cancel_join_thread()      # what a stopped rank never read must not hold up this process
        deadline = time.monotonic() + 30
        for p in procs:
            if len(got) < world:
                p.terminate()
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(world)]
