"""Mixed precision (bf16 autocast, fp32 master weights): the executor trains like plain PyTorch under
``torch.autocast("cpu", dtype=torch.bfloat16)``, and the bytes the profile records, the validator counts
from the model and the executor's guard holds are the same bytes.

Exactness: bf16 matmuls on the CPU are deterministic for the same shapes, but their rounding depends on
the microbatch size (a row of a product of 3 rows can round differently from the same row in a product
of 2). So the reference runs the same microbatches as the plan (u_fwd = u_bwd, the same split of the
minibatch, the loss of each scaled by its share, gradients accumulated in fp32), and then agrees to
1e-6 relative Frobenius error per layer, the fp32 tests' summation-order allowance tightened: measured
0.0 (bit for bit) for the MLP and gpt2-tiny on one and two ranks, 9e-9 for a tiny Hugging Face GPT-2
(its tied embedding and head add two gradients in another order). The same plan trained in fp32 is
6.5e-5 to 3.7e-3 from the bf16 reference (checked too, so the tolerance separates the precisions).
With u_fwd != u_bwd the forward and the recompute round differently (measured 4e-5 on the MLP, not
tested against plain PyTorch).
"""
from __future__ import annotations

import copy
import functools
import json

import pytest
import torch

from harmony_opt.cli import main
from harmony_opt.compile.program import LayerBytes, replay_memory
from harmony_opt.core.errors import PlanError, RuntimeMemoryError, UsageError
from harmony_opt.core.hardware import get_hardware
from harmony_opt.core.plan import PackOptions, Plan
from harmony_opt.core.profile import Profile
from harmony_opt.measure.decompose import run_layers
from harmony_opt.measure.shapes import measure_layer_bytes
from harmony_opt.training import batch_seed, train

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 3
TOL = 1e-6
SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
ADAM = functools.partial(torch.optim.Adam, lr=1e-3)
BF16 = {"name": "test", "precision": "bf16"}
NO_RC = PackOptions(recompute=False)


def mlp():
    from test_executor import mlp as make
    return make()


def gpt2():
    from test_executor import gpt2 as make
    return make()


def hf_gpt2():
    from test_hf import _tiny
    return _tiny("gpt2")


def plan(mode, gpus, batch, u, fwd, bwd, R, options=(), profile=BF16, **kw) -> Plan:
    return Plan(planner="test", mode=mode, gpus=gpus, batch=batch, microbatch_fwd=u, microbatch_bwd=u,
                packs_fwd=fwd, packs_bwd=bwd, num_layers=R, options=options, allow_uneven=True, profile=profile, **kw)


def microbatches(p: Plan) -> list[slice]:
    """The rows of every microbatch of the plan's backward, over all ranks, in the minibatch's order."""
    out, lo = [], 0
    for n in p.samples_per_gpu() if p.mode == "vDP" else [p.batch]:
        out += [slice(lo + o, lo + min(o + p.microbatch_bwd, n)) for o in range(0, n, p.microbatch_bwd)]
        lo += n
    return out


def reference(loss_of, params, make_batch, p: Plan, factory, steps: int = STEPS, precision: str = "bf16"):
    """Plain PyTorch: fp32 weights, each microbatch's forward under autocast, its loss scaled by its share,
    the backward outside autocast, gradients accumulated, one optimizer step per minibatch."""
    opt = factory(params)
    for s in range(steps):
        x, y = make_batch(p.batch, torch.Generator().manual_seed(batch_seed(0, s)))
        opt.zero_grad()
        for rows in microbatches(p):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss = loss_of(x[rows], y[rows]) * ((rows.stop - rows.start) / p.batch)
            loss.backward()
        opt.step()


def layered_reference(model, p: Plan, factory, precision: str = "bf16"):
    model = copy.deepcopy(model)
    reference(lambda x, y: run_layers(model.layers, x, y), [q for layer in model.layers for q in layer.parameters()],
              model.make_batch, p, factory, precision=precision)
    return [{k: v.detach().clone() for k, v in layer.state_dict().items()} for layer in model.layers]


def layer_errors(got, want) -> list[float]:
    from test_executor import layer_errors as errors
    return errors(got, want)


