"""The CUDA caching allocator's 512-byte granularity, counted alike by the profile's sizes, the
validator's (measure_layer_bytes), the simulator's task memory and the executor's guard.

There is no GPU here: the guard is given granularity 512 on the CPU, which is what it uses on CUDA.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

from harmony_opt.compile.compiler import compile_plan
from harmony_opt.compile.program import LayerBytes, effects
from harmony_opt.compile.validate import validate_program
from harmony_opt.core.bundled import load_profile
from harmony_opt.core.errors import ProfileError, ProgramError, RuntimeMemoryError, UsageError
from harmony_opt.core.kinds import TaskKind
from harmony_opt.core.plan import PackOptions
from harmony_opt.core.profile import Profile
from harmony_opt.core.units import alloc_bytes, alloc_granularity
from harmony_opt.measure.profiler import profile_model
from harmony_opt.measure.shapes import measure_layer_bytes
from harmony_opt.runtime.executor import DeviceTable, nbytes
from harmony_opt.sim.taskgraph import task_memory
from harmony_opt.training import train

sys.path.insert(0, str(Path(__file__).parent))
from test_executor import mlp, plan  # noqa: E402

G = 512


def _biases(n: int = 16) -> dict:
    """One layer's worth of tiny tensors: ``n`` 4-byte biases."""
    return {f"b{i}": torch.zeros(1) for i in range(n)}


def test_granularity_per_device_and_rounding():
    assert alloc_granularity("cuda") == G and alloc_granularity("cuda:1") == G and alloc_granularity("cpu") == 1
    with pytest.raises(UsageError, match="unknown device 'mps'"):
        alloc_granularity("mps")
    assert [alloc_bytes(n, G) for n in (0, 1, 4, 512, 513, 1536)] == [0, 512, 512, 512, 1024, 1536]
    assert alloc_bytes(513) == 513


def test_nbytes_rounds_each_tensor():
    b = _biases()
    assert nbytes(b) == 64
    assert nbytes(b, G) == 16 * G
    assert nbytes({"w": torch.zeros(129), "b": b}, G) == 2 * G + 16 * G      # 516 bytes -> 1024


def test_guard_at_512_refuses_what_exact_counting_accepts():
    ins = compile_plan(plan("vPP", 1, 4, 4, 4, [], [(0, 5)], 6)).ranks[0][0]
    DeviceTable(0, 1000).put(("B", 0), _biases(), ins)
    table = DeviceTable(0, 1000, granularity=G)
    with pytest.raises(RuntimeMemoryError, match="holds 8192 bytes on the device after it ran, over the memory cap "
                                                 "of 1000 bytes"):
        table.put(("B", 0), _biases(), ins)
    with pytest.raises(RuntimeMemoryError, match=r"would hold 8192 bytes on the device, over the memory cap of 1000 "
                                                 r"bytes \(0 live before it\)"):
        DeviceTable(0, 1000, granularity=G).reserve(nbytes(_biases(), G), ins)


PLANS = {
    "recompute": plan("vPP", 1, 8, 4, 4, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6),
    "stash": plan("vPP", 1, 8, 4, 4, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6,
                  options=tuple(PackOptions(recompute=False) for _ in range(3))),
}


@functools.cache
def _sizes(granularity: int) -> LayerBytes:
    m = mlp()
    x, y = m.make_batch(1, torch.Generator().manual_seed(0))
    return measure_layer_bytes(m.layers, x, y, optimizer_states=0, granularity=granularity)


def test_measured_sizes_price_each_tensor_as_the_guard_does():
    """Weights, their gradients and activations: the validator's bytes for an instruction's tensor are
    exactly what the guard counts for it at 512 (the saved graphs' are an upper bound, below)."""
    sizes, exact = _sizes(G), _sizes(1)
    m = mlp()
    program = compile_plan(PLANS["recompute"], layer_bytes=sizes)
    for x in program.ranks[0]:
        for key in effects(x, program.num_layers).allocs:
            if key[0] in ("W", "dW"):
                want = nbytes(dict(m.layers[key[1]].named_parameters()), G)
            elif key[0] in ("X", "sX", "dX"):
                want = alloc_bytes(int(exact.input[key[1]]) * key[3], G)
            else:
                continue
            assert sizes.alloc_bytes(x, key) == want, (str(x), key)
            assert sizes.tensor_bytes(x, key) == exact.alloc_bytes(x, key)
    assert sizes.weights == exact.weights     # the exact figures stay what they were
    assert all(n > 0 for n in sizes.saved_tensors[:5])


