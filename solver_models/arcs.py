"""Candidate packs ("arcs") and their constant costs for one configuration.

A configuration fixes the mode, the number of GPUs and the two microbatch sizes. Then
every candidate pack [i, j] that fits in memory has constant costs (computed with the
Profile's O(1) prefix-sum queries, vectorized over all candidates at once):

* ``compute``: seconds of GPU compute for all the pack's microbatches on one GPU;
* ``h2d`` / ``d2h``: bytes the pack's task moves over the host link (weights,
  activations that go through host memory, stashed inputs, gradients);
* ``task``: the task's time with its transfers overlapped (just-in-time prefetch):
  ``max(compute, h2d / bw_in, d2h / bw_out)``.

Both the CP-SAT model (packing.py) and the exact DP (dp.py) read these arrays, so they
optimize the same objective.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from harmony_opt.hardware import Hardware
from harmony_opt.memory import max_pack_end
from harmony_opt.plan import data_shares, split_microbatches
from harmony_opt.profile import Profile

#: At most this many candidate packs per start layer (the longest that fit): packs are
#: cut where memory forces it; shorter packs only add boundary traffic. Both the CP-SAT
#: model and the DP oracle use the same candidates, so their optima are comparable.
MAX_ARCS_PER_START = 64


@dataclasses.dataclass(frozen=True)
class Config:
    mode: str
    gpus: int
    u_fwd: int
    u_bwd: int

    def __str__(self):
        return f"{self.mode} x{self.gpus} u_fwd={self.u_fwd} u_bwd={self.u_bwd}"


@dataclasses.dataclass
class Arcs:
    """Candidate packs of one phase: parallel arrays indexed by arc."""

    start: np.ndarray
    end: np.ndarray          # inclusive
    compute: np.ndarray      # s
    h2d: np.ndarray          # bytes
    d2h: np.ndarray          # bytes
    task: np.ndarray         # s, max(compute, transfers)
    first_load: np.ndarray   # s: weight load that cannot be hidden (only for packs starting at 0)
    tail: np.ndarray         # s: CPU update that cannot be hidden (bwd packs starting at 0)
    hop: np.ndarray          # s: one microbatch through the pack plus handing its output on (pipeline latency)
    link_in: np.ndarray      # s: h2d bytes / link bandwidth
    link_out: np.ndarray     # s: d2h bytes / link bandwidth

    def __len__(self):
        return len(self.start)


def _enumerate(max_end: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """All [i, j] with lo <= i <= j <= min(max_end[i], hi), the MAX_ARCS_PER_START longest per start."""
    starts, ends = [], []
    for i in range(lo, hi + 1):
        top = min(int(max_end[i]), hi)
        if top < i:
            continue
        first = max(i, top - MAX_ARCS_PER_START + 1)
        js = np.arange(first, top + 1)
        starts.append(np.full(len(js), i))
        ends.append(js)
    if not starts:
        return np.zeros(0, int), np.zeros(0, int)
    return np.concatenate(starts), np.concatenate(ends)


def build_arcs(profile: Profile, hw: Hardware, batch: int, cfg: Config, cap: int):
    """Forward arcs, backward arcs and the criterion arcs (bwd packs [s, R-1])."""
    R = profile.num_layers
    share = batch if cfg.mode == "vPP" else data_shares(batch, cfg.gpus)[0]
    uf_list = split_microbatches(share, cfg.u_fwd)
    ub_list = split_microbatches(share, cfg.u_bwd)
    cf = profile.costs("FWD", cfg.u_fwd)
    cb = profile.costs("BWD", cfg.u_bwd)
    cf_parts = [profile.costs("FWD", u) for u in sorted(set(uf_list))]
    cb_parts = [profile.costs("BWD", u) for u in sorted(set(ub_list))]
    count_f = {u: uf_list.count(u) for u in set(uf_list)}
    count_b = {u: ub_list.count(u) for u in set(ub_list)}
    same_rank = cfg.mode == "vDP" or cfg.gpus == 1
    via_host = same_rank or hw.p2p_bandwidth <= 0
    bw_in, bw_out = hw.h2d_bandwidth, hw.d2h_bandwidth

    def sum_over(parts, counts, fn):
        return sum(counts[c.u] * fn(c) for c in parts)

    # ---- forward arcs over layers 0..R-2 (the criterion pack always holds R-1)
    end_f = max_pack_end(cf, cap)
    fs, fe = _enumerate(end_f, 0, R - 2)
    f_compute = sum_over(cf_parts, count_f, lambda c: c.pack_time(fs, fe))
    f_in = profile.param_bytes(fs, fe) + profile.buffer_bytes(fs, fe)
    f_x = sum_over(cf_parts, count_f, lambda c: c.input[fs])           # input of the pack, per microbatch
    f_y = sum_over(cf_parts, count_f, lambda c: c.input[fe + 1])       # output of the pack
    f_h2d = f_in + np.where((fs == 0) | via_host, f_x, 0)
    f_d2h = np.where(via_host, f_y, 0)
    hand = hw.p2p_bandwidth if (not via_host) else min(bw_in, bw_out) / 2
    link = hw.link_bandwidth or bw_in
    fwd = _arcs(fs, fe, f_compute, f_h2d, f_d2h, bw_in, bw_out, link,
                first_load=np.where(fs == 0, f_in / bw_in, 0.0), tail=np.zeros(len(fs)),
                hop=f_compute / len(uf_list) + cf.input[fe + 1] / hand)

    # ---- backward arcs (not holding the loss): [a, b] with b <= R-2
    end_b = max_pack_end(cb, cap)
    bs, be = _enumerate(end_b, 0, R - 2)
    b_compute = sum_over(cb_parts, count_b, lambda c: c.pack_time(bs, be))
    w = profile.param_bytes(bs, be)
    b_wb = w + profile.buffer_bytes(bs, be)
    stash_in = sum_over(cb_parts, count_b, lambda c: c.input[bs])
    stash_out = sum_over(cf_parts, count_f, lambda c: c.input[bs])     # the forward stashes it
    dy = sum_over(cb_parts, count_b, lambda c: c.input[be + 1])
    dx = np.where(bs > 0, stash_in, 0)
    b_h2d = b_wb + stash_in + np.where(via_host, dy, 0)
    b_d2h = w + stash_out + np.where(via_host, dx, 0)
    upd = profile.cpu_update_time(bs, be) * hw.cpu_optimizer_scale
    if cfg.mode == "vDP" and cfg.gpus > 1:
        upd = upd / cfg.gpus if hw.p2p_bandwidth > 0 else upd
    bwd = _arcs(bs, be, b_compute, b_h2d, b_d2h, bw_in, bw_out, link,
                first_load=np.zeros(len(bs)), tail=np.where(bs == 0, upd, 0.0),
                hop=b_compute / len(ub_list) + cb.input[bs] / hand)

    # ---- criterion arcs [s, R-1]
    ok = np.array([cb.pack_memory(s, R - 1) <= cap for s in range(R)])
    cs = np.flatnonzero(ok)
    ce = np.full(len(cs), R - 1)
    c_compute = sum_over(cb_parts, count_b, lambda c: c.pack_time(cs, ce))
    cw = profile.param_bytes(cs, ce)
    c_x = sum_over(cb_parts, count_b, lambda c: c.input[cs])
    rebatch = cfg.u_fwd != cfg.u_bwd
    c_h2d = cw + profile.buffer_bytes(cs, ce) + np.where((cs == 0) | via_host | rebatch, c_x, 0)
    c_d2h = cw + np.where((cs > 0) & via_host, c_x, 0)
    cupd = profile.cpu_update_time(cs, ce) * hw.cpu_optimizer_scale
    if cfg.mode == "vDP" and cfg.gpus > 1 and hw.p2p_bandwidth > 0:
        cupd = cupd / cfg.gpus
    crit = _arcs(cs, ce, c_compute, c_h2d, c_d2h, bw_in, bw_out, link,
                 first_load=np.where(cs == 0, (cw + profile.buffer_bytes(cs, ce)) / bw_in, 0.0),
                 tail=np.where(cs == 0, cupd, 0.0),
                 hop=c_compute / len(ub_list) + cb.input[cs] / hand)
    return fwd, bwd, crit, (len(uf_list), len(ub_list))


def _arcs(s, e, compute, h2d, d2h, bw_in, bw_out, link, first_load, tail, hop) -> Arcs:
    compute = np.asarray(compute, dtype=np.float64)
    h2d = np.asarray(h2d, dtype=np.float64)
    d2h = np.asarray(d2h, dtype=np.float64)
    task = np.maximum(compute, np.maximum(h2d / bw_in, d2h / bw_out))
    return Arcs(np.asarray(s, int), np.asarray(e, int), compute, h2d, d2h, task,
                np.asarray(first_load, np.float64), np.asarray(tail, np.float64),
                np.asarray(hop, np.float64), h2d / link, d2h / link)