CASES = {
    # name: (model, plan, optimizer)
    "mlp-vpp-recompute-and-stash": (mlp, plan("vPP", 1, 8, 2, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6,
                                              (NO_RC, PackOptions(), PackOptions())), ADAM),
    "mlp-vdp-2ranks": (mlp, plan("vDP", 2, 8, 2, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6), SGD),
    "gpt2-tiny-vpp-2ranks-stash": (gpt2, plan("vPP", 2, 4, 2, [(0, 2), (3, 4)], [(0, 1), (2, 4), (5, 7)], 8,
                                              (NO_RC, NO_RC, PackOptions())), ADAM),
    "gpt2-tiny-vdp-gpu-optimizer": (gpt2, plan("vDP", 1, 4, 2, [(0, 4)], [(0, 1), (2, 4), (5, 7)], 8,
                                               (PackOptions(), PackOptions(optimizer="gpu"), PackOptions())), ADAM),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bf16_training_equals_plain_autocast_training(name):
    make, p, factory = CASES[name]
    want = layered_reference(make(), p, factory)
    res = train(make(), p, steps=STEPS, optimizer=factory, progress=False)
    errs = layer_errors(res.weights, want)
    assert max(errs) < TOL, (name, errs)
    assert all(v.dtype == torch.float32 for w in res.weights for v in w.values() if v.is_floating_point())
    if p.gpus == 1:         # the same plan in fp32 is far from the bf16 reference: the check can fail
        fp32 = train(make(), p.replace(profile={}), steps=STEPS, optimizer=factory, progress=False)
        assert max(layer_errors(fp32.weights, want)) > 20 * TOL


@pytest.mark.parametrize("mode,gpus", [("vDP", 1), ("vPP", 2)])
def test_bf16_hugging_face_gpt2_trains_like_plain_autocast_training(mode, gpus):
    from harmony_opt.measure.hf import decompose_hf

    hf = hf_gpt2()
    ours = copy.deepcopy(hf)
    model = decompose_hf(ours)
    R = model.num_layers
    p = plan(mode, gpus, 4, 2, [(0, 1), (2, R - 3)], [(0, 1), (2, R - 3), (R - 2, R - 1)], R)
    initial = {n: q.detach().clone() for n, q in hf.named_parameters()}
    reference(lambda x, y: hf(input_ids=x, labels=y).loss, list(hf.parameters()), model.make_batch, p, ADAM)
    train(model, p, steps=STEPS, optimizer=ADAM, progress=False)
    names = {id(q): n for n, q in ours.named_parameters()}
    want = dict(hf.named_parameters())
    for layer in model.layers:
        keys = [names[id(q)] for q in layer.parameters()]
        if keys:
            got = torch.cat([dict(ours.named_parameters())[k].detach().flatten() for k in keys])
            ref = torch.cat([want[k].detach().flatten() for k in keys])
            assert float((got - ref).norm() / ref.norm()) < TOL, keys
            start = torch.cat([initial[k].flatten() for k in keys])
            assert float((start - ref).norm() / ref.norm()) > 1e-4, keys       # training moved it


# -- bytes -----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _profiles():
    from harmony_opt.measure.profiler import profile_model
    kw = dict(repeats=1, max_repeats=1, warmup=0, remeasure=False, progress=False, threads=1)
    return {prec: profile_model(gpt2(), [1, 2, 4], precision=prec, **kw) for prec in ("fp32", "bf16")}


def test_a_bf16_profile_records_bf16_bytes_that_the_model_measures_alike(tmp_path):
    p32, p16 = _profiles()["fp32"], _profiles()["bf16"]
    assert p16.precision == "bf16" and p32.precision == "fp32" and "precision" not in p32.meta
    cast = p16.cast_bytes()
    assert cast[1] > 0 and cast[0] == 0          # the blocks' matmul weights; the embedding runs in fp32
    x, y = gpt2().make_batch(4, torch.Generator().manual_seed(0))
    for u in (1, 2, 4):
        c32, c16 = p32.costs("BWD", u), p16.costs("BWD", u)
        # the residual stream between blocks stays fp32 (autocast adds bf16 to fp32 in fp32); the logits are
        # bf16, and the blocks save less per sample than in fp32
        assert (c16.input[:-2] == c32.input[:-2]).all() and c16.input[-2] * 2 == c32.input[-2]
        assert ((c16.saved - cast)[1:5] < c32.saved[1:5]).all()
        assert (c16.memory[1:5] < c32.memory[1:5]).all()
        for prec, prof in (("fp32", p32), ("bf16", p16)):
            # the model measured on one sample prices what the profile recorded: at microbatch 1 exactly, at
            # 2 and 4 the blocks and the head (the embedding and the loss save a few bytes per microbatch
            # besides, in either precision); under bf16 only with the weight copies counted once
            want = LayerBytes.from_profile(prof, u)
            got = measure_layer_bytes(gpt2().layers, x, y, precision=prec)
            body = slice(None) if u == 1 else slice(1, -1)
            for field in ("input", "saved", "saved_storage", "saved_input", "saved_output", "saved_fixed"):
                assert getattr(got, field)[body] == pytest.approx(getattr(want, field)[body]), (prec, u, field)
            assert list(got.saved_fixed) == ([float(c) for c in cast] if prec == "bf16" else [])
    # saved and loaded: the cast bytes and the precision survive; an old profile without them is fp32
    p16.save(tmp_path / "p16")
    back = Profile.load(tmp_path / "p16")
    assert back.precision == "bf16" and (back.cast_bytes() == cast).all() and back.identity == p16.identity
    p32.save(tmp_path / "p32")
    meta = json.loads((tmp_path / "p32" / "meta.json").read_text())
    assert "precision" not in meta and Profile.load(tmp_path / "p32").precision == "fp32"
    meta["precision"] = "fp16"
    (tmp_path / "p32" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(Exception, match="precision 'fp16'"):
        Profile.load(tmp_path / "p32")


def test_a_bf16_plan_at_its_programs_peak_runs_and_the_guard_counts_the_same_bytes():
    from harmony_opt.compile.program_memory import program_memory
    from harmony_opt.sim.simulator import simulate
    from harmony_opt import plan as make_plan

    prof = _profiles()["bf16"]
    hw = get_hardware("h100-x1")
    made = make_plan(prof, hw, 4, memory_cap=int(2.5 * 2**20))
    assert made.precision == "bf16" and made.profile["precision"] == "bf16"
    # the bytes are checked on one plan of the planner's kind (stash and recompute packs, a GPU step): the
    # planner's own choice follows the profile's measured times, which differ from run to run
    opts = (PackOptions(recompute=False, optimizer="gpu"), NO_RC, NO_RC, PackOptions())
    p = plan("vPP", 1, 4, 4, ((0, 1), (2, 3)), ((0, 0), (1, 2), (3, 3), (4, 7)), prof.num_layers, opts,
             profile=made.profile, memory_cap=made.memory_cap)
    simulate(p, prof, hw)
    peak = max(program_memory(p, prof).peaks)
    # the model's own sizes price the program as the profile does
    x, y = gpt2().make_batch(4, torch.Generator().manual_seed(0))
    from harmony_opt.compile.compiler import compile_plan
    sizes = measure_layer_bytes(gpt2().layers, x, y, precision="bf16")
    program = compile_plan(p, layer_bytes=sizes, memory_cap=peak)
    assert max(replay_memory(r, p.num_layers, sizes)[0] for r in program.ranks) == peak
    res = train(gpt2(), p, steps=2, progress=False, memory_cap=peak)     # exactly at the peak: runs
    assert res.peak_device_bytes == [peak]                                # the guard held what was priced
    # one byte less and the executor's guard stops the program (the validator would refuse it before)
    from harmony_opt.measure.shapes import boundary_shapes
    from harmony_opt.runtime.executor import Executor
    from harmony_opt.runtime.optim import PackOptimizers
    from harmony_opt.runtime.worker import updated_packs

    for cap in (peak, peak - 1):
        model = gpt2()
        optim = PackOptimizers(model.layers, updated_packs(program, 0), ADAM)
        ex = Executor(program, 0, model.layers, optim, boundary_shapes(model.layers, x, y, precision="bf16"),
                      memory_cap=cap, precision="bf16")
        try:
            if cap < peak:
                with pytest.raises(RuntimeMemoryError, match=f"over the memory cap of {cap} bytes"):
                    ex.run_iteration(0, x, y)
            else:
                ex.run_iteration(0, x, y)
                assert ex.table.peak == peak
        finally:
            ex.close()
    # the same plan in fp32 would be priced and held larger
    fp32 = measure_layer_bytes(gpt2().layers, x, y, precision="fp32")
    assert max(replay_memory(r, p.num_layers, fp32)[0] for r in compile_plan(p, layer_bytes=fp32).ranks) > peak


# -- refusals --------------------------------------------------------------------------------------------

def test_a_run_in_another_precision_than_the_plans_is_refused_before_step_0(tmp_path, capsys):
    p = CASES["mlp-vpp-recompute-and-stash"][1]
    with pytest.raises(UsageError, match="profile measured in bf16 but precision fp32"):
        train(mlp(), p, steps=1, precision="fp32", progress=False)
    with pytest.raises(UsageError, match="profile measured in fp32 but precision bf16"):
        train(mlp(), p.replace(profile={}), steps=1, precision="bf16", progress=False)
    with pytest.raises(UsageError, match="precision must be one of fp32, bf16"):
        train(mlp(), p, steps=1, precision="fp16", progress=False)
    assert train(mlp(), p, steps=1, precision="bf16", progress=False).steps == 1
    # the CLI: one line, exit 2
    for prof, asked in (({"name": "gpt2-tiny"}, "bf16"), ({"name": "gpt2-tiny", "precision": "bf16"}, "fp32")):
        g = CASES["gpt2-tiny-vdp-gpu-optimizer"][1].replace(profile=prof)
        g.save(tmp_path / "plan.json")
        capsys.readouterr()
        assert main(["run", str(tmp_path / "plan.json"), "--model", "gpt2-tiny", "--steps", "1", "--no-progress",
                     "--precision", asked]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"but precision {asked} was asked for" in err, err


def test_plan_json_carries_the_precision_only_when_not_fp32(tmp_path):
    from harmony_opt.core.bundled import profile_ident
    p32, p16 = _profiles()["fp32"], _profiles()["bf16"]
    assert "precision" not in profile_ident(p32) and profile_ident(p16)["precision"] == "bf16"
    p = CASES["mlp-vdp-2ranks"][1]
    assert "precision" not in p.replace(profile={"name": "x"}).to_json()
    back = Plan.load(p.save(tmp_path / "plan.json"))
    assert back.precision == "bf16" and back.to_json() == p.to_json()
    bad = json.loads(p.to_json())
    bad["profile"]["precision"] = "fp8"
    with pytest.raises(PlanError, match="profile.precision"):
        Plan.from_dict(bad)
    # a plan made from a profile of one precision is refused against a profile of the other
    g = CASES["gpt2-tiny-vdp-gpu-optimizer"][1]
    with pytest.raises(PlanError, match="made from a profile measured in fp32, but profile .* in bf16"):
        g.replace(profile={"name": "gpt2-tiny"}).check_against(p16)
    with pytest.raises(PlanError, match="made from a profile measured in bf16, but profile .* in fp32"):
        g.check_against(p32)
    g.check_against(p16)


def test_cli_profiles_plans_and_runs_in_bf16(tmp_path, capsys):
    prof, plan_file = tmp_path / "prof", tmp_path / "plan.json"
    tiny = ["--model", "gpt2-tiny", "--set", "n_layer=1"]
    assert main(["profile", "gpt2-tiny", "--set", "n_layer=1", "--device", "cpu", "-u", "1,2", "--repeats", "1",
                 "--warmup", "0", "--threads", "1", "--precision", "bf16", "--no-progress", "-o", str(prof)]) == 0
    assert "bf16" in capsys.readouterr().out
    assert json.loads((prof / "meta.json").read_text())["precision"] == "bf16"
    assert main(["plan", "--profile", str(prof), "--hardware", "h100-x1", "--batch", "4", "--memory-cap", "2MB",
                 "--time-limit", "1", "--no-compare", "--quiet", "-o", str(plan_file)]) == 0
    assert Plan.load(plan_file).precision == "bf16"
    assert main(["compile", str(plan_file), "-o", str(tmp_path / "program.json"), *tiny]) == 0
    assert "saved_fixed" in (tmp_path / "program.json").read_text()
    capsys.readouterr()
    assert main(["run", str(plan_file), *tiny, "--steps", "2", "--no-progress"]) == 0
    assert "steps 0..1" in capsys.readouterr().out
    assert main(["run", str(plan_file), *tiny, "--steps", "1", "--no-progress", "--precision", "fp32"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_the_simulator_charges_the_bytes_a_bf16_run_moves():
    """Swaps, stashed activations (with autocast's weight copies) and gradients, priced from the bf16
    profile, are what the executor copies; only the targets (which no profile has) are extra."""
    from harmony_opt.sim.simulator import simulate

    moved = {}
    for prec, prof in _profiles().items():
        p = plan("vPP", 1, 4, 2, [(0, 1), (2, 4)], [(0, 1), (2, 4), (5, 7)], 8, (NO_RC, NO_RC, PackOptions()),
                 profile={"name": prof.name, **({"precision": prec} if prec != "fp32" else {})})
        sim = simulate(p, prof, get_hardware("h100-x1"), memory_cap=10 ** 12).bytes_moved()
        got = train(gpt2(), p, steps=1, progress=False).bytes_moved[0]
        targets = p.batch * prof.meta["target_bytes_per_sample"]
        assert (got["h2d"] - targets, got["d2h"]) == (sim["h2d"], sim["d2h"]), prec
        moved[prec] = got["h2d"] + got["d2h"]
    assert moved["bf16"] < moved["fp32"]


def test_bf16_at_512_rounds_the_weight_copies_as_saved_tensors():
    """bf16 on a rounding allocator (512, as on CUDA; priced here on the CPU): autocast's weight copies are
    saved tensors, counted among ``saved_tensors`` and rounded like them, so the validator at 512 bounds
    the guard at 512, from the model's sizes and from a CPU-made bf16 profile planned for 512."""
    from harmony_opt.compile.compiler import compile_plan
    from harmony_opt.compile.validate import validate_program

    G = 512
    x, y = gpt2().make_batch(4, torch.Generator().manual_seed(0))
    s32 = measure_layer_bytes(gpt2().layers, x, y, granularity=G, precision="fp32")
    s16 = measure_layer_bytes(gpt2().layers, x, y, granularity=G, precision="bf16")
    assert s16.granularity == G and s16.saved_fixed and s16.weights_pad == s32.weights_pad
    # the blocks' bf16 weight copies are saved tensors fp32 has not (its weights are resident)
    assert all(a > b for a, b in zip(s16.saved_tensors[1:5], s32.saved_tensors[1:5]))
    p = plan("vPP", 1, 4, 2, [(0, 2), (3, 4)], [(0, 1), (2, 4), (5, 7)], 8, (NO_RC, PackOptions(), PackOptions()))
    program = compile_plan(p, layer_bytes=s16)
    peak = max(validate_program(program, sizes=s16).peak_bytes)
    res = train(gpt2(), p, steps=1, progress=False, optimizer=ADAM, memory_cap=peak, granularity=G)
    assert res.peak_device_bytes[0] <= peak
    exact = measure_layer_bytes(gpt2().layers, x, y, precision="bf16")
    assert res.peak_device_bytes[0] > max(validate_program(compile_plan(p, layer_bytes=exact), sizes=exact).peak_bytes)
    # from the profile: the same fields, the copies once per microbatch and among the saved tensors
    prof = _profiles()["bf16"].with_alloc_granularity(G)
    lb = LayerBytes.from_profile(prof, 2)
    assert lb.granularity == G and lb.saved_fixed == tuple(float(c) for c in prof.cast_bytes())
    assert lb.saved_tensors and all(n >= 1 for n in lb.saved_tensors[1:5])
    assert (prof.costs("FWD", 2).memory[1:5] > _profiles()["bf16"].costs("FWD", 2).memory[1:5]).all()