@pytest.mark.parametrize("case", sorted(PLANS))
def test_validator_at_512_bounds_the_guard_at_512(case, monkeypatch):
    """A plan compiled with 512-rounded sizes runs under a cap at the validator's peak with the guard
    at 512; at the exact peak, where exact counting runs, the validator at 512 says over and the run
    is refused before step 0."""
    p = PLANS[case]
    peak = max(validate_program(compile_plan(p, layer_bytes=_sizes(G)), sizes=_sizes(G)).peak_bytes)
    exact = max(validate_program(compile_plan(p, layer_bytes=_sizes(1)), sizes=_sizes(1)).peak_bytes)
    res = train(mlp(), p, steps=1, progress=False, optimizer="sgd", memory_cap=peak, granularity=G)
    guard = res.peak_device_bytes[0]
    assert exact < guard <= peak <= guard + 4 * (G - 1), (exact, guard, peak)
    with pytest.raises(ProgramError, match="over the cap"):
        validate_program(compile_plan(p, layer_bytes=_sizes(G), memory_cap=exact), cap_bytes=exact, sizes=_sizes(G))
    with pytest.raises(RuntimeMemoryError, match="no step ran"):
        train(mlp(), p, steps=1, progress=False, optimizer="sgd", memory_cap=exact, granularity=G)
    train(mlp(), p, steps=1, progress=False, optimizer="sgd", memory_cap=exact, granularity=1)
    # the guard itself, without the check before step 0: refuses at 512 where exact counting runs
    import harmony_opt.measure.shapes
    monkeypatch.setattr(harmony_opt.measure.shapes, "measure_layer_bytes", lambda *a, **k: None)
    train(mlp(), p, steps=1, progress=False, optimizer="sgd", program=compile_plan(p), memory_cap=guard - 1,
          granularity=1)
    with pytest.raises(RuntimeMemoryError, match=r"^rank 0: instruction .* over the memory cap"):
        train(mlp(), p, steps=1, progress=False, optimizer="sgd", program=compile_plan(p), memory_cap=guard - 1,
              granularity=G)


@pytest.fixture(scope="module")
def tiny_profile():
    return profile_model(mlp(), [1, 2], "cpu", repeats=1, max_repeats=1, warmup=0, progress=False)


def test_profile_with_tensor_counts_round_trips(tiny_profile, tmp_path):
    prof = tiny_profile
    assert prof.has_tensor_counts and prof.alloc_granularity == 1       # a CPU profile plans exact
    assert list(prof.layers["param_tensors"]) == [2, 2, 2, 2, 2, 0]
    assert list(prof.layers["optimizer_state_tensors"]) == [2, 2, 2, 2, 2, 0]     # sgd with momentum
    loaded = Profile.load(prof.save(tmp_path / "mlp"))
    assert loaded.identity == prof.identity and loaded.has_tensor_counts
    for k, v in prof.tensor_counts().items():
        assert list(loaded.tensor_counts()[k]) == list(v), k
    gpu = loaded.with_alloc_granularity(G)
    assert gpu.alloc_granularity == G and Profile.load(gpu.save(tmp_path / "gpu")).alloc_granularity == G
    assert LayerBytes.from_profile(loaded, 2) == LayerBytes.from_profile(prof, 2)


