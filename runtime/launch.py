"""Running under torchrun: each process joins the launcher's process group as its own rank.

``torchrun`` (``python -m torch.distributed.run``) starts one process per rank and sets
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``. With those set,
:func:`harmony_opt.train` does not spawn processes: this process runs only its own rank's
instructions, on ``cuda:LOCAL_RANK`` on GPUs.

The local launcher keeps the master weights in shared host memory, so a rank reads what the rank
updating a pack wrote. Ranks started by torchrun share nothing, so each holds a full host copy
and the copies are kept equal by broadcasts over the Gloo control group:

- before the first step, every layer's weights and buffers from rank 0 (the model it built or
  the checkpoint it resumed from);
- after every step (once every rank has finished its updates: the loss all-reduce), each layer's
  weights from the rank whose update writes them, and its buffers from the lowest rank that
  writes them back (BatchNorm statistics), to every rank; a layer no other rank reads is skipped,
  except at the last step and at checkpoint steps, where every layer goes, so rank 0 writes the
  whole model and every rank returns it.

Every rank runs these broadcasts in the same fixed order (layer, then weights before buffers),
which the Program alone decides, so they line up without negotiation.

Joining the group and every collective are bounded by one timeout (``Job.timeout_s``, 300 s,
or ``HARMONY_OPT_DIST_TIMEOUT`` seconds); a peer that dies or stops answering becomes a
:class:`~harmony_opt.core.errors.DistributedError` on the ranks still running.
"""
from __future__ import annotations

import dataclasses
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from harmony_opt.compile.program import Program, effects
from harmony_opt.core.errors import DistributedError, HarmonyOptError, UsageError, first_line

from .comm import Comm

ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
TIMEOUT_ENV = "HARMONY_OPT_DIST_TIMEOUT"


@dataclasses.dataclass(frozen=True)
class TorchrunEnv:
    """Where torchrun put this process."""

    rank: int
    world: int
    local_rank: int
    master: str            # MASTER_ADDR:MASTER_PORT

    def check(self, gpus: int, device: str) -> None:
        """Refuse, before any group is joined, a world that is not the plan's GPU count (every rank
        sees the same WORLD_SIZE, so every rank refuses alike and none waits for the others)."""
        if self.world != gpus:
            raise UsageError(f"torchrun started {self.world} processes (WORLD_SIZE) but the plan runs on {gpus} "
                             f"GPUs; start one process per GPU of the plan (--nnodes x --nproc-per-node = {gpus})")
        if device == "cuda" and torch.cuda.is_available() and torch.cuda.device_count() <= self.local_rank:
            raise UsageError(f"rank {self.rank}: LOCAL_RANK is {self.local_rank} but this machine has "
                             f"{torch.cuda.device_count()} visible GPUs")


def torchrun_env() -> TorchrunEnv | None:
    """This process's place in a torchrun job, or None when not started by torchrun (none of the
    variables set). Some but not all of them set, or a malformed one, is a UsageError."""
    have = {k: os.environ.get(k) for k in ENV}
    if not any(have[k] for k in ENV[:3]):
        return None
    missing = [k for k, v in have.items() if not v]
    if missing:
        raise UsageError(f"{', '.join(k for k in ENV[:3] if have[k])} set but not {', '.join(missing)}: "
                         f"start the run with torchrun, or unset them to run on this machine")
    try:
        rank, world, local = (int(have[k]) for k in ENV[:3])
    except ValueError:
        raise UsageError(f"RANK, WORLD_SIZE and LOCAL_RANK must be integers, got {have['RANK']!r}, "
                         f"{have['WORLD_SIZE']!r}, {have['LOCAL_RANK']!r}") from None
    if not (0 <= rank < world and local >= 0):
        raise UsageError(f"RANK {rank} is not in 0..WORLD_SIZE-1 ({world - 1}) or LOCAL_RANK {local} is negative")
    return TorchrunEnv(rank, world, local, f"{have['MASTER_ADDR']}:{have['MASTER_PORT']}")


def torchrun_rank() -> int | None:
    """This process's rank under torchrun, None otherwise (the CLI prints its summary on rank 0 only)."""
    env = torchrun_env()
    return env.rank if env else None


def dist_timeout(default: float) -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise UsageError(f"{TIMEOUT_ENV} must be a positive number of seconds, got {raw!r}")
    return value


