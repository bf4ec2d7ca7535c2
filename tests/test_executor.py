"""Training through the executor equals plain single-device PyTorch training.

The reference runs the whole minibatch at once (loss = mean over its samples) and one
optimizer over all parameters; the executor runs microbatches, packs, swaps, sends and
per-pack optimizers. Only the order in which microbatch gradients are summed differs,
so every layer's weights agree to 1e-5 (relative Frobenius error) after 10 steps.
"""
from __future__ import annotations

import copy
import functools
import math
import os

import pytest
import torch
from torch import nn

from harmony_opt.compile.compiler import compile_plan, instruction_key
from harmony_opt.measure.decompose import ClassificationLoss, LayeredModel, run_layers
from harmony_opt.core.errors import ProgramError, RuntimeMemoryError
from harmony_opt.core.plan import PackOptions, Plan
from harmony_opt.compile.program import Kind, Program, Tensor
from harmony_opt.training import batch_seed, train

STEPS = 10


# one intra-op thread for every test here (conftest.one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")


def _mlp_batch(batch: int, gen: torch.Generator):
    return torch.randn(batch, 8, generator=gen), torch.randint(4, (batch,), generator=gen)


def mlp(seed: int = 0, dropout: float = 0.0, norm: bool = False) -> LayeredModel:
    """Six layers: four hidden (Linear, Tanh[, BatchNorm][, Dropout]), a head, the loss."""
    torch.manual_seed(seed)

    def hidden(i, o):
        mods = [nn.Linear(i, o)] + ([nn.BatchNorm1d(o)] if norm else []) + [nn.Tanh()]
        return nn.Sequential(*mods, *([nn.Dropout(dropout)] if dropout else []))
    layers = [hidden(8, 16), hidden(16, 16), hidden(16, 16), hidden(16, 16), nn.Linear(16, 4), ClassificationLoss()]
    return LayeredModel("mlp", layers, _mlp_batch, {"optimizer": "sgd"})


@functools.lru_cache(maxsize=1)
def _gpt2():
    from harmony_opt.measure.models import build_model
    return build_model("gpt2-tiny")


def gpt2() -> LayeredModel:
    return copy.deepcopy(_gpt2())


def plan(mode, gpus, batch, uf, ub, fwd, bwd, R, options=(), **kw) -> Plan:
    return Plan(planner="test", mode=mode, gpus=gpus, batch=batch, microbatch_fwd=uf, microbatch_bwd=ub,
                packs_fwd=fwd, packs_bwd=bwd, num_layers=R, options=options, allow_uneven=True, **kw)


def reference(model: LayeredModel, batch: int, factory, steps: int = STEPS, seed: int = 0):
    """Plain PyTorch: whole minibatch, one optimizer, same data."""
    layers = model.layers
    opt = factory([p for layer in layers for p in layer.parameters()])
    for s in range(steps):
        x, y = model.make_batch(batch, torch.Generator().manual_seed(batch_seed(seed, s)))
        opt.zero_grad()
        run_layers(layers, x, y).backward()
        opt.step()
    return [{k: v.detach().clone() for k, v in layer.state_dict().items()} for layer in layers]


def layer_errors(got, want) -> list[float]:
    """Relative Frobenius error of each layer's weights (layers without weights skipped)."""
    out = []
    for a, b in zip(got, want):
        keys = [k for k in b if b[k].is_floating_point()]
        if keys:
            diff = torch.cat([(a[k] - b[k]).flatten() for k in keys])
            out.append(float(diff.norm() / torch.cat([b[k].flatten() for k in keys]).norm()))
    return out


SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
ADAM = functools.partial(torch.optim.Adam, lr=1e-3)
NO_RC = PackOptions(recompute=False)
GPU_OPT = PackOptions(optimizer="gpu")

