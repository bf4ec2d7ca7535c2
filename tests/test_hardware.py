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


@pytest.mark.parametrize("text", ["ten", "10XB", "-5", "0"])
def test_parse_bytes_rejects(text):
    with pytest.raises(UsageError):
        parse_bytes(text)


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
