"""The probe's terms: the fits, and each measurement through the executor's code on the CPU (GPU variants in
test_profiler.py)."""
from __future__ import annotations

import statistics

import pytest

from harmony_opt.core.errors import UsageError
from harmony_opt.core.hardware import Hardware
from harmony_opt.core.units import KiB
from harmony_opt.measure.probe import (
    call_cost, fit_linear, gpu_step_terms, latency_bandwidth, measure_collective, measure_cpu_optimizer,
    measure_gpu_optimizer, measure_issue_overhead, measure_p2p, measure_transfers, probe_hardware, transfer_fit)

# one intra-op thread for every test here (conftest.one_thread): no spin-waiting collapse on a busy machine
pytestmark = pytest.mark.usefixtures("one_thread")


def _median_error(fit) -> float:
    return statistics.median(abs(fit.predict(*x) - t) / t for x, t in fit.points)


def test_fit_recovers_a_known_latency_and_bandwidth():
    latency, bandwidth = 37e-6, 6.5e9
    sizes = [4 * KiB, 64 * KiB, 1 << 20, 16 << 20, 256 << 20]
    fit = fit_linear(sizes, [latency + n / bandwidth for n in sizes])
    got = latency_bandwidth(fit)
    assert got[0] == pytest.approx(latency, rel=1e-9) and got[1] == pytest.approx(bandwidth, rel=1e-9)
    assert fit.worst < 1e-9
    # with the tensor count as a second term: the latency is a one-tensor transfer's
    xs = [(n, k) for n in sizes for k in (1, 4, 16)]
    fit = transfer_fit([(x, 2e-4 + x[0] / 3e9 + 9e-6 * x[1]) for x in xs])
    assert fit.coef == pytest.approx((2e-4, 1 / 3e9, 9e-6), rel=1e-9)
    assert latency_bandwidth(fit) == pytest.approx((2e-4 + 9e-6, 3e9), rel=1e-9)
    assert call_cost(fit) == pytest.approx(2e-4 + 4 / 3e9 + 9e-6, rel=1e-9)
    # one tensor count only: a line over bytes
    assert len(transfer_fit([((n, 1), latency + n / bandwidth) for n in sizes]).coef) == 2


def test_latency_and_bandwidth_stay_valid_on_noisy_points():
    # a negative intercept is no latency; a flat line falls back to the best rate of its points
    assert latency_bandwidth(fit_linear([1e3, 1e6], [1e-8, 1e-4]))[0] == 0.0
    lat, bw = latency_bandwidth(fit_linear([1e3, 1e6], [2e-3, 1e-3]))
    assert lat >= 0 and bw == pytest.approx(1e6 / 1e-3)


@pytest.mark.parametrize("xs, ts", [([1.0], [1.0]), ([1.0, 2.0], [1.0, 0.0]), ([1.0, 2.0], [1.0])])
def test_fit_refuses_too_few_or_bad_points(xs, ts):
    with pytest.raises(UsageError, match="fit_linear"):
        fit_linear(xs, ts)


def test_transfers_follow_a_line():
    moves = measure_transfers("cpu", (16 * KiB, 256 * KiB, 2 << 20), repeats=3, counts=(1, 4))
    for way in ("h2d", "d2h"):
        assert [x for x, _ in moves[way]] == [(n, k) for n in (16 * KiB, 256 * KiB, 2 << 20) for k in (1, 4)]
        assert all(t > 0 for _, t in moves[way])
        fit = transfer_fit(moves[way])
        lat, bw = latency_bandwidth(fit)
        assert lat >= 0 and bw > 0
        assert _median_error(fit) < 0.5, (way, moves[way])


def test_cpu_optimizer_has_a_cost_per_call():
    """A step of a pack of one small layer costs far more than its bytes: the fixed cost of the call."""
    fit = measure_cpu_optimizer("sgd", repeats=3, packs=(1, 2, 4), layer_bytes=(4 * KiB, 256 * KiB))
    assert len(fit.points) == 6 and call_cost(fit) > 0
    assert _median_error(fit) < 0.5, fit.points
    smallest = min(t for _, t in fit.points)
    assert call_cost(fit) > 0.2 * smallest
    with pytest.raises(UsageError, match="adam or sgd"):
        measure_cpu_optimizer("lamb")


def test_a_step_on_the_device_has_a_cost_per_call_and_per_tensor():
    """The executor's optimizer step on the device (here the CPU): a pack of small layers costs far
    more than its bytes, and more with more parameters; the terms are what the simulator charges."""
    fit = measure_gpu_optimizer("cpu", repeats=3, packs=(1, 2, 4), layer_bytes=(4 * KiB, 256 * KiB),
                                large=1 << 20)
    assert len(fit.points) == 7
    terms = gpu_step_terms(fit)
    assert terms["gpu_optimizer_bandwidth"] > 0
    assert terms["gpu_optimizer_call_s"] > 0 and terms["gpu_optimizer_tensor_s"] > 0
    smallest = min(t for _, t in fit.points)
    assert terms["gpu_optimizer_call_s"] + 4 * terms["gpu_optimizer_tensor_s"] > 0.3 * smallest
    hw = Hardware("probed", 1, 1 << 30, 1 << 32, 1 << 31, 1e10, 1e10, **terms)
    assert _median_error(fit) < 0.5, fit.points
    for (nbytes, tensors), t in fit.points[:-1]:
        # the simulator's charge, from the bytes it counts (3 W + 2 K, Adam: K = 2 W)
        w = nbytes / 7
        assert hw.gpu_step_time(w, 2 * w, tensors) == pytest.approx(fit.predict(nbytes, tensors))


