"""Profiles that can be trusted: the timing statistic, the thread count, the flags and their re-measurement."""
from __future__ import annotations

import json
import time

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

from conftest import synthetic_profile
from harmony_opt.cli import main
from harmony_opt.core.errors import UsageError
from harmony_opt.core.profile import Profile
from harmony_opt.measure.decompose import LayeredModel
from harmony_opt.measure.flags import layer_signature, profile_flags, profile_warnings, thread_note
from harmony_opt.measure.probe import probe_hardware
from harmony_opt.measure.profiler import profile_model
from harmony_opt.measure.timing import check_repeats, robust_median, time_runs
from harmony_opt.runtime.optim import host_threads


# -- the statistic -----------------------------------------------------------------------------

def test_robust_median_drops_the_far_runs_only():
    assert robust_median([1.0, 1.1, 0.9, 1.05, 100.0]) == (pytest.approx(1.025), 1)
    assert robust_median([2.0, 2.0, 2.0]) == (2.0, 0)          # identical runs: nothing is an outlier
    assert robust_median([1.0, 1.2, 0.8]) == (1.0, 0)


def _clock(durations):
    """A fake clock: each timed run takes the next of ``durations`` seconds."""
    ticks, now = [], [0.0]
    it = iter(durations)

    def clock():
        if len(ticks) % 2:
            now[0] += next(it)
        ticks.append(now[0])
        return now[0]
    return clock


def test_time_runs_takes_the_median_without_the_outlier_and_stops_when_settled():
    calls = []
    t = time_runs(lambda: calls.append(1), repeats=5, max_repeats=20, warmup=2,
                  clock=_clock([1, 1, 1, 1, 50] + [1] * 20))
    # an outlier in the first batch: one more batch (3 runs), the median did not move: settled
    assert (t.seconds, t.runs, t.dropped, t.settled) == (1, 8, 1, True)
    assert len(calls) == 2 + 8                                   # the warm-up runs are not timed


def test_time_runs_stops_at_once_on_tight_runs_and_at_the_cap_on_a_wandering_median():
    tight = time_runs(lambda: None, repeats=3, max_repeats=9, warmup=0, clock=_clock([1.0, 1.01, 0.99]))
    assert (tight.runs, tight.settled) == (3, True)
    wander = time_runs(lambda: None, repeats=2, max_repeats=6, warmup=0,
                       clock=_clock([1, 2, 3, 4, 5, 6]))
    assert (wander.runs, wander.settled) == (6, False) and wander.seconds == 3.5


def test_time_runs_with_a_setup_times_only_the_run_each_setup_feeds():
    """A backward needs a fresh graph per run: ``setup`` makes it before each run (warm-up too), outside
    the timed part; a clock read inside ``setup`` would be timed otherwise."""
    made, used = [], []
    now = [0.0]

    def setup():
        now[0] += 100.0                 # the untimed forward
        made.append(len(made))
        return made[-1]

    def run(arg):
        now[0] += 1.0
        used.append(arg)

    t = time_runs(run, repeats=3, max_repeats=3, warmup=1, setup=setup, clock=lambda: now[0])
    assert t.seconds == 1.0 and t.runs == 3
    assert used == made == [0, 1, 2, 3]


def test_repeat_counts_are_checked():
    assert check_repeats(5, None, 1) == 20
    for repeats, cap, warmup in ((0, None, 1), (3, 2, 1), (3, None, -1)):
        with pytest.raises(UsageError, match="repeats must be >= 1"):
            check_repeats(repeats, cap, warmup)


# -- flags on crafted profiles -----------------------------------------------------------------

def _with_times(profile: Profile, changes: dict, signatures=None) -> Profile:
    """A copy with gpu_time_s set at {(phase, u, layer): seconds} and the given layer signatures."""
    micro = profile.microbatch.copy()
    for (ph, u, l), t in changes.items():
        micro.loc[(micro.phase == ph) & (micro.microbatch == u) & (micro.layer == l), "gpu_time_s"] = t
    meta = dict(profile.meta, **({"layer_signatures": signatures} if signatures else {}))
    return Profile(profile.name, profile.layers, micro, meta)


@settings(max_examples=15)
@given(seed=st.integers(0, 50))
def test_a_physical_profile_raises_no_flag(seed):
    p = synthetic_profile(R=6, seed=seed)
    assert profile_flags(p) == []


