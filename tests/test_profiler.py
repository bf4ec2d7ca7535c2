"""Profiler, probe and the `profile` / `probe` commands (CPU; GPU variants skipped without CUDA)."""
from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from harmony_opt.cli import main
from harmony_opt.commands.measure import parse_microbatches
from harmony_opt.measure.decompose import LayeredModel
from harmony_opt.core.errors import InfeasibleError, UsageError
from harmony_opt.core.hardware import Hardware
from harmony_opt.measure.models import build_model
from harmony_opt.measure.probe import probe_hardware
from harmony_opt.core.profile import Profile
from harmony_opt.measure.profiler import cpu_update_time, profile_model, saved_bytes

FAST = dict(repeats=1, max_repeats=1, warmup=0, progress=False)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def gpt2_profile():
    model = build_model("gpt2-tiny")
    return model, profile_model(model, [2, 1], "cpu", **FAST)


def test_profile_round_trips_through_save_and_load(gpt2_profile, tmp_path):
    _, prof = gpt2_profile
    loaded = Profile.load(prof.save(tmp_path / "gpt2_tiny"))
    assert loaded.name == "gpt2-tiny" and loaded.num_layers == 8 and loaded.has_saved_bytes
    pd.testing.assert_frame_equal(loaded.layers, prof.layers, check_dtype=False)
    pd.testing.assert_frame_equal(loaded.microbatch, prof.microbatch, check_dtype=False)
    assert list(loaded.sizes("FWD")) == list(loaded.sizes("BWD")) == [1, 2]
    assert loaded.meta["device_type"] == "cpu" and loaded.meta["optimizer"] == "adam"
    assert loaded.meta["sequence_length"] == 32


def test_profile_values_are_consistent_with_the_model(gpt2_profile):
    model, prof = gpt2_profile
    micro, layers = prof.microbatch, prof.layers.set_index("layer")
    assert (micro.drop(columns="phase") >= 0).all().all() and (prof.layers >= 0).all().all()
    fwd = micro[micro.phase == "FWD"].pivot(index="layer", columns="microbatch", values="input_bytes")
    assert (fwd[2] == 2 * fwd[1]).all()
    assert fwd.loc[0, 1] == 32 * 8   # one sample of 32 int64 token ids
    for l, layer in enumerate(model.layers):
        nbytes = sum(p.numel() * p.element_size() for p in layer.parameters())
        assert layers.loc[l, "param_bytes"] == nbytes
        assert layers.loc[l, "optimizer_state_bytes"] == 2 * nbytes
        assert (layers.loc[l, "cpu_update_s"] > 0) == (nbytes > 0)
    bwd = micro[micro.phase == "BWD"].set_index(["microbatch", "layer"])
    fwd_peak = micro[micro.phase == "FWD"].set_index(["microbatch", "layer"])["peak_memory_bytes"]
    assert (bwd["peak_memory_bytes"] >= fwd_peak).all()
    assert (micro.gpu_time_s > 0).all()


def test_profile_times_the_stash_path_of_every_layer(gpt2_profile):
    """Every row has its stash-path time; the backward from a kept graph skips the forward a recomputing
    backward repeats, so for the typical layer it is well below the recomputing backward. (The median
    layer: this profile times each phase once, and one run in a few hundred on a shared 2-core machine
    takes 3-5x its usual time.)"""
    _, prof = gpt2_profile
    assert prof.has_stash_times and (prof.microbatch.stash_time_s > 0).all()
    for u in (1, 2):
        assert np.median(prof.stashed_backward(u) / prof.costs("BWD", u).time) < 0.9


def test_saved_bytes_counts_activations_not_parameters():
    linear, x = nn.Linear(16, 4), torch.randn(8, 16)
    assert saved_bytes(linear, x) == x.numel() * 4          # Linear saves its input; its weight is excluded
    assert saved_bytes(nn.Sequential(nn.Linear(16, 16), nn.ReLU()), x) >= 2 * x.numel() * 4