def test_a_cpu_profile_planned_for_512_bounds_the_measured_sizes(tiny_profile):
    """Charged ``count * 511`` per tensor, the profile's sizes are never below the exactly rounded ones."""
    prof = tiny_profile.with_alloc_granularity(G)
    est, real = LayerBytes.from_profile(prof, 2), _sizes(G)
    for f in ("weights_pad", "buffers_pad"):
        assert all(e >= r for e, r in zip(getattr(est, f), getattr(real, f))), f
    assert est.weights_pad == tuple(2 * (G - 1) for _ in range(5)) + (0,)
    assert est.saved_tensors == real.saved_tensors
    p = plan("vPP", 1, 8, 2, 2, [(0, 1), (2, 3)], [(0, 1), (2, 3), (4, 5)], 6,
             options=tuple(PackOptions(optimizer="gpu") for _ in range(3)))
    assert (max(validate_program(compile_plan(p, layer_bytes=est), sizes=est).peak_bytes)
            >= max(validate_program(compile_plan(p, layer_bytes=real), sizes=real).peak_bytes))
    # the planner's pack memory and the simulator's task memory grow by the rounding too
    for phase in ("FWD", "BWD"):
        assert (prof.costs(phase, 2).memory > tiny_profile.costs(phase, 2).memory).all()
    grown = task_memory(p, prof, TaskKind.BWD, (0, 1), 0) - task_memory(p, tiny_profile, TaskKind.BWD, (0, 1), 0)
    assert grown == (prof.costs("BWD", 2).memory[:2] - tiny_profile.costs("BWD", 2).memory[:2]).sum() + 4 * (G - 1)


@pytest.mark.parametrize("name", ["gpt2_xl", "bert_large", "profiles/h100/gpt2_xl"])
def test_profiles_without_counts_keep_their_bytes(name):
    root = Path(__file__).parent.parent
    prof = load_profile(root / name if "/" in name else name)
    assert not prof.has_tensor_counts and prof.alloc_granularity == 1 and prof.alloc_pads() == {"granularity": 1}
    assert prof.pad_bytes("optimizer", 0, prof.num_layers - 1) == 0


def test_bad_granularity_is_one_line(tiny_profile):
    bad = Profile(tiny_profile.name, tiny_profile.layers, tiny_profile.microbatch,
                  {**tiny_profile.meta, "alloc_granularity": "512"})
    with pytest.raises(ProfileError, match=r"meta alloc_granularity must be a whole number of bytes >= 1, got '512'$"):
        bad.alloc_granularity
    with pytest.raises(UsageError, match="granularity must be a whole number of bytes >= 1, got 0"):
        train(mlp(), PLANS["recompute"], steps=1, progress=False, granularity=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_allocator_rounds_as_counted():
    """``torch.cuda.memory_allocated`` grows by each tensor's bytes rounded up to 512, as counted."""
    g = alloc_granularity("cuda")
    for n in (1, 4, 100, 128, 129, 1000, 1 << 20):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        t = torch.empty(n, dtype=torch.float32, device="cuda")
        assert torch.cuda.memory_allocated() - before == nbytes(t, g) == alloc_bytes(4 * n, g), n
        del t


def test_cli_compile_counts_the_device_it_will_run_on(tmp_path, capsys):
    """``compile --model --device cuda`` checks the cap with every tensor rounded to 512 bytes; the
    default (cpu) exactly."""
    from harmony_opt.cli import main
    from test_train import write_plan

    from harmony_opt.core.plan import Plan
    from harmony_opt.measure.models import build_model

    path = write_plan(tmp_path / "plan.json")
    m = build_model("gpt2-tiny")
    sizes = measure_layer_bytes(m.layers, *m.make_batch(1, torch.Generator().manual_seed(0)))
    # the least peak: every swap-in just in time, as the compiler issues them under a cap of 1 byte
    peak = max(validate_program(compile_plan(Plan.load(path), layer_bytes=sizes, memory_cap=1), sizes=sizes).peak_bytes)
    argv = ["compile", path, "-o", str(tmp_path / "p.json"), "--model", "gpt2-tiny", "--memory-cap", str(peak)]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv + ["--device", "cuda"]) == 2
    assert f"over the cap of {peak} bytes" in capsys.readouterr().err
