"""Hardware of several servers (Hardware.servers, network_bandwidth): files, bad inputs, what the
simulator charges (per-server host links and host memory, the network between servers, vDP's
hierarchical all-reduce), and that the lower bounds stay below the simulated plans."""
from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from harmony_opt.cli import main
from harmony_opt.core.errors import HardwareError, InfeasibleError, PlanError
from harmony_opt.core.hardware import (INTER_SERVER_25GBE, INTER_SERVER_100G, PRESETS, Hardware, get_hardware,
                                       multi_server_hardware, two_server_hardware)
from harmony_opt.core.plan import Plan, PackOptions
from harmony_opt.planners.baselines import plan_harmony
from harmony_opt.planners.registry import get_planner
from harmony_opt.sim.bound import lower_bound
from harmony_opt.sim.host_memory import host_memory, host_memory_per_server, require_fits
from harmony_opt.sim.simulator import simulate
from harmony_opt.solver_models.tasks import TICKS_PER_S

from conftest import synthetic_profile

GB = 1e9


def node(gpus_per_server: int, servers: int, network: float = 1 * GB, p2p: float = 4 * GB, **kw) -> Hardware:
    """``servers`` servers of ``gpus_per_server`` GPUs; one transfer per direction at a time on each host link."""
    d = dict(name="test", gpus=gpus_per_server * servers, gpu_memory_bytes=2**31, host_memory_bytes=2**36,
             pinned_memory_bytes=2**35, h2d_bandwidth=2 * GB, d2h_bandwidth=2 * GB, shared_host_link=True,
             link_bandwidth=2 * GB, p2p_bandwidth=p2p, servers=servers, network_bandwidth=network if servers > 1 else 0.0)
    d.update(kw)
    return Hardware(**d)


def vdp_plan(profile, gpus: int, batch: int = 8) -> Plan:
    """Forward [0, 3], backward [0, 3] and [4, 7] (the criterion pack) on every replica."""
    return Plan(planner="test", mode="vDP", gpus=gpus, batch=batch, microbatch_fwd=2, microbatch_bwd=2,
                packs_fwd=[(0, 3)], packs_bwd=[(0, 3), (4, 7)], options=[PackOptions(), PackOptions()], num_layers=8)


# -- files and bad inputs ---------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_multi_server_file_round_trips(tmp_path, suffix):
    hw = multi_server_hardware("1080ti-x4", 4, INTER_SERVER_100G)
    back = Hardware.load(hw.save(tmp_path / f"hw{suffix}"))
    assert back == hw and back.servers == 4 and back.gpus_per_server == 4 and back.server_of(13) == 3
    assert get_hardware("2x1080ti-x4").servers == 2
    assert [(h.servers, h.network_bandwidth) for h in two_server_hardware().values()] == \
        [(1, 0.0), (2, INTER_SERVER_25GBE), (2, INTER_SERVER_100G)]


def test_one_server_file_keeps_its_fields(tmp_path):
    """A one-server file, and the hardware a plan records, are written as before servers existed, and
    read back the same."""
    one = PRESETS["1080ti-x4"]
    path = one.save(tmp_path / "hw.toml")
    assert "servers" not in path.read_text() and "network_bandwidth" not in path.read_text()
    assert Hardware.load(path) == one and Hardware.from_dict(one.to_dict()) == one
    assert {"servers", "network_bandwidth"} <= set(multi_server_hardware("1080ti-x4", 2).to_dict())


