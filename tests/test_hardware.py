import pytest

from harmony_opt import HardwareError, UsageError, get_hardware
from harmony_opt.core.hardware import PRESETS, Hardware
from harmony_opt.core.units import GiB, parse_bytes


def test_presets_carry_the_paper_constants():
    hw = get_hardware("1080ti-x4")
    assert hw.gpus == 4 and hw.h2d_bandwidth == 11.5 * GiB and hw.p2p_bandwidth == 8.2 * GiB
    assert hw.gpu_memory_bytes == 10 * GiB and hw.link_slots == 1
    assert get_hardware("h100-x1").gpus == 1


@pytest.mark.parametrize("text,expected", [("9e9", 9 * 10**9), ("10GiB", 10 * 2**30), ("8583MB", 8583 * 10**6),
                                           ("512 MiB", 512 * 2**20), (1000, 1000)])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["ten", "10XB", "-5", "0", "1e30", float("inf")])
def test_parse_bytes_rejects(text):
    with pytest.raises(UsageError):
        parse_bytes(text)


def test_a_huge_memory_cap_is_one_line(capsys):
    """1e30 bytes overflowed the planner's 64-bit memory arithmetic: an internal error."""
    from harmony_opt.cli import main
    assert main(["plan", "--hardware", "1080ti-x4", "--profile", "gpt2_medium", "--batch", "8",
                 "--memory-cap", "1e30"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--memory-cap: '1e30' is more than 8192.00 TiB" in err


def test_file_roundtrip_and_overrides(tmp_path):
    path = PRESETS["1080ti-x4"].save(tmp_path / "hw.toml")
    hw = get_hardware(path, memory_cap="9e9", gpus=2)
    assert hw.gpu_memory_bytes == 9 * 10**9 and hw.gpus == 2 and hw.p2p_bandwidth == 8.2 * GiB


@pytest.mark.parametrize("body,fragment", [
    ("gpus = 2\n", "missing field"),
    ('name="x"\ngpus=1\ngpu_memory_bytes="10GiB"\nhost_memory_bytes="64GiB"\npinned_memory_bytes="8GiB"\n'
     'h2d_bandwidth=0\nd2h_bandwidth=1e9\n', "h2d_bandwidth must be a positive"),
    ("this is [not toml", "not valid TOML"),
    ('name="x"\nbogus=1\n', "unknown field(s) bogus"),
])
def test_bad_hardware_files(tmp_path, body, fragment):
    f = tmp_path / "hw.toml"
    f.write_text(body)
    with pytest.raises(HardwareError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        Hardware.load(f)


def test_unknown_preset():
    with pytest.raises(HardwareError, match="unknown hardware 'gtx9000'"):
        get_hardware("gtx9000")


TERMS = dict(copy_overlap=False, h2d_latency_s=2e-5, d2h_latency_s=3e-5, compute_scale=0.75,
             cpu_optimizer_call_s=1e-3, gpu_optimizer_call_s=4e-5, gpu_optimizer_tensor_s=7e-6, issue_overhead_s=5e-5,
             collective_bandwidth=2e9, collective_latency_s=4e-4)


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_execution_terms_round_trip_through_files(tmp_path, suffix):
    import dataclasses
    hw = dataclasses.replace(PRESETS["1080ti-x4"], **TERMS)
    back = Hardware.load(hw.save(tmp_path / f"hw{suffix}"))
    assert back == hw and not back.neutral_terms
    assert back.all_reduce_bandwidth == 2e9 and PRESETS["1080ti-x4"].all_reduce_bandwidth == 8.2 * GiB
    assert back.without_execution_terms() == PRESETS["1080ti-x4"]


def test_each_all_reduce_call_pays_the_collective_latency():
    """An all-reduce costs its latency once per call on top of the ring's bytes, over an array of packs
    too (the planner prices every candidate pack at once); one replica makes no call."""
    import dataclasses
    import numpy as np
    hw = dataclasses.replace(PRESETS["1080ti-x4"], collective_bandwidth=2e9, collective_latency_s=4e-4)
    w = np.array([0.0, 1e6, 8e6])
    assert hw.allreduce_time(w, 2) == pytest.approx(w / 2e9 + 4e-4)
    assert hw.allreduce_time(w, 4) == pytest.approx(1.5 * w / 2e9 + 4e-4)
    assert hw.allreduce_time(1e6, 1) == 0.0


def test_neutral_terms_are_left_out_of_what_plans_record_and_files_hold(tmp_path):
    """A description at the defaults reads and writes as before the terms existed (plans record it)."""
    hw = PRESETS["1080ti-x4"]
    assert hw.neutral_terms and not set(hw.to_dict()) & set(TERMS)
    text = hw.save(tmp_path / "hw.toml").read_text()
    assert not any(k in text for k in TERMS)
    assert Hardware.from_dict(hw.to_dict()) == hw


@pytest.mark.parametrize("line,fragment", [
    ("h2d_latency_s = -1e-6", "h2d_latency_s must be a finite number of seconds >= 0, got -1e-06"),
    ("d2h_latency_s = \"fast\"", "field d2h_latency_s must be a number (seconds), got 'fast'"),
    ("compute_scale = 0", "compute_scale must be a finite number > 0, got 0"),
    ("compute_scale = -2.0", "compute_scale must be a finite number > 0"),
    ("cpu_optimizer_call_s = -0.001", "cpu_optimizer_call_s must be a finite number of seconds >= 0"),
    ("gpu_optimizer_tensor_s = -1e-6", "gpu_optimizer_tensor_s must be a finite number of seconds >= 0"),
    ("gpu_optimizer_call_s = true", "field gpu_optimizer_call_s must be a number (seconds), got True"),
    ("issue_overhead_s = inf", "issue_overhead_s must be a finite number of seconds >= 0, got inf"),
    ("collective_bandwidth = 0", "collective_bandwidth must be a positive finite bandwidth"),
    ("collective_latency_s = -1e-4", "collective_latency_s must be a finite number of seconds >= 0"),
    ("copy_overlap = 1", "field copy_overlap must be true or false, got 1"),
])
def test_bad_execution_terms_are_refused_in_one_line(tmp_path, line, fragment):
    f = tmp_path / "hw.toml"
    f.write_text(PRESETS["h100-x1"].save(tmp_path / "base.toml").read_text() + line + "\n")
    with pytest.raises(HardwareError) as e:
        Hardware.load(f)
    msg = str(e.value)
    assert fragment in msg and msg.startswith(str(f)) and "\n" not in msg
