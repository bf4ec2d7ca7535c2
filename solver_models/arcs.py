"""Candidate packs ("arcs") and their constant costs for one configuration.

A configuration fixes the mode, the number of GPUs and the two microbatch sizes. Then
every candidate pack [i, j] that fits in memory has constant costs (computed with the
Profile's O(1) prefix-sum queries, vectorized over all candidates at once):

* ``compute``: seconds of GPU compute for all the pack's microbatches on one GPU;
* ``h2d`` / ``d2h``: bytes the pack's task moves over the host link (weights,
  activations that go through host memory, stashed inputs, gradients);
* ``task``: the task's time with its transfers overlapped (just-in-time prefetch):
  ``max(compute, h2d / bw_in, d2h / bw_out)``.

Backward and criterion packs come in variants, one arc per per-pack option (Plan's
PackOptions): ``recompute`` (re-run the pack's forward in its backward, Harmony's rule)
or stash (the forward sends the pack's saved activations to host memory, the backward
brings them back and skips the recompute), and the optimizer step on the CPU or on the
GPU (optimizer state comes in, updated weights and state go out, no CPU tail). A stash
variant also costs memory in the forward packs that hold its layers; packing.py couples
the two through per-layer stash indicators (``Phases.saved_fwd``).

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

#: Stash variants are offered up to this many layers: each adds a per-layer memory
#: coupling to the forward packs, and on Harmony's profiles a stash only pays where the
#: host link has room, which models of a few hundred layers (vgg416, resnet1026) never have.
MAX_LAYERS_WITH_STASH = 200


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
    recompute: np.ndarray = None   # bool: backward re-runs the forward (False: stashed activations)
    gpu_opt: np.ndarray = None     # bool: optimizer step on the GPU

    def __post_init__(self):
        n = len(self.start)
        if self.recompute is None:
            self.recompute = np.ones(n, bool)
        if self.gpu_opt is None:
            self.gpu_opt = np.zeros(n, bool)

    def __len__(self):
        return len(self.start)

    def key(self, k: int) -> tuple:
        """(first, last, recompute, gpu optimizer) of arc k: what a plan records of it."""
        return (int(self.start[k]), int(self.end[k]), bool(self.recompute[k]), bool(self.gpu_opt[k]))

    @staticmethod
    def concat(parts: list["Arcs"]) -> "Arcs":
        return Arcs(*(np.concatenate([getattr(p, f.name) for p in parts])
                      for f in dataclasses.fields(Arcs)))


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


@dataclasses.dataclass
class Phases:
    """Everything the packing models read for one configuration."""

    fwd: Arcs
    bwd: Arcs                 # backward packs not holding the loss, all option variants
    crit: Arcs                # criterion packs [s, R-1], optimizer variants
    microbatches: tuple[int, int]   # number of forward and backward microbatches
    fwd_mem: np.ndarray       # bytes: working set of each forward arc at u_fwd (no stash)
    saved_fwd: np.ndarray | None    # bytes per layer a stashed layer adds to its forward pack; None: no stash arcs
    cap: int

    def __iter__(self):       # fwd, bwd, crit, microbatches = phases
        return iter((self.fwd, self.bwd, self.crit, self.microbatches))


def build_arcs(profile: Profile, hw: Hardware, batch: int, cfg: Config, cap: int, *,
               options: bool = True) -> Phases:
    """Forward arcs, backward arcs (with option variants when ``options``) and criterion arcs."""
    R = profile.num_layers
    share = batch if cfg.mode == "vPP" else data_shares(batch, cfg.gpus)[0]
    uf_list = split_microbatches(share, cfg.u_fwd)
    ub_list = split_microbatches(share, cfg.u_bwd)
    cf = profile.costs("FWD", cfg.u_fwd)
    cb = profile.costs("BWD", cfg.u_bwd)
    f_max = profile.size_range("FWD")[1]
    cf_parts = [profile.costs("FWD", u) for u in sorted(set(uf_list))]
    cb_parts = [profile.costs("BWD", u) for u in sorted(set(ub_list))]
    count_f = {u: uf_list.count(u) for u in set(uf_list)}
    count_b = {u: ub_list.count(u) for u in set(ub_list)}
    same_rank = cfg.mode == "vDP" or cfg.gpus == 1
    via_host = same_rank or hw.p2p_bandwidth <= 0
    bw_in, bw_out = hw.h2d_bandwidth, hw.d2h_bandwidth
    replicas = cfg.gpus if cfg.mode == "vDP" and cfg.gpus > 1 and hw.p2p_bandwidth > 0 else 1

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
    fwd_mem = np.asarray(cf.pack_memory(fs, fe), dtype=np.float64)

    # ---- backward arcs (not holding the loss): [a, b] with b <= R-2
    end_b = max_pack_end(cb, cap)
    bs, be = _enumerate(end_b, 0, R - 2)
    b_mem = cb.pack_memory(bs, be)
    w = profile.param_bytes(bs, be)
    k_opt = profile.optimizer_bytes(bs, be)
    b_wb = w + profile.buffer_bytes(bs, be)
    dy = sum_over(cb_parts, count_b, lambda c: c.input[be + 1])
    b_upd = profile.cpu_update_time(bs, be) * hw.cpu_optimizer_scale / replicas
    stash_ok = options and R <= MAX_LAYERS_WITH_STASH
    variants = [(True, False)] + ([(True, True)] if options else []) + \
        ([(False, False), (False, True)] if stash_ok else [])
    # A variant is offered only where it can pay (else it only slows the search):
    # stash where moving a microbatch's saved activations takes less than recomputing them,
    # the GPU step where it removes the CPU tail (layer 0) or outlasts moving the state.
    f_time = sum_over(cb_parts, count_b, lambda c: profile.costs("FWD", min(c.u, f_max)).pack_time(bs, be))
    saved_in = sum_over(cb_parts, count_b, lambda c: c.pack_saved(bs, be))
    stash_pays = saved_in / bw_in < f_time
    gpu_pays = (bs == 0) | (b_upd > (k_opt / bw_in + (w + k_opt) / bw_out))
    parts = []
    for recompute, gpu_opt in variants:
        keep = np.ones(len(bs), bool)
        if gpu_opt:
            keep &= (b_mem + k_opt <= cap) & gpu_pays
        if not recompute:
            keep &= stash_pays
        a, b = bs[keep], be[keep]
        compute = sum_over(cb_parts, count_b, lambda c: c.pack_time(a, b))
        if recompute:
            stash_in = sum_over(cb_parts, count_b, lambda c: c.input[a])
            stash_out = sum_over(cf_parts, count_f, lambda c: c.input[a])     # the forward sends it
        else:   # saved activations instead of the input; the backward skips the recompute
            stash_in = sum_over(cb_parts, count_b, lambda c: c.pack_saved(a, b))
            stash_out = sum_over(cf_parts, count_f, lambda c: c.pack_saved(a, b))
            compute = compute - sum(count_b[c.u] * np.minimum(
                profile.costs("FWD", min(c.u, f_max)).pack_time(a, b), c.pack_time(a, b)) for c in cb_parts)
        dx = np.where(a > 0, sum_over(cb_parts, count_b, lambda c: c.input[a]), 0)
        h2d = b_wb[keep] + stash_in + np.where(via_host, dy[keep], 0)
        grads = w[keep] / replicas
        tail = np.where(a == 0, b_upd[keep], 0.0)
        if gpu_opt:   # state in; updated weights and state out; the step runs on the GPU
            h2d = h2d + k_opt[keep]
            grads = (w[keep] + k_opt[keep]) / replicas
            compute = compute + (3 * w[keep] + 2 * k_opt[keep]) / hw.gpu_optimizer_bandwidth
            tail = np.zeros(len(a))
        d2h = grads + stash_out + np.where(via_host, dx, 0)
        parts.append(_arcs(a, b, compute, h2d, d2h, bw_in, bw_out, link, first_load=np.zeros(len(a)), tail=tail,
                           hop=compute / len(ub_list) + cb.input[a] / hand,
                           recompute=np.full(len(a), recompute), gpu_opt=np.full(len(a), gpu_opt)))
    bwd = Arcs.concat(parts)

    # ---- criterion arcs [s, R-1] (forward and backward in one task: nothing to stash)
    ok = np.array([cb.pack_memory(s, R - 1) <= cap for s in range(R)])
    cs = np.flatnonzero(ok)
    ce = np.full(len(cs), R - 1)
    rebatch = cfg.u_fwd != cfg.u_bwd
    parts = []
    for gpu_opt in ((False, True) if options else (False,)):
        c_mem = cb.pack_memory(cs, ce)
        c_upd = profile.cpu_update_time(cs, ce) * hw.cpu_optimizer_scale / replicas
        c_k, c_w = profile.optimizer_bytes(cs, ce), profile.param_bytes(cs, ce)
        keep = np.ones(len(cs), bool) if not gpu_opt else (
            (c_mem + c_k <= cap) & ((cs == 0) | (c_upd > c_k / bw_in + (c_w + c_k) / bw_out)))
        s_, e_ = cs[keep], ce[keep]
        c_compute = sum_over(cb_parts, count_b, lambda c: c.pack_time(s_, e_))
        cw = profile.param_bytes(s_, e_)
        ck = profile.optimizer_bytes(s_, e_)
        c_wb = cw + profile.buffer_bytes(s_, e_)
        c_x = sum_over(cb_parts, count_b, lambda c: c.input[s_])
        c_h2d = c_wb + np.where((s_ == 0) | via_host | rebatch, c_x, 0)
        grads = cw / replicas
        tail = np.where(s_ == 0, profile.cpu_update_time(s_, e_) * hw.cpu_optimizer_scale / replicas, 0.0)
        if gpu_opt:
            c_h2d = c_h2d + ck
            grads = (cw + ck) / replicas
            c_compute = c_compute + (3 * cw + 2 * ck) / hw.gpu_optimizer_bandwidth
            tail = np.zeros(len(s_))
        c_d2h = grads + np.where((s_ > 0) & via_host, c_x, 0)
        parts.append(_arcs(s_, e_, c_compute, c_h2d, c_d2h, bw_in, bw_out, link,
                           first_load=np.where(s_ == 0, c_wb / bw_in, 0.0), tail=tail,
                           hop=c_compute / len(ub_list) + cb.input[s_] / hand,
                           recompute=np.ones(len(s_), bool), gpu_opt=np.full(len(s_), gpu_opt)))
    crit = Arcs.concat(parts)
    saved = np.asarray(cf.saved, dtype=np.float64) if stash_ok else None
    return Phases(fwd, bwd, crit, (len(uf_list), len(ub_list)), fwd_mem, saved, int(cap))


def _arcs(s, e, compute, h2d, d2h, bw_in, bw_out, link, first_load, tail, hop, recompute=None, gpu_opt=None) -> Arcs:
    compute = np.asarray(compute, dtype=np.float64)
    h2d = np.asarray(h2d, dtype=np.float64)
    d2h = np.asarray(d2h, dtype=np.float64)
    task = np.maximum(compute, np.maximum(h2d / bw_in, d2h / bw_out))
    return Arcs(np.asarray(s, int), np.asarray(e, int), compute, h2d, d2h, task,
                np.asarray(first_load, np.float64), np.asarray(tail, np.float64),
                np.asarray(hop, np.float64), h2d / link, d2h / link, recompute, gpu_opt)