CASES = {
    # name: (model, plan, optimizer)
    "mlp-vpp-recompute-sgd": ("mlp", plan("vPP", 1, 8, 4, 4, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6), SGD),
    "mlp-vpp-ufwd4-ubwd2-stash-adam": ("mlp", plan("vPP", 1, 8, 4, 2, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6,
                                                   (NO_RC, NO_RC, NO_RC)), ADAM),
    "mlp-vpp-mixed-gpu-optimizer-adam": ("mlp", plan("vPP", 1, 6, 3, 2, [(0, 2)], [(0, 0), (1, 2), (3, 5)], 6,
                                                     (NO_RC, GPU_OPT, PackOptions())), ADAM),
    "mlp-vdp-uneven-stash-sgd": ("mlp", plan("vDP", 1, 7, 3, 2, [(0, 3)], [(0, 1), (2, 3), (4, 5)], 6,
                                             (NO_RC, NO_RC, GPU_OPT)), SGD),
    "mlp-one-pack-no-prefetch-adam": ("mlp", plan("vPP", 1, 4, 2, 2, [], [(0, 5)], 6, prefetch=False), ADAM),
    "mlp-naive-swap-sweeps-adam": ("mlp", plan("vDP", 1, 7, 3, 3, [(0, 0), (1, 2)], [(0, 0), (1, 2), (3, 5)], 6,
                                               input_batch_grouping=False), ADAM),
    "gpt2-vpp-ufwd2-ubwd1-stash-adam": ("gpt2", plan("vPP", 1, 4, 2, 1, [(0, 2), (3, 4)],
                                                     [(0, 2), (3, 4), (5, 7)], 8, (NO_RC, NO_RC, NO_RC)), ADAM),
    "gpt2-vdp-recompute-sgd": ("gpt2", plan("vDP", 1, 4, 4, 2, [(0, 4)], [(0, 1), (2, 4), (5, 7)], 8), SGD),
    # handoffs kept on the GPU (one microbatch per phase: all of them; two forward microbatches: backward only)
    "mlp-vdp-gpu-handoff-stash-adam": ("mlp", plan("vDP", 1, 4, 4, 4, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6,
                                                   (NO_RC, GPU_OPT, PackOptions()), gpu_handoff=True), ADAM),
    "gpt2-vdp-gpu-handoff-ufwd2-sgd": ("gpt2", plan("vDP", 1, 4, 2, 4, [(0, 2), (3, 4)], [(0, 1), (2, 4), (5, 7)], 8,
                                                    gpu_handoff=True), SGD),
    # swaps in the order a plan carries (Plan.transfer_order): every output before the stash, dY before sX
    "mlp-vdp-transfer-order-sgd": ("mlp", plan("vDP", 1, 8, 4, 4, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6,
                                               transfer_order=[(0, "swap_out", ("Y[2]@0+4", "Y[2]@4+4", "Y[4]@0+4",
                                                                                "Y[4]@4+4", "sX[2]@0+4", "sX[2]@4+4")),
                                                               (0, "swap_in", ("dY[4]@0+4", "sX[2]@0+4", "dY[4]@4+4",
                                                                               "sX[2]@4+4"))]), SGD),
    # two ranks: one process each (kept few: starting processes is the slow part; GPT-2 first, so the
    # fork server starts once, with transformers imported, and the MLP runs reuse it)
    "gpt2-vpp-2ranks-stash-send-adam": ("gpt2", plan("vPP", 2, 4, 2, 1, [(0, 2), (3, 4)],
                                                     [(0, 1), (2, 4), (5, 7)], 8), ADAM),
    "mlp-vpp-2ranks-ufwd4-ubwd2-adam": ("mlp", plan("vPP", 2, 8, 4, 2, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)],
                                                    6, (NO_RC, GPU_OPT, PackOptions())), ADAM),
    "mlp-vdp-2ranks-uneven-sgd": ("mlp", plan("vDP", 2, 7, 2, 3, [(0, 3)], [(0, 1), (2, 3), (4, 5)], 6,
                                              (NO_RC, PackOptions(), GPU_OPT)), SGD),
    "mlp-vdp-2ranks-naive-swap-sgd": ("mlp", plan("vDP", 2, 8, 2, 2, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6,
                                                  input_batch_grouping=False), SGD),
    "mlp-vdp-2ranks-uneven-gpu-handoff-sgd": ("mlp", plan("vDP", 2, 7, 4, 4, [(0, 1), (2, 3)],
                                                          [(0, 1), (2, 3), (4, 5)], 6, gpu_handoff=True), SGD),
    "mlp-vdp-2ranks-recompute-adam": ("mlp", plan("vDP", 2, 8, 2, 4, [(0, 1), (2, 3)], [(0, 0), (1, 3), (4, 5)],
                                                  6), ADAM),
}


