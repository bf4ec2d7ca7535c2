"""Harmony's search (HARMONY_REFERENCE.md 1-2, 6): every candidate microbatch size and packing,
scored by its simulator, the Top-K rule, and the best candidate as a Plan."""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, NamedTuple

import numpy as np

from ..core.bundled import load_profile, profile_ident
from ..core.errors import InfeasibleError, UsageError
from ..core.plan import Plan
from ..core.profile import Profile
from .events import GiB, _sim_settings, _simulate
from .graph import compose_task_graph
from .packing import PACKING_SETS, Packs, candidate_sizes, data_shares, get_packer, packing_methods


class HarmonyCandidate(NamedTuple):
    """One configuration of Harmony's search and its score."""

    u_fwd: int
    packs_fwd: Packs
    u_bwd: int
    packs_bwd: Packs
    method_fwd: str        # "" when the whole model is one BWD pack
    method_bwd: str
    time: float            # simulated (or scored) iteration time; inf on a deadlock
    key: float             # ranking key: time, / 1000 for a one-pack fit unless rank_fit_normally
    memory: int | None     # Harmony's reported memory estimate (None when a custom score is used)


@dataclasses.dataclass(frozen=True)
class HarmonySearchResult:
    """Ranked Top-K candidates of Harmony's search, with what is needed to build a Plan.

    ``search_space`` is the size of the grid the enumeration walks: every (u_bwd, BWD
    method, u_fwd >= u_bwd (any u_fwd with smaller_ufwd), FWD method), valid or not;
    ``configs_evaluated`` counts the valid candidates scored (Harmony's "points").
    """

    candidates: list[HarmonyCandidate]
    configs_evaluated: int
    search_space: int
    search_time_s: float
    profile: dict
    num_layers: int
    batch: int
    gpus: int
    mode: str
    memory_cap: int
    methods: dict
    settings: dict
    events_simulated: int = 0         # by Harmony's simulator (0 when ``score`` judged the candidates)

    @property
    def best(self) -> HarmonyCandidate:
        return self.candidates[0]

    def best_plan(self, rank: int = 0) -> Plan:
        """The ``rank``-th ranked candidate (0 = Top-1) as a Plan of planner "harmony".

        ``prefetch`` keeps the Plan default (True, what Harmony's runtime does); the settings
        the candidate was scored with (prefetch_offload off by default) are in ``stats``.
        """
        if not 0 <= rank < len(self.candidates):
            raise UsageError(f"rank {rank} is out of range; the search kept {len(self.candidates)} candidate(s)")
        c = self.candidates[rank]
        plan = _candidate_plan(c.u_fwd, c.packs_fwd, c.u_bwd, c.packs_bwd, self.batch, self.gpus, self.mode,
                               self.num_layers, self.memory_cap, self.profile)
        return plan.replace(
            simulated_iteration_time_s=c.time, search_time_s=self.search_time_s,
            stats={"configs_evaluated": self.configs_evaluated, "search_space": self.search_space,
                   "method_fwd": c.method_fwd, "method_bwd": c.method_bwd, "rank": rank, "key": c.key,
                   "memory_estimate_bytes": c.memory, "packing_methods": self.methods,
                   "events_simulated": self.events_simulated, **self.settings})


def _candidate_plan(u_fwd, packs_fwd, u_bwd, packs_bwd, batch, gpus, mode, num_layers, memory_cap,
                    profile_info) -> Plan:
    shares = [batch] if mode == "vPP" else data_shares(batch, gpus)
    uneven = any(s % u for s in shares for u in (u_fwd, u_bwd))
    return Plan(planner="harmony", mode=mode, gpus=gpus, batch=batch, microbatch_fwd=u_fwd,
                microbatch_bwd=u_bwd, packs_fwd=packs_fwd, packs_bwd=packs_bwd, num_layers=num_layers,
                allow_uneven=uneven, cost_model="harmony", memory_cap=memory_cap, profile=profile_info)


class _Top:
    """Harmony's Top-K: append until K held, then replace the first worst only if strictly better."""

    def __init__(self, k: int, dedup: bool):
        self.k = k if k > 0 else float("inf")
        self.dedup = dedup
        self.ids: list = []
        self.items: list[HarmonyCandidate] = []
        self.cnt = 0

    def add(self, c: HarmonyCandidate) -> None:
        ident = (c.u_fwd, c.packs_fwd, c.u_bwd, c.packs_bwd) if self.dedup else self.cnt
        if self.cnt < self.k:
            if ident not in self.ids:
                self.ids.append(ident)
                self.items.append(c)
                self.cnt += 1
            return
        keys = [x.key for x in self.items]
        worst = keys.index(max(keys))
        if c.key < keys[worst] and ident not in self.ids:
            del self.ids[worst], self.items[worst]
            self.ids.append(ident)
            self.items.append(c)
            self.cnt += 1

    def ranked(self) -> list[HarmonyCandidate]:
        order = np.argsort([x.key for x in self.items])
        return [self.items[i] for i in order]