@settings(max_examples=15)
@given(seed=st.integers(0, 50), layer=st.integers(0, 5), drop=st.floats(0.2, 0.9))
def test_a_larger_microbatch_measured_faster_is_flagged_with_its_layer_and_figures(seed, layer, drop):
    p = synthetic_profile(R=6, seed=seed)
    t4 = float(p.costs("FWD", 4).time[layer])
    flags = profile_flags(_with_times(p, {("FWD", 8, layer): t4 * (1 - drop)}))
    assert [f.kind for f in flags] == ["non-monotonic"]
    assert flags[0].suspects == ((layer, 4), (layer, 8))
    assert f"layer {layer} FWD: microbatch 8 measured faster than microbatch 4" in flags[0].text
    assert f"{t4 * 1e3:.3g} ms" in flags[0].text


def test_within_the_tolerance_is_not_flagged():
    p = synthetic_profile(R=4)
    t4 = float(p.costs("BWD", 4).time[1])
    assert profile_flags(_with_times(p, {("BWD", 8, 1): t4 * 0.95})) == []


@settings(max_examples=15)
@given(factor=st.floats(2.2, 50), slow=st.sampled_from([1, 2, 3]))
def test_identical_layers_more_than_2x_apart_are_flagged(factor, slow):
    p = synthetic_profile(R=5, sizes=(1,))
    base = {("FWD", 1, l): 1e-3 for l in (1, 2, 3)} | {("BWD", 1, l): 3e-3 for l in (1, 2, 3)}
    sigs = ["Embed:a", "Block:b", "Block:b", "Block:b", "Loss:c"]
    assert profile_flags(_with_times(p, base, sigs)) == []
    flags = profile_flags(_with_times(p, base | {("FWD", 1, slow): factor * 1e-3}, sigs))
    assert [f.kind for f in flags] == ["identical-apart"]
    assert set(flags[0].suspects) == {(1, 1), (2, 1), (3, 1)}
    assert flags[0].text.startswith("layers 1-3 (Block, identical) FWD at microbatch 1: 1 ms")
    assert f"(layer {slow})" in flags[0].text and f"{factor:.1f}x apart" in flags[0].text
    # without signatures nothing says the layers are identical
    assert profile_flags(_with_times(p, base | {("FWD", 1, slow): factor * 1e-3})) == []


def test_a_busy_machine_is_flagged_from_the_meta():
    p = synthetic_profile(R=3)
    busy = Profile(p.name, p.layers, p.microbatch, {"load_average": 7.5, "cores": 2, "threads": 2})
    idle = Profile(p.name, p.layers, p.microbatch, {"load_average": 0.5, "cores": 2, "threads": 2})
    assert [f.kind for f in profile_flags(busy)] == ["busy"] and "load average 7.5 on 2" in profile_warnings(busy)[0]
    assert profile_flags(idle) == []


def test_layer_signature_is_the_structure_and_the_input_shape():
    x4, x8 = torch.zeros(2, 4), torch.zeros(2, 8)
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    assert layer_signature(a, x4) == layer_signature(b, x4) == layer_signature(b, torch.zeros(5, 4))
    assert layer_signature(a, x4) != layer_signature(nn.Linear(4, 8), x4)
    assert layer_signature(nn.Linear(8, 8), x8) != layer_signature(nn.Linear(8, 8), torch.zeros(2, 3, 8))
    assert layer_signature(nn.Sequential(nn.Linear(4, 4)), x4) != layer_signature(a, x4)
    assert layer_signature(a, x4).startswith("Linear:")


def test_thread_note_only_when_the_counts_differ():
    here = host_threads(1, "cpu", torch.get_num_threads())
    assert thread_note({"threads": here}, "cpu", 1) is None
    assert thread_note({}, "cpu", 1) is None
    note = thread_note({"threads": here + 7}, "cpu", 1)
    assert f"measured with {here + 7} intra-op thread(s)" in note and f"uses {here}" in note


# -- the profiler ------------------------------------------------------------------------------

class _Block(nn.Module):
    """A layer whose time is a sleep (deterministic enough to test behaviour, not speed); ``slow_calls``
    first calls sleep 10x longer, as a layer measured while another process held the core."""

    def __init__(self, slow_calls: int = 0):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.slow_calls, self.threads = slow_calls, set()

    def forward(self, x):
        self.threads.add(torch.get_num_threads())
        time.sleep(0.1 if self.slow_calls > 0 else 0.01)
        self.slow_calls -= 1
        return self.linear(x)