def test_issue_overhead_and_collective_are_sane():
    assert 0 <= measure_issue_overhead("cpu", repeats=3) < 0.05
    fit = measure_collective((1 << 20, 8 << 20), repeats=2)
    if fit is not None:
        latency, bandwidth = latency_bandwidth(fit)
        assert len(fit.points) == 3 and bandwidth > 1e6 and 0 <= latency < 0.05


def test_a_gloo_send_costs_a_latency_and_bytes_over_a_bandwidth():
    fit = measure_p2p((1 << 20, 8 << 20), repeats=3)
    if fit is None:
        pytest.skip("Gloo is not available")
    latency, bandwidth = latency_bandwidth(fit)
    assert len(fit.points) == 3 and 1e7 < bandwidth < 1e12 and 0 <= latency < 0.01
    assert fit.predict(8 << 20) > fit.predict(4096)


def test_probed_cpu_hardware_has_the_new_terms(tmp_path):
    hw = probe_hardware("cpu", sizes=(16 * KiB, 256 * KiB), repeats=2)
    assert hw.copy_overlap is False
    assert hw.h2d_latency_s >= 0 and hw.d2h_latency_s >= 0 and hw.issue_overhead_s >= 0
    assert hw.cpu_optimizer_call_s > 0
    assert hw.compute_scale == 1.0 and hw.cpu_optimizer_scale == 1.0
    assert hw.collective_bandwidth is None or hw.collective_bandwidth > 0
    # activations between ranks go by Gloo send, the executor's route, not through host memory
    assert hw.p2p_bandwidth > 0 and hw.p2p_latency_s >= 0 and "Gloo send" in hw.description
    assert "per call" in hw.description and "us + bytes /" in hw.description
    assert Hardware.load(hw.save(tmp_path / "hw.toml")) == hw


def test_a_pack_step_is_one_call_plus_its_layers_net_steps():
    """The profiler's cpu_update_s leaves out the fixed cost of a step call, so that a pack's step (one call
    for all its layers, as the executor makes it) is one call plus the layers' figures; the layers'
    whole steps summed count the call once per layer."""
    import time

    import torch

    from harmony_opt.measure.probe import _Weights
    from harmony_opt.measure.profiler import cpu_call_time, cpu_update_time
    from harmony_opt.runtime.optim import PackOptimizers, make_factory

    # layers whose step work (4 x 4096 floats) is of the order of the call's fixed cost (0.5x to 1.6x on
    # the 2-core machines measured): large enough that a whole step measures above the call on a busy
    # machine, small enough that the calls counted once per layer show in the sum
    layers = [_Weights(4, 4096) for _ in range(6)]
    optim = PackOptimizers(layers, [(0, 5)], make_factory("adam", 1e-4))
    for g in optim.grads.values():
        g.fill_(1e-3)
    optim.step_host((0, 5))

    def measure():
        call = cpu_call_time("adam", 9)
        whole = [cpu_update_time(list(layer.parameters()), "adam", repeats=9) for layer in layers]
        runs = []
        for _ in range(25):
            t0 = time.perf_counter()
            optim.step_host((0, 5))
            runs.append(time.perf_counter() - t0)
        return call, whole, statistics.median(runs)

    # the layers' whole steps summed count the call once per layer: (layers - 1) calls too many; at
    # least a quarter of that, whatever the call's share of a step on this machine (a pack's step of six
    # layers runs somewhat slower than one call and their net steps: 65-140 % of the extra calls showed
    # in 5 runs on a 2-core VM). The whole steps and the pack's are timed apart, and the machine's drift
    # between them once left 24 % showing in a CI run: the best of three measures is judged.
    tries = [measure() for _ in range(3)]
    # a call timed in a busy spell can read above a small layer's whole step timed in a quiet one (57 us
    # against 53 us in a CI run): the fastest of each over the three measures is compared, as the
    # profiler takes the fastest call seen over its run
    fastest_call = min(t[0] for t in tries)
    fastest_whole = [min(ws) for ws in zip(*(t[1] for t in tries))]
    assert 0 < fastest_call < min(fastest_whole), tries
    call, whole, pack = max(tries, key=lambda t: (sum(t[1]) - t[2]) / t[0])
    assert sum(whole) - pack > 0.25 * (len(layers) - 1) * call, tries
    # and the pack's step is one call plus the layers' net steps: the fastest of each seen (a busy spell
    # during one measure's whole steps put their net sum at 1.9x the pack's step in a CI run)
    fastest_pack = min(t[2] for t in tries)
    assert fastest_call + sum(w - fastest_call for w in fastest_whole) == pytest.approx(fastest_pack, rel=0.5), tries
    assert torch.isfinite(layers[0].w[0]).all()
