import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from harmony_opt import ProfileError, bundled_names, load_profile
from harmony_opt.core.memory import max_pack_end
from harmony_opt.core.profile import Profile

from conftest import synthetic_profile

# params (GB) of the shipped profiles, from ../shared/harmony-profiles/README.md
PAPER_PARAMS_GB = {"bert_large": 1.34, "bert_96": 4.97, "gpt2_medium": 1.63, "gpt2_xl": 6.55,
                   "vgg416": 2.31, "resnet1026": 3.21}
PAPER_LAYERS = {"bert_large": 28, "bert_96": 100, "gpt2_medium": 28, "gpt2_xl": 52, "vgg416": 417,
                "resnet1026": 515}


@pytest.mark.parametrize("name", sorted(PAPER_PARAMS_GB))
def test_bundled_profiles_load_with_paper_sizes(name):
    p = load_profile(name)
    assert name in bundled_names()
    assert p.num_layers == PAPER_LAYERS[name]
    assert round(p.totals()["param_bytes"] / 1e9, 2) == PAPER_PARAMS_GB[name]
    assert "Harmony" in p.meta["source"]


def slow_sum(p: Profile, phase, a, b, u):
    """Reference: interpolate each layer with numpy.interp and sum (Harmony's way)."""
    rows = p.microbatch[p.microbatch.phase == phase]
    t = m = 0.0
    for l in range(a, b + 1):
        r = rows[rows.layer == l].sort_values("microbatch")
        t += np.interp(u, r.microbatch, r.gpu_time_s)
        m += int(np.interp(u, r.microbatch, r.peak_memory_bytes))
    x = p.input_bytes_at(u)
    return t, m - sum(int(x[l]) for l in range(a + 1, b + 1))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_pack_queries_equal_slow_reference(data):
    p = load_profile(data.draw(st.sampled_from(["gpt2_xl", "bert_large", "vgg416"])))
    phase = data.draw(st.sampled_from(["FWD", "BWD"]))
    lo, hi = p.size_range(phase)
    u = data.draw(st.integers(lo, hi))
    a = data.draw(st.integers(0, p.num_layers - 1))
    b = data.draw(st.integers(a, min(p.num_layers - 1, a + 40)))
    c = p.costs(phase, u)
    t, m = slow_sum(p, phase, a, b, u)
    assert c.pack_time(a, b) == pytest.approx(t, rel=1e-12)
    assert int(c.pack_memory(a, b)) == m


def test_interpolation_matches_hand_computed_values():
    p = synthetic_profile(R=3, sizes=(1, 4))
    rows = p.microbatch[(p.microbatch.phase == "FWD") & (p.microbatch.layer == 1)].sort_values("microbatch")
    t1, t4 = rows.gpu_time_s.to_numpy()
    m1, m4 = rows.peak_memory_bytes.to_numpy()
    c = p.costs("FWD", 2)   # one third of the way from 1 to 4
    assert c.time[1] == pytest.approx(t1 + (t4 - t1) / 3)
    assert c.memory[1] == int(m1 + (m4 - m1) / 3)
    x1 = rows.input_bytes.to_numpy()[0]
    assert c.input[1] == x1 * 2          # input bytes scale with u, not interpolated
    assert c.input[3] == 0               # the loss has no output


def test_outside_profiled_range_is_an_error():
    p = load_profile("gpt2_xl")
    with pytest.raises(ProfileError, match="outside the profiled BWD range 1..9"):
        p.costs("BWD", 10)


def test_static_pack_quantities():
    p = load_profile("gpt2_medium")
    lay = p.layers
    assert p.param_bytes(3, 7) == lay.param_bytes[3:8].sum()
    assert p.optimizer_bytes(0, 27) == lay.optimizer_state_bytes.sum()
    assert p.cpu_update_time(1, 1) == pytest.approx(lay.cpu_update_s[1])


def test_max_pack_end_matches_brute_force(small_profile):
    c = small_profile.costs("BWD", 4)
    cap = int(c.pack_memory(0, 3))
    end = max_pack_end(c, cap)
    for i in range(small_profile.num_layers):
        fits = [j for j in range(i, small_profile.num_layers) if c.pack_memory(i, j) <= cap]
        assert end[i] == (max(fits) if fits else i - 1)


def test_save_load_roundtrip_csv_and_parquet(tmp_path, small_profile):
    for fmt in ("csv", "parquet"):
        small_profile.save(tmp_path / fmt, fmt=fmt)
        q = Profile.load(tmp_path / fmt)
        assert q.identity == small_profile.identity
        assert q.costs("BWD", 3).pack_time(0, 5) == pytest.approx(small_profile.costs("BWD", 3).pack_time(0, 5))


def test_identity_is_the_contents_not_how_pandas_holds_them():
    """Plans record the profile's identity and refuse another: a plan made on one machine must load
    on a machine with another pandas (pandas' own hashing changed between 3.0 and 3.1, and a GPU
    server refused the plans made here). So the identity follows the values, not their dtypes, and
    the bundled profiles keep the identities that stored plans (experiments/results/gpu/) name."""
    p = load_profile("gpt2_xl")
    assert p.identity == "d247f4a42505a949"
    layers = p.layers.astype({c: "int32" for c in ("layer", "buffer_bytes")})
    micro = p.microbatch.astype({"phase": object})
    assert Profile(p.name, layers, micro, p.meta).identity == p.identity
    changed = p.microbatch.copy()
    changed.loc[0, "gpu_time_s"] *= 1.001
    assert Profile(p.name, p.layers, changed, p.meta).identity != p.identity


def _write(tmp_path, layers: str, micro: str):
    (tmp_path / "layers.csv").write_text(layers)
    (tmp_path / "microbatch.csv").write_text(micro)
    return tmp_path