def _blocks(slow_calls: int) -> LayeredModel:
    layers = [_Block(), _Block(slow_calls), _Block(), nn.CrossEntropyLoss()]

    def make_batch(b, g):
        return torch.randn(b, 4, generator=g), torch.randint(4, (b,), generator=g)
    return LayeredModel("blocks", layers, make_batch, {"optimizer": "sgd"})


ONCE = dict(repeats=1, max_repeats=1, warmup=0, progress=False)
THRICE = dict(repeats=3, max_repeats=3, warmup=0, progress=False)


def test_a_layer_slow_once_is_measured_again_and_not_flagged():
    # the first measurement of layer 1 makes 9 calls (forward peak + 3 timed, backward peak + 3 timed, the
    # saved-bytes count): all slow; the re-measurement's are not
    prof = profile_model(_blocks(slow_calls=9), [1], "cpu", **THRICE)
    assert prof.meta["remeasured"] == [[0, 1], [1, 1], [2, 1]]
    assert not [w for w in prof.meta["warnings"] if "identical" in w]
    assert len(set(prof.meta["layer_signatures"][:3])) == 1
    unmeasured = profile_model(_blocks(slow_calls=9), [1], "cpu", remeasure=False, **THRICE)
    assert unmeasured.meta["remeasured"] == []
    assert [w for w in unmeasured.meta["warnings"] if w.startswith("layers 0-2 (_Block, identical) FWD")]


def test_a_layer_slow_throughout_stays_flagged():
    prof = profile_model(_blocks(slow_calls=10**6), [1], "cpu", **ONCE)
    assert [w for w in prof.meta["warnings"] if "(layer 1)" in w and "identical" in w]


def test_the_profiler_runs_with_the_thread_count_it_records():
    before = torch.get_num_threads()
    model = _blocks(0)
    prof = profile_model(model, [1], "cpu", threads=1, **ONCE)
    assert prof.meta["threads"] == 1 and model.layers[0].threads == {1}
    assert torch.get_num_threads() == before
    default = profile_model(_blocks(0), [1], "cpu", **ONCE)
    assert default.meta["threads"] == host_threads(1, "cpu", before)
    assert default.meta["repeats"] == 1 and default.meta["max_repeats"] == 1
    with pytest.raises(UsageError, match="threads must be a whole number"):
        profile_model(_blocks(0), [1], "cpu", threads=0, **ONCE)


def test_probe_records_its_thread_count():
    hw = probe_hardware("cpu", sizes=(1 << 20,), repeats=1, threads=1)
    assert "with 1 intra-op thread(s)" in hw.description
    with pytest.raises(UsageError, match="threads"):
        probe_hardware("cpu", sizes=(1 << 20,), repeats=1, threads=0)


# -- command line ------------------------------------------------------------------------------

def test_check_and_show_print_a_crafted_profiles_flags(tmp_path, capsys):
    p = synthetic_profile(R=4)
    t4 = float(p.costs("FWD", 4).time[2])
    folder = _with_times(p, {("FWD", 8, 2): t4 / 3}).save(tmp_path / "prof")
    assert main(["check", str(folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("ok: profile") and out[1].startswith("warning: layer 2 FWD: microbatch 8 measured")
    assert len(out) == 2
    assert main(["show", str(folder)]) == 0
    assert "warning: layer 2 FWD: microbatch 8" in capsys.readouterr().out


def test_cli_profile_takes_threads_and_prints_warnings(tmp_path, capsys):
    out = tmp_path / "prof"
    rc = main(["profile", "gpt2-tiny", "--device", "cpu", "-u", "1", "-o", str(out), "--repeats", "1",
               "--max-repeats", "2", "--warmup", "0", "--no-progress", "--set", "n_layer=1", "--threads", "1"])
    printed = capsys.readouterr().out
    assert rc == 0 and "1 intra-op thread(s)" in printed
    meta = json.loads((out / "meta.json").read_text())
    assert meta["threads"] == 1 and meta["max_repeats"] == 2
    assert printed.count("warning: ") == len(meta["warnings"])
    assert main(["profile", "gpt2-tiny", "--threads", "0", "-o", str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err
    assert "--threads" in err and err.count("\n") == 1
