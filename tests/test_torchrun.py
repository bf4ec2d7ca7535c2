"""train() and `harmony-opt run` under torchrun: two single-process "nodes" on loopback (Gloo).

Each test starts ``python -m torch.distributed.run --nnodes 2 --node-rank K --nproc-per-node 1`` twice
as subprocesses; the ranks do not share host memory, so these check that the weight broadcasts of
runtime/launch.py make the run equal to the local launcher's (which shares the master weights).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harmony_opt.cli import main
from harmony_opt.compile.compiler import compile_plan
from harmony_opt.core.errors import UsageError
from harmony_opt.runtime.launch import dist_timeout, sync_plan, torchrun_env
from harmony_opt.training import train
from test_train import GPT2_PLAN, mlp
from torchrun_train import torchrun_plan

pytestmark = pytest.mark.usefixtures("one_thread")

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "torchrun_train.py")
LIMIT_S = 240        # per launch: a hang fails the test instead of stalling CI


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(args: list[str], cwd: Path, *, nodes: int = 2, env: dict | None = None,
             hung: int | None = None) -> list[tuple[int, str, str]]:
    """Run ``args`` (a script and its arguments, or ``-m module ...``) on ``nodes`` torchrun nodes of one
    process each; (exit code, stdout, stderr) per node. Node ``hung`` is stopped once the others end.
    torchrun's agent runs its ranks in their own sessions and stops them on SIGTERM, so SIGTERM it
    is (SIGKILL would leave the ranks running, holding the pipes open)."""
    port = _port()
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    base.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE), base.get("PYTHONPATH", "")]),
                **(env or {}))
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes),
                               "--node-rank", str(k), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
                               "--master-port", str(port), *args],
                              cwd=cwd, env=base, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True) for k in range(nodes)]
    try:
        outs = {k: p.communicate(timeout=LIMIT_S) for k, p in enumerate(procs) if k != hung}
        if hung is not None:
            procs[hung].terminate()
            outs[hung] = procs[hung].communicate(timeout=60)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.terminate()
        tails = []
        for p in procs:
            try:
                tails.append(p.communicate(timeout=60)[1][-2000:])
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"torchrun did not finish within {LIMIT_S} s: {tails}")
    return [(p.returncode, *outs[k]) for k, p in enumerate(procs)]


def max_diff(a: list[dict], b: list[dict]) -> float:
    assert [sorted(x) for x in a] == [sorted(y) for y in b]
    return max((x[k].double() - y[k].double()).abs().max().item() for x, y in zip(a, b) for k in x)


def test_the_environment_says_whether_torchrun_started_the_process(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "HARMONY_OPT_DIST_TIMEOUT"):
        monkeypatch.delenv(k, raising=False)
    assert torchrun_env() is None and dist_timeout(300.0) == 300.0
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(UsageError, match="RANK set but not WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT"):
        torchrun_env()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    env = torchrun_env()
    assert (env.rank, env.world, env.local_rank, env.master) == (1, 2, 0, "10.0.0.1:29500")
    with pytest.raises(UsageError, match="torchrun started 2 processes .* the plan runs on 4 GPUs"):
        env.check(4, "cpu")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(UsageError, match="RANK 2 is not in 0..WORLD_SIZE-1"):
        torchrun_env()
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(UsageError, match="must be integers"):
        torchrun_env()
    monkeypatch.setenv("HARMONY_OPT_DIST_TIMEOUT", "0")
    with pytest.raises(UsageError, match="HARMONY_OPT_DIST_TIMEOUT must be a positive number of seconds"):
        dist_timeout(300.0)


def test_each_layer_is_broadcast_from_the_rank_that_writes_it():
    """vPP with the forward of layers 0..2 on rank 0 and the backward of layer 0 on rank 1: rank 0 reads
    layer 0's weights, which rank 1 updates; vDP: every rank reads everything, rank 1 updates layer 2."""
    vpp = {(l, k): (o, set(r)) for l, k, o, r in sync_plan(compile_plan(torchrun_plan("vPP", 2)))}
    assert vpp[(0, "W")] == (1, {0, 1}) and vpp[(1, "W")] == (0, {0}) and vpp[(3, "W")] == (1, {1})
    vdp = sync_plan(compile_plan(torchrun_plan("vDP", 2)))
    assert [(l, k, o) for l, k, o, _ in vdp if k == "W"] == [(0, "W", 0), (1, "W", 0), (2, "W", 1), (3, "W", 0),
                                                             (4, "W", 0)]
    assert all(r == {0, 1} for *_, r in vdp)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["vPP", "vDP"])