def test_cpu_update_time():
    assert cpu_update_time([], "adam") == 0.0
    assert cpu_update_time([nn.Parameter(torch.zeros(1000))], "sgd", repeats=1) > 0


def test_a_call_timed_in_a_busy_spell_leaves_no_layer_with_parameters_free(monkeypatch):
    """The fixed cost of a step call is timed beside every layer and the fastest is taken off: one timing
    made while the machine was busy (here the first, 1 s) must not leave a small layer's update at 0."""
    from harmony_opt.measure import profiler

    real, seen = profiler.cpu_call_time, []

    def busy_first(*args, **kwargs):
        seen.append(real(*args, **kwargs))
        return 1.0 if len(seen) == 1 else seen[-1]

    monkeypatch.setattr(profiler, "cpu_call_time", busy_first)
    model = build_model("gpt2-tiny")
    prof = profile_model(model, [1], "cpu", **FAST)
    layers = prof.layers.set_index("layer")
    assert len(seen) == model.num_layers
    assert prof.meta["cpu_update_call_s"] == min(seen[1:])
    for l, layer in enumerate(model.layers):
        assert (layers.loc[l, "cpu_update_s"] > 0) == any(p.requires_grad for p in layer.parameters())


class _OutOfMemoryAt(nn.Module):
    """Raises CUDA's out-of-memory error at batch sizes >= ``limit``, as a too-large layer would."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[0] >= self.limit:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return self.linear(x)


def _toy(limit: int) -> LayeredModel:
    layers = [nn.Linear(4, 4), _OutOfMemoryAt(limit), nn.CrossEntropyLoss()]
    def make_batch(b, g):
        return torch.randn(b, 4, generator=g), torch.randint(4, (b,), generator=g)

    return LayeredModel("toy", layers, make_batch, {"optimizer": "sgd"})


class _Records(nn.Linear):
    """A linear layer that records, in each forward with autograd on, whether its input needs a gradient."""

    def __init__(self, seen: list):
        super().__init__(4, 4)
        self.seen = seen

    def forward(self, x):
        if torch.is_grad_enabled():
            self.seen.append(x.requires_grad)
        return super().forward(x)


def test_the_backward_of_the_first_layer_computes_no_gradient_of_the_data():
    """The executor never differentiates the data (the first layer's input); a profile that did timed a
    CNN's first convolution at 2.7x its backward. Every other layer's input gets its gradient."""
    first, second = [], []
    layers = [_Records(first), _Records(second), nn.CrossEntropyLoss()]

    def make_batch(b, g):
        return torch.randn(b, 4, generator=g), torch.randint(4, (b,), generator=g)
    profile_model(LayeredModel("rec", layers, make_batch, {"optimizer": "sgd"}), [1, 2], "cpu", **FAST)
    assert first and not any(first)
    assert second and all(second)


def test_out_of_memory_drops_that_size_and_larger_for_every_layer():
    prof = profile_model(_toy(limit=4), [1, 2, 4, 8], "cpu", **FAST)
    assert list(prof.sizes("FWD")) == list(prof.sizes("BWD")) == [1, 2]
    assert len(prof.microbatch) == 2 * 2 * 3
    assert "microbatch 4" in prof.meta["skipped"][0]
    with pytest.raises(InfeasibleError, match="even at microbatch 1"):
        profile_model(_toy(limit=1), [1, 2], "cpu", **FAST)


def test_profile_refuses_bad_arguments():
    model = build_model("vgg-tiny")
    with pytest.raises(UsageError, match="whole numbers >= 1"):
        profile_model(model, [0, 1], "cpu", **FAST)
    with pytest.raises(UsageError, match="meta device"):
        profile_model(build_model("vgg-tiny", device="meta"), [1], "cpu", **FAST)
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="no CUDA"):
            profile_model(model, [1], "cuda", **FAST)


def test_probe_on_cpu_returns_a_valid_hardware(tmp_path):
    hw = probe_hardware("cpu", sizes=(1 << 20, 2 << 20), repeats=2)
    assert hw.gpus == 1 and hw.h2d_bandwidth > 0 and hw.gpu_memory_bytes > 0
    assert hw.pinned_memory_bytes <= hw.host_memory_bytes
    assert "WITHOUT a GPU" in hw.description
    assert Hardware.load(hw.save(tmp_path / "hw.toml")) == hw


# -- command line ------------------------------------------------------------------------------

def test_cli_profile_writes_a_loadable_profile(tmp_path, capsys):
    out = tmp_path / "prof"
    rc = main(["profile", "gpt2-tiny", "--device", "cpu", "-u", "1,2", "-o", str(out), "--repeats", "1",
               "--warmup", "0", "--no-progress", "--set", "n_layer=1"])
    assert rc == 0, capsys.readouterr().err
    prof = Profile.load(out)
    assert prof.num_layers == 5 and list(prof.sizes("FWD")) == [1, 2]
    assert "wrote" in capsys.readouterr().out


def test_cli_probe_writes_a_hardware_file(tmp_path, capsys):
    out = tmp_path / "hw.toml"
    rc = main(["probe", "--device", "cpu", "-o", str(out), "--sizes", "1MiB,2MiB", "--repeats", "2"])
    said = capsys.readouterr()
    assert rc == 0, said.err
    hw = Hardware.load(out)
    assert hw.gpus == 1
    if hw.collective_bandwidth:         # Gloo measured: the file and the summary hold its fixed cost
        assert hw.collective_latency_s >= 0 and f"all-reduce {hw.collective_latency_s * 1e6:.0f} us" in said.out


def test_parse_microbatches():
    assert parse_microbatches("4,1,2,2") == [1, 2, 4]
    assert parse_microbatches("1-9:4, 2") == [1, 2, 5, 9]


@pytest.mark.parametrize("argv, message", [
    (["profile", "gpt3", "-o", "{tmp}/p"], "unknown model"),
    (["profile", "gpt2-tiny", "-u", "1,x", "-o", "{tmp}/p"], "--microbatch"),
    (["profile", "gpt2-tiny", "-u", "0", "-o", "{tmp}/p"], "--microbatch"),
    (["profile", "gpt2-tiny", "-u", "4-2", "-o", "{tmp}/p"], "--microbatch"),
    (["profile", "gpt2-tiny", "-o", "{tmp}/file/p"], "cannot create"),
    (["profile", "gpt2-tiny", "-o", "{tmp}/file"], "not a folder"),
    (["profile", "gpt2-tiny", "--set", "depth=3", "-o", "{tmp}/p"], "unknown option"),
    (["profile", "gpt2-tiny", "--repeats", "0", "-u", "1", "-o", "{tmp}/p"], "repeats"),
    (["probe", "--device", "cpu", "-o", "{tmp}"], "is a folder"),
    (["probe", "--device", "cpu", "-o", "{tmp}/file/hw.toml"], "not a folder"),
    (["probe", "--device", "cpu", "--sizes", "lots", "-o", "{tmp}/hw.toml"], "--sizes"),
])
def test_cli_bad_input_exits_2_with_one_line(argv, message, tmp_path, capsys):
    (tmp_path / "file").write_text("not a folder")
    rc = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("command", ["profile gpt2-tiny", "probe"])
def test_cli_cuda_without_a_gpu_exits_2(command, tmp_path, capsys):
    assert main([*command.split(), "--device", "cuda", "-o", str(tmp_path / "out")]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


# -- GPU -----------------------------------------------------------------------------------------

@pytest.mark.gpu
@cuda
def test_profile_on_cuda_measures_peak_memory(tmp_path):
    model = build_model("gpt2-tiny")
    prof = profile_model(model, [1, 2], "cuda", **FAST)
    micro = prof.microbatch.merge(prof.layers, on="layer")
    assert (micro.peak_memory_bytes >= micro.param_bytes + micro.input_bytes).all()
    assert prof.meta["timing"] == "CUDA events"
    assert all(p.device.type == "cpu" for layer in model.layers for p in layer.parameters())
    Profile.load(prof.save(tmp_path / "p"))


@pytest.mark.gpu
@cuda
def test_probe_on_cuda():
    hw = probe_hardware("cuda", sizes=(1 << 20, 16 << 20), repeats=2)
    assert hw.gpus == torch.cuda.device_count() and hw.h2d_bandwidth > 1e8 and hw.d2h_bandwidth > 1e8
    assert hw.h2d_latency_s >= 0 and hw.d2h_latency_s >= 0 and hw.cpu_optimizer_call_s > 0
    assert isinstance(hw.copy_overlap, bool) and hw.collective_bandwidth is None


def test_counting_saved_bytes_keeps_no_graph_alive():
    """A saved output references its own grad_fn; a pack hook that kept it would leak every
    layer's graph (on a GPU, VGG-416's profile ran out of 80 GB by layer 25)."""
    import gc

    from harmony_opt.measure.profiler import saved_bytes

    layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    x = torch.randn(4, 8)

    def live() -> int:
        gc.collect()
        with warnings.catch_warnings():     # isinstance on torch.distributed's deprecated reduce_op warns
            warnings.simplefilter("ignore", FutureWarning)
            return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))

    saved_bytes(layer, x)
    before = live()
    counted = [saved_bytes(layer, x) for _ in range(5)]
    assert live() == before
    assert counted[0] >= 4 * 8 * 4 and len(set(counted)) == 1    # the ReLU's output at least, every time


def test_saved_bytes_counts_every_saved_storage_once():
    """The count equals what a real graph keeps: a GPT-2 block's many intermediates, freed as the
    forward goes unless held, must not share an address and be counted once."""
    from harmony_opt.measure.models import build_model
    from harmony_opt.measure.profiler import saved_bytes

    model = build_model("gpt2-tiny")
    block = model.layers[1]
    x = model.layers[0](model.make_batch(4, torch.Generator().manual_seed(0))[0])
    from harmony_opt.measure.profiler import saved_counts

    resident = {t.untyped_storage().data_ptr() for t in (*block.parameters(), *block.buffers())}
    kept, copies = {}, [0]

    def pack(t):
        if t.untyped_storage().data_ptr() not in resident:
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            copies[0] += t.numel() * t.element_size()
        return t

    xi = x.detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = block(xi)
    y.sum().backward()          # frees the graph the reference kept
    assert len(kept) > 5 and [saved_counts(block, x)[1] for _ in range(3)] == [sum(kept.values())] * 3
    # the stash copies every saved tensor (views of one storage too): the priced count is the larger
    assert copies[0] > sum(kept.values()) and saved_bytes(block, x) == copies[0]
    # the block saves its input (layer norm): a recompute shares it with the input the runtime holds
    assert saved_counts(block, x)[2] == x.untyped_storage().nbytes()


def test_layers_are_timed_as_the_executor_runs_them(monkeypatch):
    """The executor runs a layer through ``run_layer`` (functional_call over its device weights, a layer
    with dropout under seeded generators), which on a CPU costs a BERT-tiny block 20 % beyond its
    kernels: the profiler times every forward and backward through the same call, seeding exactly the
    layers with dropout, so that plans are not simulated that much too fast."""
    import harmony_opt.measure.profiler as profiler

    calls = []
    real = profiler.run_layer

    def spy(layer, state, args, key, device):
        calls.append((type(layer).__name__, key is not None, sorted(state) == sorted(
            n for n, _ in [*layer.named_parameters(), *layer.named_buffers()])))
        return real(layer, state, args, key, device)

    monkeypatch.setattr(profiler, "run_layer", spy)
    layers = [nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1)), nn.CrossEntropyLoss()]

    def make_batch(b, g):
        return torch.randn(b, 4, generator=g), torch.randint(4, (b,), generator=g)
    profile_model(LayeredModel("drop", layers, make_batch, {"optimizer": "sgd"}), [1, 2], "cpu", **FAST)
    seen = {(name, seeded) for name, seeded, _ in calls}
    assert seen == {("Linear", False), ("Sequential", True), ("CrossEntropyLoss", False)}
    assert all(full for *_, full in calls)
