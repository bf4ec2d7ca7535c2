"""Byte and time units, and parsing of sizes such as ``9e9``, ``10GiB`` or ``8583MB``."""
from __future__ import annotations

import re

from .errors import UsageError

KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40
KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12

_UNITS = {
    "": 1, "b": 1,
    "k": KB, "kb": KB, "m": MB, "mb": MB, "g": GB, "gb": GB, "t": TB, "tb": TB,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float, what: str = "size") -> int:
    """Parse ``9e9``, ``10GiB``, ``8583MB`` or a number into bytes (MB = 10^6, MiB = 2^20)."""
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        m = _SIZE.match(str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise UsageError(f"{what}: cannot read {text!r} as a size; write e.g. 9e9, 10GiB or 8583MB")
        value, unit = float(m.group(1)), m.group(2).lower()
    size = value * _UNITS[unit]
    if not size <= LARGEST_SIZE:        # inf and nan too
        raise UsageError(f"{what}: {text!r} is more than {fmt_bytes(LARGEST_SIZE)}, the largest size handled")
    if size < 1:
        raise UsageError(f"{what}: {text!r} is not a positive size")
    return int(size)


#: The largest size parse_bytes takes (8 PiB): byte counts are summed in 64-bit integers and
#: doubles, and 1e30 overflowed the planner's memory arithmetic.
LARGEST_SIZE = 2**53


def fmt_bytes(n: float) -> str:
    """Human-readable bytes in binary units (what GPU tools print)."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


#: Bytes PyTorch's CUDA caching allocator rounds every block up to (``kMinBlockSize`` in
#: c10/cuda/CUDACachingAllocator.cpp, ``round_size``); the CPU allocator is counted exactly.
CUDA_ALLOC_GRANULARITY = 512
_GRANULARITY = {"cuda": CUDA_ALLOC_GRANULARITY, "cpu": 1}


def alloc_granularity(device_type: str) -> int:
    """Bytes the device's allocator rounds each tensor up to: 512 on CUDA, 1 (exact) on the CPU."""
    try:
        return _GRANULARITY[str(device_type).split(":")[0]]
    except KeyError:
        raise UsageError(f"unknown device {device_type!r}; use cpu or cuda") from None


def alloc_bytes(nbytes: int, granularity: int = 1) -> int:
    """``nbytes`` rounded up to a multiple of ``granularity``: what one tensor holds on a device whose
    allocator rounds that way (an empty tensor holds nothing)."""
    n = int(nbytes)
    return n if granularity <= 1 or n <= 0 else -(-n // granularity) * granularity