def test_torchrun_trains_like_the_local_launcher(tmp_path, mode):
    runs = torchrun([SCRIPT, mode, "2", "3", "out.pt"], tmp_path)
    assert [r[0] for r in runs] == [0, 0], [r[2][-3000:] for r in runs]
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    local = train(mlp(), torchrun_plan(mode, 2), steps=3, progress=False)
    assert max_diff(got["weights"], local.weights) <= 1e-6
    assert got["losses"] == pytest.approx(local.losses, abs=1e-9)
    assert got["backend"] == "gloo" and len(set(got["pids"])) == 2 and len(got["peaks"]) == 2   # gathered
    assert "rank 1: 1 result(s), 3 losses" in runs[1][1]          # other ranks: their own result


@pytest.mark.slow
def test_a_world_that_is_not_the_plans_gpu_count_is_refused_on_every_rank(tmp_path):
    runs = torchrun([SCRIPT, "vPP", "3", "3", "out.pt"], tmp_path)
    for code, _, err in runs:
        assert code != 0 and "exitcode  : 2" in err        # torchrun's report of the rank's exit code
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert lines == ["error: torchrun started 2 processes (WORLD_SIZE) but the plan runs on 3 GPUs; start one "
                         "process per GPU of the plan (--nnodes x --nproc-per-node = 3)"]
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.slow
def test_a_rank_that_dies_stops_the_others_with_a_clear_error(tmp_path):
    runs = torchrun([SCRIPT, "vDP", "2", "3", "out.pt"], tmp_path,
                    env={"DIE_AT_STEP": "1", "HARMONY_OPT_DIST_TIMEOUT": "30"})
    assert "exitcode  : 3" in runs[1][2]                   # rank 1 died at step 1
    code, _, err = runs[0]
    assert code != 0 and "exitcode  : 2" in err, err[-3000:]
    line, = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith("error: rank 0 of 2: another rank stopped or did not answer within 30 s (")
    assert "Traceback" not in err.split("ChildFailedError")[0].split(line)[0]
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.slow
def test_a_rank_that_stops_answering_stops_the_others_at_the_timeout(tmp_path):
    runs = torchrun([SCRIPT, "vDP", "2", "3", "out.pt"], tmp_path, hung=1,
                    env={"DIE_AT_STEP": "1", "HANG": "1", "HARMONY_OPT_DIST_TIMEOUT": "10"})
    code, _, err = runs[0]
    assert code != 0 and "exitcode  : 2" in err, err[-3000:]
    line, = [x for x in err.splitlines() if x.startswith("error:")]
    assert line.startswith("error: rank 0 of 2: another rank stopped or did not answer within 10 s (")
    assert "Timed out" in line


@pytest.mark.slow
def test_cli_run_under_torchrun_checkpoints_and_resumes_like_a_local_run(tmp_path):
    plan = tmp_path / "plan.json"          # rank 0 runs the forward of layers 0..4, rank 1 updates 0..2
    plan.write_text(json.dumps({**GPT2_PLAN, "gpus": 2, "packs": {"fwd": [[0, 4]], "bwd": [[0, 2], [3, 4], [5, 7]]}}))
    cli = ["-m", "harmony_opt.cli", "run", str(plan), "--model", "gpt2-tiny", "--checkpoint", "ck"]
    first = torchrun(cli + ["--steps", "2"], tmp_path)
    assert [r[0] for r in first] == [0, 0], [r[2][-3000:] for r in first]
    assert "gpt2-tiny: steps 0..1" in first[0][1] and first[1][1] == ""    # the summary from rank 0 only
    assert "2/2" in first[0][2] and "2/2" not in first[1][2]               # so is the progress bar
    rest = torchrun(cli + ["--steps", "3", "--resume", "--no-progress"], tmp_path)
    assert [r[0] for r in rest] == [0, 0] and "steps 2..2" in rest[0][1]
    assert main(["run", str(plan), "--model", "gpt2-tiny", "--steps", "3", "--checkpoint",
                 str(tmp_path / "local"), "--no-progress"]) == 0
    a, b = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (tmp_path / "ck", tmp_path / "local"))
    assert a["step"] == b["step"] == 3 and a["losses"] == pytest.approx(b["losses"], abs=1e-9)
    assert max_diff(a["layers"], b["layers"]) <= 1e-6
    assert sorted(a["optimizer"]) == sorted(b["optimizer"]) == ["0-2", "3-4", "5-7"]   # rank 1's state gathered
    moments = [[{f"{i}.{k}": v for i, s in p["state"].items() for k, v in s.items()}
                for _, p in sorted(c["optimizer"].items())] for c in (a, b)]
    assert max_diff(*moments) <= 1e-6
    assert sorted(os.listdir(tmp_path / "ck")) == ["checkpoint.pt"]