@pytest.mark.parametrize("extra,fragment", [
    ("servers = 3\nnetwork_bandwidth = 1e9\n", "gpus (4) must be a multiple of servers (3)"),
    ("servers = 2\n", "2 servers need network_bandwidth"),
    ("servers = 0\n", "servers must be a whole number >= 1"),
    ('servers = 2\nnetwork_bandwidth = "fast"\n', "field network_bandwidth must be a number"),
])
def test_bad_multi_server_files_fail_with_one_line_and_exit_2(tmp_path, capsys, extra, fragment):
    base = PRESETS["1080ti-x4"].save(tmp_path / "base.toml").read_text()
    f = tmp_path / "hw.toml"
    f.write_text(base + extra)
    with pytest.raises(HardwareError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        Hardware.load(f)
    assert main(["check", str(f)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err


def test_plans_for_part_of_the_servers_take_whole_servers():
    hw = multi_server_hardware("1080ti-x4", 4)
    assert hw.with_gpus(8).servers == 2 and hw.with_gpus(3).servers == 1
    with pytest.raises(HardwareError, match="whole servers"):
        hw.with_gpus(6)


# -- the simulator ------------------------------------------------------------------------------------
def test_vdp_all_reduce_across_servers_is_slower_on_a_slower_network():
    profile = synthetic_profile(R=8)
    plan = vdp_plan(profile, 4)
    times, ards = [], []
    for network in (10 * GB, 0.5 * GB):
        tl = simulate(plan, profile, node(2, 2, network=network))
        ard = tl.events[tl.events.kind == "ARD"]
        ards.append(float((ard.end - ard.start).max()))
        times.append(tl.iteration_time)
    assert ards[1] > ards[0] and times[1] > times[0]
    # inside a server at P2P speed, between servers at the network's: 2 (p-1)/p W / p2p + 2 (S-1)/S W / net
    w = int(profile.param_bytes(0, 3))
    assert node(2, 2, network=0.5 * GB).allreduce_time(w, 4) == pytest.approx(w / 4e9 + w / 0.5e9)


@pytest.mark.parametrize("servers,parallel", [(2, True), (1, False)])
def test_host_links_are_shared_only_inside_a_server(servers, parallel):
    """Two vDP replicas start by bringing their weights in: on two servers both at once, on one server
    (one transfer per direction at a time) one after the other."""
    profile = synthetic_profile(R=8)
    hw = node(2 // servers, servers)
    tl = simulate(vdp_plan(profile, 2), profile, hw)
    w = tl.events[tl.events.stream == "swap_in_w"].groupby("rank").first()
    overlap = bool(max(w.start[0], w.start[1]) < min(w.end[0], w.end[1]))
    assert overlap is parallel


def test_host_memory_is_checked_per_server_and_names_the_server():
    profile = synthetic_profile(R=8)
    plan = vdp_plan(profile, 4)
    hw = node(2, 2)
    parts = host_memory_per_server(plan, profile, hw)
    whole = host_memory(plan, profile, hw)
    assert [p.server for p in parts] == [0, 1]
    # every server holds the weights in vDP, each its ranks' half of the gradients and optimizer state
    assert all(p.weights == whole.weights and p.optimizer == pytest.approx(whole.optimizer / 2, abs=1) for p in parts)
    need = max(p.total for p in parts)
    small = dataclasses.replace(hw, host_memory_bytes=need - 1, pinned_memory_bytes=need - 1)
    assert need - 1 < whole.total    # one server of the whole's size would refuse too; the message names which
    with pytest.raises(InfeasibleError, match="of server [01] of hardware test"):
        require_fits(plan, profile, small, "the plan")


def test_vpp_pack_read_on_two_servers_has_a_host_copy_on_each():
    """vPP on three one-GPU servers, round-robin: F[0-3] on server 0, B[4-7] on 1, B[0-3] on 2."""
    profile = synthetic_profile(R=8)
    plan = Plan(planner="test", mode="vPP", gpus=3, batch=4, microbatch_fwd=2, microbatch_bwd=2, packs_fwd=[(0, 3)],
                packs_bwd=[(0, 3), (4, 7)], options=[PackOptions(), PackOptions()], num_layers=8)
    hw = node(1, 3)
    parts = host_memory_per_server(plan, profile, hw)
    w03 = int(profile.param_bytes(0, 3))
    assert [p.weights for p in parts] == [w03, int(profile.param_bytes(4, 7)), w03]
    assert [p.optimizer for p in parts] == [0, int(profile.optimizer_bytes(4, 7)), int(profile.optimizer_bytes(0, 3))]
    tl = simulate(plan, profile, hw)
    # the updated weights of [0, 3] go from server 2 to server 0 over the network, within the iteration
    copies = tl.events[(tl.events.stream == "net") & (tl.events.kind == "W")]
    assert copies.bytes.sum() == w03 and tl.meta["network_bytes"] >= w03


def test_one_server_of_a_multi_server_hardware_plays_as_one_server():
    """A plan on the GPUs of the first server alone is simulated exactly as on that server."""
    profile = synthetic_profile(R=8)
    one = node(2, 1)
    for plan in (vdp_plan(profile, 2), plan_harmony(profile, one, 8, one.gpu_memory_bytes, mode="vPP", gpus=2)):
        a = simulate(plan, profile, one)
        b = simulate(plan, profile, node(2, 3, network=0.1 * GB))
        assert a.iteration_time == b.iteration_time and a.bytes_moved() == b.bytes_moved()


def test_multi_server_vdp_without_p2p_inside_servers_is_refused():
    profile = synthetic_profile(R=8)
    with pytest.raises(PlanError, match="use vPP"):
        simulate(vdp_plan(profile, 4), profile, node(2, 2, p2p=0.0))


# -- bounds ---------------------------------------------------------------------------------------
# no shrinking: each example plans (a failing one would shrink for minutes)
@settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow],
          phases=(Phase.explicit, Phase.reuse, Phase.generate))
@given(st.integers(0, 10**6), st.sampled_from([(1, 2), (2, 2), (1, 4)]), st.sampled_from([0.2, 1.0, 20.0]),
       st.sampled_from([0.0, 4.0]), st.sampled_from([4, 8]), st.sampled_from([0.2, 2.0]))
def test_bounds_stay_below_simulated_plans_on_several_servers(seed, shape, network, p2p, batch, link):
    """On several servers: the lower bound over all plans (harmony_opt.sim.bound) is at most the simulated
    time of the planner's and Harmony's plans, and the planner's bounds on its model (solver_models.bounds,
    the DP's, CP-SAT's) at most the model's value of its plan."""
    per, servers = shape
    profile = synthetic_profile(R=12, seed=seed % 1000, act_scale=1 + seed % 3)
    # a cap of about the largest layer's: the weights do not fit in the GPUs together, so they cross
    # the host links every iteration (the bound's link terms)
    single = max(int(profile.costs(ph, int(profile.sizes(ph)[-1])).memory.max()) for ph in ("FWD", "BWD"))
    hw = node(per, servers, network=network * GB, p2p=p2p * GB, gpu_memory_bytes=int(1.3 * single),
              h2d_bandwidth=link * GB, d2h_bandwidth=link * GB, link_bandwidth=link * GB)
    cap = hw.gpu_memory_bytes
    bound = lower_bound(profile, hw, batch, cap)["bound_s"]
    plans = []
    for mode in ("vPP", "vDP"):
        try:
            plans.append(plan_harmony(profile, hw, batch, cap, mode=mode, gpus=hw.gpus))
        except (InfeasibleError, PlanError):
            pass
    p = get_planner("cp-sat")(profile, hw, batch, cap, mode="auto", time_limit=0.5, processes=1)
    plans.append(p)
    s, tol = p.solver, (2 * profile.num_layers + 1) / TICKS_PER_S     # the model's ticks, at most one per task
    assert s["lower_bound_s"] <= p.simulated_iteration_time_s * (1 + 1e-9)
    if s["configuration"] is not None and s["configuration"]["bound"] is not None:
        assert s["configuration"]["bound"] <= s["configuration"]["objective"] + tol
    if s["bound"] is not None and s["objective"] is not None:
        assert s["bound"] <= s["objective"] + tol
    for q in plans:
        assert bound <= simulate(q, profile, hw, with_timeline=False).iteration_time * (1 + 1e-9)