def _layer_lists(profile: Profile, phase: str, u: int, n: int):
    """m = M - X, x = X, t of the first n layers at u (1.4)."""
    c = profile.costs(phase, u)
    x = c.input[:n]
    return c.memory[:n] - x, x, c.time[:n]


def harmony_search(profile, batch: int, gpus: int, mode: str, memory_cap,
                   packing_fwd=PACKING_SETS["published"][0], packing_bwd=PACKING_SETS["published"][1],
                   topk: int = 1, rank_fit_normally: bool = False, dedup: bool = False, ubatchsize_step: int = 1,
                   inequal_ubatchsize: bool = False, smaller_ufwd: bool = False,
                   score: Callable[[Plan], float] | None = None,
                   score_many: Callable[[list[Plan]], list[float]] | None = None, **sim_kwargs) -> HarmonySearchResult:
    """Harmony's search (section 4): enumerate sizes x packers, score each, keep the Top-K.

    ``packing_fwd``/``packing_bwd``: method names, a comma list or a set name ("published",
    "defaults"/"all"). ``memory_cap`` in bytes (Harmony's cap times its scale). ``topk=-1``
    keeps every candidate. ``score(plan) -> seconds`` replaces Harmony's simulator (the
    ranking rule stays Harmony's); ``score_many(plans) -> seconds each``, all distinct candidates at
    once (e.g. in other processes). ``sim_kwargs``: bw_swap, bw_p2p, bw_msg, time_del,
    prefetch_offload. Raises InfeasibleError when no candidate is valid.
    """
    t0 = time.perf_counter()
    profile = load_profile(profile)
    sim = _sim_settings(sim_kwargs)
    mode = _check_args(batch, gpus, mode, memory_cap, topk, ubatchsize_step)
    cap = float(memory_cap)
    m_fwd, m_bwd = packing_methods(packing_fwd, "FWD"), packing_methods(packing_bwd, "BWD")
    R = profile.num_layers
    cand_f = candidate_sizes(profile.sizes("FWD"), batch, gpus, mode, ubatchsize_step, inequal_ubatchsize)
    cand_b = candidate_sizes(profile.sizes("BWD"), batch, gpus, mode, ubatchsize_step, inequal_ubatchsize)
    if not cand_f or not cand_b:
        raise InfeasibleError(_no_sizes_message(profile, batch, gpus, mode, cand_f, cand_b, inequal_ubatchsize))
    prof_info = profile_ident(profile)

    candidates: list[tuple] = []
    space = 0
    fwd_cache: dict[tuple, Packs | None] = {}
    for u_bwd in cand_b:
        mb, xb, tb = _layer_lists(profile, "BWD", u_bwd, R)
        ufs = cand_f if smaller_ufwd else cand_f[int(np.searchsorted(cand_f, u_bwd, side="left")):]
        space += len(m_bwd) * len(ufs) * len(m_fwd)
        for mth_b in m_bwd:
            pb = get_packer(mth_b)(mb, xb, tb, cap)
            if pb is None:
                continue
            if len(pb) == 1:
                candidates.append((u_bwd, (), u_bwd, pb, "", mth_b))
                continue
            lf = pb[-2][1] + 1
            for u_fwd in ufs:
                mf, xf, tf = _layer_lists(profile, "FWD", u_fwd, lf)
                for mth_f in m_fwd:
                    if mth_f == "reuse":
                        pf = get_packer(mth_f)(mf, xf, tf, cap, pb[:-1])
                    else:
                        ck = (u_fwd, lf, mth_f)
                        if ck not in fwd_cache:
                            fwd_cache[ck] = get_packer(mth_f)(mf, xf, tf, cap)
                        pf = fwd_cache[ck]
                    if pf is not None:
                        candidates.append((u_fwd, pf, u_bwd, pb, mth_f, mth_b))
    if not candidates:
        raise InfeasibleError(**_infeasible(profile, cand_f, cand_b, cap, m_fwd, m_bwd))

    top = _Top(topk, dedup)
    memo: dict[tuple, tuple[float, int | None]] = {}
    events = 0
    if score is not None or score_many is not None:
        plans = {k: _candidate_plan(*k, batch, gpus, mode, R, int(memory_cap), prof_info)
                 for k in dict.fromkeys(c[:4] for c in candidates)}      # each distinct one, in order
        times = score_many(list(plans.values())) if score_many is not None else map(score, plans.values())
        memo = {k: (float(t), None) for k, t in zip(plans, times)}
    for u_fwd, pf, u_bwd, pb, mth_f, mth_b in candidates:
        ident = (u_fwd, pf, u_bwd, pb)
        if ident not in memo:
            G = compose_task_graph(mode, gpus, batch, R, u_fwd, pf, u_bwd, pb)
            res = _simulate(G, profile, sim, keep_events=False)
            memo[ident] = (res.global_endtime, max(res.per_rank_memory))
            events += res.n_events
        t, mem = memo[ident]
        key = t / 1000.0 if (len(pb) == 1 and not rank_fit_normally) else t
        top.add(HarmonyCandidate(u_fwd, pf, u_bwd, pb, mth_f, mth_b, t, key, mem))
    settings = {**sim, "topk": topk, "rank_fit_normally": rank_fit_normally, "dedup": dedup,
                "ubatchsize_step": ubatchsize_step, "inequal_ubatchsize": inequal_ubatchsize,
                "smaller_ufwd": smaller_ufwd,
                "scored_by": "harmony" if score is None and score_many is None else "custom"}
    return HarmonySearchResult(top.ranked(), len(candidates), space, time.perf_counter() - t0, prof_info, R,
                               batch, gpus, mode, int(memory_cap), {"fwd": list(m_fwd), "bwd": list(m_bwd)},
                               settings, events)