GOOD_LAYERS = "layer,param_bytes,buffer_bytes,optimizer_state_bytes,cpu_update_s\n0,10,0,20,0.1\n1,10,0,20,0.1\n"
HEADER = "phase,microbatch,layer,gpu_time_s,peak_memory_bytes,input_bytes\n"
GOOD_MICRO = HEADER + "FWD,1,0,0.1,100,4\nFWD,1,1,0.1,100,4\nBWD,1,0,0.2,200,4\nBWD,1,1,0.2,200,4\n"


@pytest.mark.parametrize("layers,micro,fragment", [
    (GOOD_LAYERS.replace("cpu_update_s", "cpu_update"), GOOD_MICRO, "missing column(s) cpu_update_s"),
    (GOOD_LAYERS, GOOD_MICRO.replace("FWD,1,1,0.1", "FWD,1,1,-0.1"), "row 3, column gpu_time_s: negative"),
    (GOOD_LAYERS.replace("\n1,10", "\n2,10"), GOOD_MICRO, "layer 1 is missing"),
    (GOOD_LAYERS, GOOD_MICRO.replace("BWD,1,0,0.2,200", "BWD,1,0,abc,200"), "'abc' is not a finite number"),
    (GOOD_LAYERS, GOOD_MICRO.replace("FWD,1,0,0.1,100", "FWD,1,0,nan,100"), "is not a finite number"),
    (GOOD_LAYERS, HEADER + "FWD,1,0,0.1,100,4\nFWD,1,1,0.1,100,4\n", "no rows for phase BWD"),
    (GOOD_LAYERS, GOOD_MICRO + "FWD,1,1,0.1,100,4\n", "appears twice"),
    (GOOD_LAYERS, GOOD_MICRO.replace("BWD,1,1,0.2,200,4\n", ""), "has 1 of 2 layers"),
    (GOOD_LAYERS.replace("0,10,0,20", "0,10000000000000000,0,20"), GOOD_MICRO, "implausibly large"),
    ("", GOOD_MICRO, "the file is empty"),
    (GOOD_LAYERS.splitlines()[0] + "\n", GOOD_MICRO, "has a header but no rows"),
])
def test_bad_profiles_name_file_row_and_column(tmp_path, layers, micro, fragment):
    with pytest.raises(ProfileError) as e:
        Profile.load(_write(tmp_path, layers, micro))
    assert fragment in str(e.value)
    assert str(tmp_path) in str(e.value)


def test_missing_folder(tmp_path):
    with pytest.raises(ProfileError, match="does not exist"):
        Profile.load(tmp_path / "nope")


def test_saved_activations_estimated_beyond_the_backward_sizes_grow_with_the_microbatch():
    # Harmony's gpt2_xl profile has forward sizes 1..18 but backward sizes only 1..9: a stashed
    # forward microbatch of 11 keeps about 11/9 of what one of 9 keeps, not just each layer's input
    p = load_profile("gpt2_xl")
    assert not p.has_saved_bytes and p.size_range("BWD")[1] == 9 < 11 <= p.size_range("FWD")[1]
    at9, at11 = p.costs("FWD", 9).saved, p.costs("FWD", 11).saved
    assert at11.sum() == pytest.approx(at9.sum() * 11 / 9, rel=1e-6)
    assert np.all(at11 >= p.costs("FWD", 11).input[:-1])
    assert at11.sum() > 10 * p.costs("FWD", 11).input[:-1].sum()


def test_stash_times_give_the_stash_path_and_their_absence_the_old_estimate(tmp_path):
    """``stash_time_s`` (optional): the stashing forward's extra over the plain one (never negative) and
    the backward from a kept graph; without it, no extra and the backward less the forward."""
    micro = GOOD_MICRO.replace("input_bytes\n", "input_bytes,stash_time_s\n")
    micro = micro.replace("FWD,1,0,0.1,100,4\n", "FWD,1,0,0.1,100,4,0.15\n").replace(
        "FWD,1,1,0.1,100,4\n", "FWD,1,1,0.1,100,4,0.05\n").replace(
        "BWD,1,0,0.2,200,4\n", "BWD,1,0,0.2,200,4,0.07\n").replace("BWD,1,1,0.2,200,4\n", "BWD,1,1,0.2,200,4,0.09\n")
    (tmp_path / "new").mkdir()
    (tmp_path / "old").mkdir()
    p = Profile.load(_write(tmp_path / "new", GOOD_LAYERS, micro))
    assert p.has_stash_times
    assert list(p.stash_forward_extra(1)) == pytest.approx([0.05, 0.0])
    assert list(p.stashed_backward(1)) == pytest.approx([0.07, 0.09])
    assert p.stashed_backward_time(1, 0, 1) == pytest.approx(0.16)
    scaled = p.with_compute_scale(2.0)
    assert list(scaled.stash_forward_extra(1)) == pytest.approx([0.1, 0.0])
    assert scaled.stashed_backward_time(1, 0, 1) == pytest.approx(0.32)
    old = Profile.load(_write(tmp_path / "old", GOOD_LAYERS, GOOD_MICRO))
    assert not old.has_stash_times and list(old.stash_forward_extra(1)) == [0.0, 0.0]
    assert list(old.stashed_backward(1)) == pytest.approx([0.1, 0.1])


def test_a_missing_stash_time_names_the_row(tmp_path):
    micro = GOOD_MICRO.replace("input_bytes\n", "input_bytes,stash_time_s\n").replace(",4\n", ",4,0.1\n")
    micro = micro.replace("BWD,1,1,0.2,200,4,0.1\n", "BWD,1,1,0.2,200,4,\n")
    with pytest.raises(ProfileError, match="row 5, column stash_time_s"):
        Profile.load(_write(tmp_path, GOOD_LAYERS, micro))
