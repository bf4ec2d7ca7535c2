"""Shared fixtures: synthetic profiles small enough for property tests; derandomized hypothesis."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import settings

from harmony_opt.core.profile import Profile

# Every run draws the same examples (seeded by each test's source), so a failure reproduces by rerunning
# the test; no deadline (a timing failure would not reproduce) and the failure report carries the
# @reproduce_failure blob. Loaded before the test modules define their @settings, which inherit it and
# keep their own max_examples and deadline. Explore new examples with --hypothesis-profile=default.
settings.register_profile("derandomized", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("derandomized")


def synthetic_profile(R: int = 8, sizes=(1, 2, 4, 8), seed: int = 0, mem_scale: float = 1.0,
                      name: str = "synthetic", act_scale: int = 1) -> Profile:
    """A random but physically sensible profile: times and memory grow with the microbatch
    (``act_scale``: activations that many times larger, for transfers that outlast the compute)."""
    rng = np.random.default_rng(seed)
    w = rng.integers(1, 50, R) * 2**20
    x = rng.integers(1, 8, R) * 2**18 * act_scale
    x[0] = 2**12
    t = rng.uniform(1e-3, 5e-3, R)
    layers = pd.DataFrame({"layer": np.arange(R), "param_bytes": w, "buffer_bytes": np.zeros(R, int),
                           "optimizer_state_bytes": 2 * w, "cpu_update_s": w / 4e9})
    rows = []
    for phase, k in (("FWD", 1.0), ("BWD", 3.0)):
        for u in sizes:
            for l in range(R):
                act = int(x[l] * u)
                peak = int((w[l] * (1 if phase == "FWD" else 2) + 3 * act) * mem_scale)
                rows.append((phase, u, l, float(k * t[l] * (0.5 + 0.5 * u)), peak, act))
    micro = pd.DataFrame(rows, columns=["phase", "microbatch", "layer", "gpu_time_s", "peak_memory_bytes",
                                        "input_bytes"])
    return Profile(name, layers, micro, {"model": name})


@pytest.fixture
def small_profile():
    return synthetic_profile()


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: faster on tiny models, and no spin-waiting collapse when other
    processes share the cores (as the executor's rank processes already do)."""
    from harmony_opt.runtime.optim import intra_op_threads
    with intra_op_threads(1):
        yield