def kept_packs(p: Plan) -> set:
    """Backward packs whose forward graph is kept (recompute off; the loss pack always recomputes)."""
    return {p.packs_bwd[j] for j, o in enumerate(p.options) if not o.recompute and j < len(p.packs_bwd) - 1}


def test_cases_cover_both_modes_both_rank_counts_and_recompute_on_and_off():
    seen = set()
    for _, p, _ in CASES.values():
        if set(p.packs_bwd[:-1]) - kept_packs(p):           # the loss pack always recomputes: not counted
            seen.add((p.mode, p.gpus, "recompute"))
        if kept_packs(p):
            seen.add((p.mode, p.gpus, "kept graph"))
    assert seen == {(m, g, rc) for m in ("vPP", "vDP") for g in (1, 2) for rc in ("recompute", "kept graph")}


@pytest.mark.parametrize("name", list(CASES))
def test_executor_matches_plain_pytorch(name):
    kind, p, factory = CASES[name]
    model = mlp() if kind == "mlp" else gpt2()
    initial = [{k: v.clone() for k, v in layer.state_dict().items()} for layer in model.layers]
    want = reference(copy.deepcopy(model), p.batch, factory)
    assert min(layer_errors(initial, want)) > 1e-3          # training moved every layer: the check can fail
    res = train(model, p, steps=STEPS, optimizer=factory, progress=False)
    errs = layer_errors(res.weights, want)
    assert max(errs) < 1e-5, (name, errs)
    assert len(res.losses) == STEPS and len(res.peak_device_bytes) == p.gpus
    assert all(b > 0 for b in res.peak_device_bytes if p.mode == "vDP" or p.gpus == 1)
    for rank, stream, keys in p.transfer_order or ():     # the program issues them in the plan's order
        issued = [instruction_key(x) for x in res.program.ranks[rank] if x.stream.value == stream]
        assert [k for k in issued if k in keys] == list(keys)
    # recompute off really kept the forward graph; every other pack recomputed
    instrs = [x for ins in res.program.ranks for x in ins]
    assert {x.layers for x in instrs if x.kind is Kind.BWD and x.tensor is Tensor.SA} == kept_packs(p)
    assert {x.layers for x in instrs if x.kind is Kind.REC} == set(p.packs_bwd) - kept_packs(p)
    # one process per rank, joined by torch.distributed over Gloo; one rank runs in the caller
    if p.gpus == 1:
        assert res.rank_pids == [os.getpid()] and res.backend is None
    else:
        assert len(set(res.rank_pids)) == p.gpus and os.getpid() not in res.rank_pids and res.backend == "gloo"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", [n for n, (_, p, _) in CASES.items() if p.gpus == 1])
def test_executor_on_cuda_matches_plain_pytorch(name, monkeypatch):
    """The CUDA path (streams, events, pinned copies, the CPU optimizer thread) trains like plain
    PyTorch on the CPU: float32 without TF32 on both, so only summation order differs."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    kind, p, factory = CASES[name]
    model = mlp() if kind == "mlp" else gpt2()
    want = reference(copy.deepcopy(model), p.batch, factory)
    res = train(model, p, steps=STEPS, optimizer=factory, progress=False, device="cuda", trace=True)
    assert max(layer_errors(res.weights, want)) < 1e-4
    assert res.device_peak_bytes[0] > 0 and res.bytes_moved[0]["h2d"] > 0 and res.bytes_moved[0]["d2h"] > 0
    ev = res.timeline().events          # CUDA events on every stream, the CPU steps on the wall clock
    assert {"compute", "swap_in", "swap_out"} <= set(ev.stream) and (ev.end >= ev.start).all()
    # a kept graph's saved activations leave on the swap-out stream beside the forward (as simulated)
    kept = ev[ev.kind == "FWD"].task.str.contains("FsA")
    assert ((ev.stream == "swap_out") & (ev.kind == "sA")).sum() == kept.sum()


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs CUDA")])


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_named_adam_runs_fused_and_resumes_like_plain_pytorch(device, tmp_path, monkeypatch):
    """``optimizer="adam"`` steps with torch's fused kernels (the host step on the CPU, the device
    step of a GPU-optimizer pack on the device), and a run resumed from a checkpoint, whose step
    counts load on the host, ends where plain PyTorch's per-parameter Adam does."""
    from harmony_opt.runtime.optim import fused_on_cpu, make_factory

    if device == "cuda":
        monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    assert make_factory("adam", 1e-3).keywords.get("fused") is (True if fused_on_cpu() else None)
    p = CASES["mlp-vpp-mixed-gpu-optimizer-adam"][1]
    assert any(o.optimizer == "gpu" for o in p.options) and any(o.optimizer == "cpu" for o in p.options)
    want = reference(mlp(), p.batch, functools.partial(torch.optim.Adam, lr=1e-3, foreach=False))
    train(mlp(), p, steps=STEPS // 2, optimizer="adam", lr=1e-3, checkpoint_dir=tmp_path, device=device,
          progress=False)
    rest = train(mlp(seed=7), p, steps=STEPS, optimizer="adam", lr=1e-3, checkpoint_dir=tmp_path, resume=True,
                 device=device, progress=False)
    assert rest.start_step == STEPS // 2
    assert max(layer_errors(rest.weights, want)) < 1e-5