def _check_args(batch, gpus, mode, memory_cap, topk, step) -> str:
    modes = {"vpp": "vPP", "vdp": "vDP"}
    if str(mode).lower() not in modes:
        raise UsageError(f"mode {mode!r} is not vPP or vDP")
    for name, v in (("batch", batch), ("gpus", gpus), ("ubatchsize_step", step)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise UsageError(f"{name} must be a whole number >= 1, got {v!r}")
    if isinstance(topk, bool) or not isinstance(topk, (int, np.integer)) or topk == 0 or topk < -1:
        raise UsageError(f"topk must be >= 1, or -1 to keep every candidate; got {topk!r}")
    if not isinstance(memory_cap, (int, float, np.integer, np.floating)) or not memory_cap > 0:
        raise UsageError(f"memory_cap must be a positive number of bytes, got {memory_cap!r}")
    mode = modes[str(mode).lower()]
    if mode == "vDP" and batch < gpus:
        raise InfeasibleError(f"vDP needs at least one sample per GPU: batch {batch} < {gpus} GPUs; "
                              f"use vPP, fewer GPUs or a larger batch")
    return mode


def _no_sizes_message(profile, batch, gpus, mode, cand_f, cand_b, inequal) -> str:
    dcap = batch if mode == "vPP" else batch // gpus
    phase = "FWD" if not cand_f else "BWD"
    lo, hi = profile.size_range(phase)
    rule = "" if inequal else " that divide every GPU's share of the batch (inequal_ubatchsize allows others)"
    return (f"no {phase} microbatch size to search: {profile.name} is profiled for {phase} sizes {lo}..{hi}, "
            f"and sizes up to {dcap} samples per {'GPU' if mode == 'vDP' else 'iteration'}{rule} are allowed")


def _infeasible(profile, cand_f, cand_b, cap, m_fwd, m_bwd) -> dict:
    """Explain an empty search at the smallest BWD size: the layer that cannot fit, or the methods."""
    u = cand_b[0]
    need = profile.costs("BWD", u).memory
    layer = int(np.argmax(need))
    worst = int(need[layer])
    if worst >= cap:
        where = "is over" if worst > cap else "must be strictly below (Harmony's packing rule)"
        msg = (f"{profile.name}: layer {layer} needs {worst} bytes ({worst / GiB:.2f} GiB) for its backward at "
               f"microbatch {u}, the smallest searched size, which {where} the memory cap of {int(cap)} bytes "
               f"({cap / GiB:.2f} GiB); no packing fits")
        return dict(message=msg, layer=layer, microbatch=u, needed_bytes=worst, cap_bytes=int(cap))
    uf = next((f for f in cand_f if f >= u), cand_f[-1])
    needf = profile.costs("FWD", uf).memory
    lf = int(np.argmax(needf))
    msg = (f"{profile.name}: Harmony's packing methods (FWD {', '.join(m_fwd)}; BWD {', '.join(m_bwd)}) found no "
           f"valid packs under the cap of {int(cap)} bytes ({cap / GiB:.2f} GiB) at any microbatch size, although "
           f"the largest layer alone fits (layer {layer}: {worst} bytes for BWD at microbatch {u}; layer {lf}: "
           f"{int(needf[lf])} bytes for FWD at {uf}); add greedy_reverse_addx, which packs whenever every layer fits")
    return dict(message=msg, layer=layer, microbatch=u, needed_bytes=worst, cap_bytes=int(cap))
