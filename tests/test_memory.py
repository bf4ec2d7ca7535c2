"""One memory model from the planner to the executor: every plan a planner returns runs under its cap.

Profiles are measured here, on the CPU, for the built-in tiny models (as a user's ``harmony-opt
profile`` would); caps go from the least feasible one upward; each case plans, compiles with
the model's real sizes, and trains one step under the cap.
"""
from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harmony_opt.planners.registry import get_planner
from harmony_opt.compile.compiler import compile_plan
from harmony_opt.core.errors import InfeasibleError, RuntimeMemoryError
from harmony_opt.core.hardware import Hardware
from harmony_opt.measure.models import build_model
from harmony_opt.core.plan import Plan
from harmony_opt.measure.profiler import profile_model
from harmony_opt.compile.validate import validate_program
from harmony_opt.sim.simulator import simulate
from harmony_opt.training import train
from harmony_opt.measure.shapes import measure_layer_bytes

MODELS = ("gpt2-tiny", "bert-tiny", "vgg-tiny")
PLANNERS = ("cp-sat", "harmony", "harmony/harmony-cost", "naive-swap", "l2l")
BATCH = 4


def _hardware() -> Hardware:
    return Hardware(name="cpu-test", gpus=1, gpu_memory_bytes=2**30, host_memory_bytes=8 * 2**30,
                    pinned_memory_bytes=4 * 2**30, h2d_bandwidth=5e9, d2h_bandwidth=5e9, shared_host_link=True,
                    link_bandwidth=5e9, p2p_bandwidth=0.0, host_copy_bandwidth=5e9, cpu_optimizer_scale=1.0,
                    gpu_optimizer_bandwidth=1e10)


@functools.cache
def _measured(name: str):
    torch.manual_seed(0)
    model = build_model(name)
    prof = profile_model(model, [1, 2, 4], "cpu", repeats=1, warmup=0, progress=False)
    least = int(max(prof.costs("BWD", 1).pack_memory(l, l) for l in range(prof.num_layers)))
    return prof, least


def _plan(planner: str, prof, cap: int) -> Plan:
    """``planner`` from the registry; "harmony/harmony-cost" is Harmony's search under its own cost model."""
    name, _, variant = planner.partition("/")
    kw = {"time_limit": 1.0, "processes": 1} if name == "cp-sat" else {}
    if variant == "harmony-cost":
        kw.update(mode="vPP", cost_model="harmony")
    return get_planner(name)(prof, _hardware(), BATCH, cap, **kw)


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(model=st.sampled_from(MODELS), factor=st.sampled_from((1.0, 1.25, 1.5, 2.0, 3.0)),
       planner=st.sampled_from(PLANNERS))
def test_every_returned_plan_compiles_and_trains_under_its_cap(model, factor, planner):
    prof, least = _measured(model)
    cap = int(least * factor)
    try:
        plan = _plan(planner, prof, cap)
    except InfeasibleError:
        return          # refused with the figures: allowed; a plan that fails at run time is not
    m = build_model(model)
    x, y = m.make_batch(1, torch.Generator().manual_seed(0))
    sizes = measure_layer_bytes(m.layers, x, y)
    validate_program(compile_plan(plan, layer_bytes=sizes, memory_cap=cap), cap_bytes=cap)
    res = train(m, plan, steps=1, progress=False, memory_cap=cap)
    assert max(res.peak_device_bytes) <= cap


@pytest.mark.parametrize("model", MODELS)
def test_simulated_peak_matches_the_executors_live_bytes(model):
    """The simulator's peak per GPU, from the profile's sizes, is what the executor's guard measures
    there: never less (the guard never stops a validated plan), and within 5 %; its memory over time
    reaches that peak and ends empty."""
    prof, least = _measured(model)
    cap = int(least * 2)
    plan = _plan("cp-sat", prof, cap)
    tl = simulate(plan, prof, _hardware())
    predicted = tl.peak_memory()
    measured = train(build_model(model), plan, steps=1, progress=False).peak_device_bytes
    assert tl.meta["memory_model"] == "program" and len(predicted) == len(measured) == plan.gpus
    for r, m in enumerate(measured):
        assert m <= predicted[r] <= 1.05 * m, (r, predicted, measured)
    for r, g in tl.memory.sort_values("time", kind="stable").groupby("rank"):
        assert g.bytes.max() == predicted[r] and g.bytes.iloc[-1] == 0


def test_prefetches_wait_for_room_under_the_cap():
    """Near the cap, the next pack's weights come in only once the current pack's memory is gone:
    the compiled program never holds more than the cap (without the wait it would)."""
    prof, least = _measured("gpt2-tiny")
    plan = get_planner("naive-swap")(prof, _hardware(), BATCH, least)
    m = build_model("gpt2-tiny")
    x, y = m.make_batch(1, torch.Generator().manual_seed(0))
    sizes = measure_layer_bytes(m.layers, x, y)
    fitted = validate_program(compile_plan(plan, layer_bytes=sizes, memory_cap=least), cap_bytes=least)
    assert max(fitted.peak_bytes) <= least
    eager = validate_program(compile_plan(plan, layer_bytes=sizes, memory_cap=10**12))
    assert max(eager.peak_bytes) > least


def _mlp(*widths: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(*(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])))


def test_a_refused_run_changes_no_weight_and_writes_no_checkpoint(tmp_path):
    """A user's own model whose first backward pack fits the cap and second does not: without the
    check before step 0, the first pack's weights would be updated before the guard stopped the run."""
    from harmony_opt.measure.decompose import LayeredModel

    torch.manual_seed(0)
    layers = [_mlp(256, 512, 256), _mlp(256, 256), _MSE()]      # 1.05 MB and 0.26 MB of weights
    model = LayeredModel("mine", layers, make_batch=lambda n, g: (torch.randn(n, 256, generator=g),
                                                                  torch.randn(n, 256, generator=g)))
    before = [{k: v.clone() for k, v in l.state_dict().items()} for l in layers]
    plan = Plan("mine", "vPP", 1, 4, 2, 2, [(0, 0)], [(0, 0), (1, 2)], 3, memory_cap=1_500_000)
    with pytest.raises(RuntimeMemoryError, match="no step ran"):
        train(model, plan, steps=2, progress=False, checkpoint_dir=tmp_path / "ck")
    for l, b in zip(layers, before):
        for k, v in l.state_dict().items():
            assert torch.equal(v, b[k])
    assert not (tmp_path / "ck").exists() or not any((tmp_path / "ck").iterdir())


class _MSE(torch.nn.Module):
    def forward(self, x, y):
        return torch.nn.functional.mse_loss(x, y)