def test_a_rank_on_a_gpu_leaves_two_cores_to_issue_work_and_copies():
    from harmony_opt.runtime.optim import host_threads

    cores = len(os.sched_getaffinity(0))
    assert host_threads(1, "cpu") == cores and host_threads(1, "cuda") == max(1, cores - 2)
    assert host_threads(1, "cuda", current=1) == 1                      # never more than the caller set
    assert host_threads(cores + 1, "cuda") == 1
    before = torch.get_num_threads()
    train(mlp(), CASES["mlp-vpp-recompute-sgd"][1], steps=1, progress=False)
    assert torch.get_num_threads() == before                            # the caller's setting is put back


def test_kept_graph_is_used_when_possible():
    p = CASES["mlp-vpp-ufwd4-ubwd2-stash-adam"][1]
    program = compile_plan(p)
    assert program.notes == () and program.counts()["FsA"] == 2 * 2 and program.counts()["C"] == 4


def test_dropout_masks_replay_on_recompute():
    """With dropout, recomputing must draw the forward's masks: recompute and kept graph agree."""
    fwd, bwd = [(0, 3)], [(0, 1), (2, 3), (4, 5)]
    runs = []
    for options in ((), (NO_RC, NO_RC, PackOptions())):
        res = train(mlp(dropout=0.3), plan("vPP", 1, 8, 4, 4, fwd, bwd, 6, options), steps=3, optimizer=SGD,
                    progress=False)
        runs.append(res.weights)
    assert max(layer_errors(runs[0], runs[1])) < 1e-6
    plain = reference(mlp(dropout=0.3), 8, SGD, steps=3)
    assert max(layer_errors(runs[0], plain)) > 1e-3        # other masks than plain PyTorch: dropout is on


def test_a_seeded_layer_replays_its_draws_and_leaves_the_callers_stream_alone():
    """A dropout layer runs under generators seeded from its key (the recompute draws the forward's
    masks) and restored after it, so a user's own random stream goes on as if nothing ran."""
    from harmony_opt.runtime.executor import run_layer

    layer = nn.Dropout(0.5)
    x = torch.ones(4, 64)
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    first = run_layer(layer, {}, (x,), "0/0/1/0/4", torch.device("cpu"))
    again = run_layer(layer, {}, (x,), "0/0/1/0/4", torch.device("cpu"))
    other = run_layer(layer, {}, (x,), "0/0/1/4/4", torch.device("cpu"))
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert torch.equal(torch.rand(3), expected)