def sync_plan(program: Program) -> list[tuple[int, str, int, frozenset[int]]]:
    """Per layer and host tensor (``W`` weights, ``B`` buffers) written during a step: (layer, kind,
    the rank whose copy wins, the ranks that read it), in the order every rank broadcasts them."""
    writers: dict[tuple[str, int], set[int]] = {}
    readers: dict[tuple[str, int], set[int]] = {}
    for rank, instrs in enumerate(program.ranks):
        for ins in instrs:
            e = effects(ins, program.num_layers)
            for table, refs in ((writers, e.host_writes), (readers, e.host_reads)):
                for (key, _rows) in refs:
                    if key[0] in ("W", "B"):
                        table.setdefault((key[0], key[1]), set()).add(rank)
    return [(layer, kind, min(ranks), frozenset(readers.get((kind, layer), ())))
            for (kind, layer), ranks in sorted(writers.items(), key=lambda kv: (kv[0][1], kv[0][0] == "B"))]


def _broadcast(tensors, src: int, group) -> None:
    for t in tensors:
        if t.is_contiguous():
            dist.broadcast(t.data, src=src, group=group)
        else:
            tmp = t.detach().contiguous()
            dist.broadcast(tmp, src=src, group=group)
            if dist.get_rank() != src:
                t.data.copy_(tmp)


class TorchrunComm(Comm):
    """A rank's communication when torchrun started it: also keeps the host copies equal."""

    def __init__(self, env: TorchrunEnv, backend: str, program: Program, layers, timeout_s: float):
        super().__init__(env.rank, env.world, backend, program, timeout_s)
        self.local_rank = env.local_rank
        self.layers = layers
        self.plan = sync_plan(program)

    def _tensors(self, layer: int, kind: str):
        m = self.layers[layer]
        return list(m.parameters()) if kind == "W" else list(m.buffers())

    @torch.no_grad()
    def share_initial(self) -> None:
        """Every rank starts from rank 0's weights and buffers."""
        for layer in range(len(self.layers)):
            _broadcast(self._tensors(layer, "W") + self._tensors(layer, "B"), 0, self.ctrl)

    @torch.no_grad()
    def after_step(self, everything: bool) -> None:
        for layer, kind, owner, readers in self.plan:
            if everything or readers - {owner}:
                _broadcast(self._tensors(layer, kind), owner, self.ctrl)


def _peer_failure(err: BaseException) -> bool:
    """Whether ``err`` (or what caused it) is torch.distributed reporting a lost or silent peer."""
    seen = 0
    while err is not None and seen < 10:
        if isinstance(err, getattr(dist, "DistError", ())) or any(
                s in str(err) for s in ("Connection closed by peer", "Connection reset", "Timed out",
                                        "timed out", "Broken pipe", "gloo", "NCCL")):
            return True
        err, seen = err.__cause__ or err.__context__, seen + 1
    return False


def run_torchrun(job, env: TorchrunEnv, batches) -> list:
    """Run this process's rank of ``job``. Rank 0 returns every rank's RankResult (gathered), in
    rank order; any other rank a list holding its own."""
    from .optim import host_threads
    from .worker import run_rank

    timeout = dist_timeout(job.timeout_s)
    backend = "nccl" if job.device == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE") or env.world)     # ranks sharing this machine's cores
    torch.set_num_threads(host_threads(local_world, job.device, torch.get_num_threads()))
    where = f"rank {env.rank} of {env.world}"
    try:
        dist.init_process_group(backend, rank=env.rank, world_size=env.world, timeout=timedelta(seconds=timeout))
    except Exception as e:
        raise DistributedError(f"{where}: could not join the process group at {env.master} within {timeout:g} s "
                               f"({first_line(e)})") from None
    try:
        comm = TorchrunComm(env, backend, job.program, job.layers, timeout)
        comm.share_initial()
        mine = run_rank(env.rank, job, comm, batches)
        gathered = comm.gather_objects(mine)
    except HarmonyOptError:
        raise
    except Exception as e:
        if not _peer_failure(e):
            raise
        first = next((x for x in str(e).splitlines() if x.strip()), type(e).__name__)
        raise DistributedError(f"{where}: another rank stopped or did not answer within {timeout:g} s "
                               f"({first[:300]}); the failing rank's own output says why") from None
    finally:
        dist.destroy_process_group()
    return gathered if env.rank == 0 else [mine]