def test_offload_moves_only_what_lives_on_the_compute_device():
    """Saved tensors off the compute device stay where they are (attention's dropout seed and
    offset on the CPU, read there by the backward); the others get host copies."""
    from harmony_opt.runtime.graph import Offload

    seed = torch.tensor([7, 0])
    kept = Offload({}, torch.device("cuda"))       # nothing moves: runs without CUDA
    assert kept.pack(seed) is seed and kept.unpack(seed) is seed and kept.saved == []
    moved = Offload({}, torch.device("cpu"))
    h = moved.pack(seed)
    assert h is not seed and len(moved.saved) == 1 and torch.equal(h.host, seed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kept_attention_graph_with_dropout_trains_on_cuda(monkeypatch):
    """A stashed GPT-2 pack with attention dropout on the GPU: its saved tensors include the
    dropout RNG's seed and offset on the CPU, which moved to the GPU crashed the process
    (segfault in the attention backward). Kept graph and recompute draw the same masks."""
    from harmony_opt.measure.models import build_model

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    fwd, bwd = [(0, 2), (3, 4)], [(0, 2), (3, 4), (5, 7)]
    runs = []
    for options in ((), (NO_RC, NO_RC, PackOptions())):
        res = train(build_model("gpt2-tiny", dropout=0.1), plan("vPP", 1, 4, 2, 2, fwd, bwd, 8, options), steps=3,
                    optimizer=SGD, progress=False, device="cuda")
        runs.append(res)
    assert all(map(math.isfinite, runs[1].losses))
    assert max(layer_errors(runs[0].weights, runs[1].weights)) < 1e-4


def test_batchnorm_statistics_are_updated_once_per_forward():
    """One microbatch per phase: the recompute must not update running statistics a second time."""
    model = mlp(norm=True)
    want = reference(copy.deepcopy(model), 8, SGD, steps=3)
    p = plan("vPP", 1, 8, 8, 8, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6)
    res = train(model, p, steps=3, optimizer=SGD, progress=False)
    for got, ref in zip(res.weights, want):
        for k in ref:
            if "running" in k or "num_batches" in k:
                assert torch.allclose(got[k].float(), ref[k].float(), rtol=1e-5, atol=1e-7), k
    assert max(layer_errors(res.weights, want)) < 1e-5


def test_memory_guard_names_the_instruction():
    p = plan("vPP", 1, 8, 4, 4, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6)
    with pytest.raises(RuntimeMemoryError, match=r"no step ran: rank 0: instruction \d+:\w+\[\d+-\d+\].* over the "
                                                 r"cap of 3000 bytes$"):
        train(mlp(), p, steps=2, memory_cap=3000, progress=False)
    res = train(mlp(), p, steps=1, progress=False)
    assert res.peak_device_bytes[0] > 3000


def test_memory_guard_of_a_rank_process_reaches_the_caller(monkeypatch):
    """Rank 1 needs more than the cap, rank 0 less: train refuses before step 0; and where the
    sizes are not checked first, rank 1's guard error comes back with its type, and the launcher
    stops rank 0 (blocked on a message rank 1 never sends)."""
    import harmony_opt.measure.shapes

    p = plan("vPP", 2, 8, 4, 4, [(0, 0), (1, 3)], [(0, 0), (1, 3), (4, 5)], 6)
    peaks = train(mlp(), p, steps=1, progress=False).peak_device_bytes
    assert peaks[1] > peaks[0]
    cap = (peaks[0] + peaks[1]) // 2
    with pytest.raises(RuntimeMemoryError, match=r"no step ran: rank 1: "):
        train(mlp(), p, steps=2, memory_cap=cap, progress=False)
    monkeypatch.setattr(harmony_opt.measure.shapes, "measure_layer_bytes", lambda *a, **k: None)
    with pytest.raises(RuntimeMemoryError, match=rf"^rank 1: instruction \d+:\w+\[\d+-\d+\].* over the "
                                                 rf"memory cap of {cap} bytes"):
        train(mlp(), p, steps=2, memory_cap=cap, progress=False)


def _executor(program: Program, model: LayeredModel):
    from harmony_opt.runtime.executor import Executor
    from harmony_opt.runtime.optim import PackOptimizers
    from harmony_opt.measure.shapes import boundary_shapes
    from harmony_opt.runtime.worker import updated_packs

    x, y = model.make_batch(program.batch, torch.Generator().manual_seed(0))
    optim = PackOptimizers(model.layers, updated_packs(program, 0), SGD)
    return Executor(program, 0, model.layers, optim, boundary_shapes(model.layers, x, y)), x, y


def test_executor_refuses_a_tensor_that_never_arrived():
    p = plan("vPP", 1, 8, 4, 4, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6)
    program = compile_plan(p)
    ins = [x for x in program.ranks[0] if not (x.kind is Kind.SWAP_IN and x.layers == (0, 0) and x.mb == 0)]
    broken = Program(**{**program.__dict__, "ranks": (tuple(ins),)})
    ex, x, y = _executor(broken, mlp())
    with pytest.raises(ProgramError, match=r"reads device tensor \('X', 0, 0, 4\) which is not on the device"):
        ex.run_iteration(0, x, y)
    ex.close()


def test_unknown_instruction_kind_is_an_error(monkeypatch):
    import harmony_opt.runtime.executor as executor

    monkeypatch.delitem(executor._HANDLERS, Kind.ALL_REDUCE)
    monkeypatch.delitem(executor._HANDLERS, Kind.FREE)
    p = plan("vPP", 1, 4, 4, 4, [], [(0, 5)], 6)
    ex, x, y = _executor(compile_plan(p), mlp())
    with pytest.raises(ProgramError, match="does not understand instruction .*D"):
        ex.run_iteration(0, x, y)
    ex.close()


def test_rank_processes_preload_the_modules_of_the_layer_classes():
    from harmony_opt.runtime.worker import layer_modules

    assert layer_modules(mlp().layers) == ["harmony_opt.measure.decompose"]       # torch's own modules are preloaded anyway
    assert "transformers.models.gpt2.modeling_gpt2" in layer_modules(gpt2().layers)


def test_freed_host_memory_is_kept_for_the_next_swap():
    """A block freed on the CPU device is reused by the next one of its size, as CUDA's caching
    allocator reuses device memory: without it, glibc unmaps blocks over 32 MB and every swap-in of
    such a tensor pays a page fault per 4 KiB (a 64 MB block: 16384 of them). Each count comes from a
    fresh process, whose heap no earlier test has cut up, after the copies that let it settle."""
    import subprocess
    import sys

    code = """if True:
        import resource, sys, torch
        from harmony_opt.runtime.buffers import keep_freed_memory
        if sys.argv[1] == "keep" and not keep_freed_memory():
            print("unsupported"); sys.exit()
        src = torch.ones(16 * 2**20)                      # 64 MB
        for _ in range(6):      # allocated, written and freed: glibc settles on a few such blocks (a small
            torch.empty_like(src).copy_(src)    # allocation may land behind a freed one), as a first step does
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(3):
            torch.empty_like(src).copy_(src)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    """

    def faults(setting: str) -> str:
        out = subprocess.run([sys.executable, "-c", code, setting], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    kept = faults("keep")
    if kept == "unsupported":
        pytest.skip("not glibc: host memory is left to the platform's allocator")
    assert int(kept) < 4096, f"{kept} page faults for three 64 MB copies into freed memory"
    assert int(faults("default")) > 3 * 8192          # the default pays them: the test can tell


def test_the_tracer_keeps_the_hosts_issue_times_of_a_traced_step():
    """On a GPU the executor records when its thread issued each instruction (frees too: they cost the
    host its bookkeeping); the step's result carries them, on the step's clock, as Timeline.host rows."""
    from harmony_opt.compile.program import Instr, Stream
    from harmony_opt.runtime.executor import Tracer
    from harmony_opt.sim.timeline import HOST_COLUMNS
    tracer = Tracer(1, cuda=False)      # the bookkeeping alone: issue() is what the executor calls on a GPU
    tracer.begin(step=3)
    copy_in = Instr(0, Kind.SWAP_IN, (0, 1), Stream.SWAP_IN, Tensor.W)
    free = Instr(1, Kind.FREE, (0, 1), Stream.COMPUTE, Tensor.W)
    tracer.issue(copy_in, tracer.t0 + 0.001, tracer.t0 + 0.002)
    tracer.issue(free, tracer.t0 + 0.0025, tracer.t0 + 0.0026)
    tracer.finish()
    got = tracer.result()
    assert got["step"] == 3 and len(got["issue"]) == 2
    assert [r[:3] for r in got["issue"]] == [(1, str(copy_in), "swap_in"), (1, str(free), "free")]
    assert [r[3:] for r in got["issue"]] == [pytest.approx((0.001, 0.002)), pytest.approx((0.0025, 0.0026))]
    assert len(HOST_COLUMNS) == len(got["issue"][0])
    tracer.begin(step=4)                # the next step starts empty
    tracer.finish(keep=2)
    assert tracer.result()["issue"] == [] and len(tracer.results()) == 2
