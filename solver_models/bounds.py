"""Valid lower bounds on the planner's model of the iteration time, per configuration.

``compute_floor`` (cheap, orders every configuration), ``config_bound`` (compute, host link and, in
vPP, the criterion pack's serial path) and ``pipeline_path_bound`` (vPP: the serial path through the
largest pack, per start of the criterion pack). Each is at most the model's optimum of its
configuration; tests/test_bounds.py checks that against the exact optimum on random profiles.

Each takes the profile as measured and times its kernels at the hardware's ``compute_scale``, as
build_tasks does; the other execution terms (latencies, issue overhead, per-call costs, transfers
without copy/compute overlap) only lengthen the model's columns, so bounds without them hold."""
from __future__ import annotations

import collections
import heapq
import math
from typing import NamedTuple

import numpy as np

from harmony_opt.core.hardware import Hardware
from harmony_opt.core.memory import max_pack_end
from harmony_opt.core.plan import data_shares, split_microbatches
from harmony_opt.core.profile import Profile

from .tasks import Config, boundary_hops, link_capacity, link_rates, stash_out_exposed, stashable_layers


def config_bound(profile: Profile, hw: Hardware, batch: int, cfg: Config, cap: int, stash: bool,
                 stash_layers: np.ndarray | None = None, per_start: bool = False):
    """A valid lower bound on the model's iteration time of any plan of ``cfg`` (seconds), with stash
    variants (``stash``) for the layers build_tasks offers them (``stash_layers``, the same default).

    Every plan has a criterion pack [s, R-1] (one that fits); for each such s, and the least
    over s is taken:

    * ``T >= one``: the first microbatch passes every task in turn (what a pipeline of few
      microbatches cannot hide). In vPP, more: it is handed from task to task (``_pipeline_hops``)
      and the last task runs its other microbatches after it; and the first microbatch's trip
      through the forward layers before s, every microbatch of the criterion pack, the last
      microbatch's trip back, handed on the same way: the criterion pack is
      one serial piece of work; and the forward compute per GPU, then the last microbatch's trip
      back from the criterion pack on (``_after_forward``); and the first microbatch's trip to the
      criterion pack, then the work from its start on (``_from_criterion``). Where stash may
      replace a layer's recompute, these paths count the lesser of its recompute and a mix of
      what a stashed layer costs (``_backward_timer``), with two mixes tried.
    * ``T >= C / ranks`` (compute per GPU) and ``T >= L`` (bytes into the GPUs over the shared
      host link), so ``T >= mu * C / ranks + (1 - mu) * L`` for every mu in [0, 1]. C counts
      every layer's backward on every microbatch and the forward of the layers before s; L the
      weights that must come in (every backward pack's and those forward layers', from every
      replica). Where stash may replace a layer's recompute, its microbatch takes
      max(backward without recompute, saved activations / link) (tasks.py) >= lam * first +
      (1 - lam) * second, its pack carries what the forward compute does not hide of their
      way out (tasks.py), and they cross the link: with mu and lam fixed the bound is a sum over
      layers of the cheaper choice, and the best (mu, lam) of a small grid is taken.
    * In vPP the compute per GPU rises by what the GPUs wait at the pipeline's two ends
      (``_pipeline_ends``), except for the plans whose backward runs in at most N - 2 tasks.

    Small criterion packs leave much forward compute; large ones a long serial piece: taking
    the least over s of the larger of the two is what makes the bound of a vPP configuration
    with few microbatches worth having. ``per_start``: (the criterion starts s, the bound of the
    plans of each) instead of the least (``vpp_bound`` combines them with other bounds per s)."""
    R = profile.num_layers
    profile = profile.with_compute_scale(hw.compute_scale)
    share = batch if cfg.mode == "vPP" else max(data_shares(batch, cfg.gpus))
    cb = profile.costs("BWD", cfg.u_bwd)
    fits = np.flatnonzero(cb.pack_memory(np.arange(R), np.full(R, R - 1)) <= cap)
    if len(fits) == 0:
        return (fits, np.zeros(0)) if per_start else float("inf")
    before = fits - 1                   # the layers before each criterion start: [0, s - 1]
    uf, ub = split_microbatches(share, cfg.u_fwd), split_microbatches(share, cfg.u_bwd)
    # the layers whose stash variants exist (tasks.stashable_layers); elsewhere only the recompute
    ok = np.zeros(R, bool) if not stash else stashable_layers(profile, hw, cfg, uf, ub) if stash_layers is None \
        else np.asarray(stash_layers, bool)
    stash = bool(ok.any())
    copies = cfg.gpus if cfg.mode == "vDP" else 1
    # seconds per byte over the host link, all copies' traffic counted (tasks.Tasks.ticks)
    link_in, link_out = link_capacity(hw, cfg.gpus)
    per_in, per_out = copies / link_in, copies / link_out
    bwd, no_rec, moved, saved = _backward_work(profile, hw, cfg, ub)
    # per criterion start s in ``fits``: the forward compute and the weights of the layers before it
    forward = _forward_before(profile, uf, fits)
    w_all = profile.param_bytes(0, R - 1) + profile.buffer_bytes(0, R - 1)
    w_before = profile.param_bytes(0, before) + profile.buffer_bytes(0, before)
    w_in = (w_all + w_before) * per_in
    n = cfg.ranks
    _, bw_in, bw_out, _ = link_rates(hw, cfg)
    if not hw.copy_overlap:     # tasks.py: a stashed layer's activations move at full bandwidth on the rank
        bw_in, bw_out = hw.h2d_bandwidth, hw.d2h_bandwidth
    # a stashed layer's pack also carries what the forward compute does not hide of its
    # activations leaving (tasks.py: the same per-layer sum over the forward microbatches)
    exposed = stash_out_exposed(profile, uf, bw_out)
    fwd_first = profile.costs("FWD", uf[0]).pack_time(0, before)
    # stashed layers in the serial paths: at least their backward without the forward (lam = 1),
    # or at least their saved activations coming in (lam = 0), whichever bounds higher
    timers = [_backward_timer(profile, lam, bw_in, ok) for lam in ((1.0, 0.0) if stash else (None,))]
    if n > 1:
        fwd_hops, back_hops, back_rests = _pipeline_hops(profile, hw, cfg, uf, ub, cap, fits, timers)
        last = _last_step(profile, hw, bw_out)
        end_b = max_pack_end(cb, cap)
        # every microbatch of the criterion pack [s, R-1]
        crit = sum(k * profile.costs("BWD", u).pack_time(fits, np.full(len(fits), R - 1))
                   for u, k in collections.Counter(ub).items())
        after = _after_forward(profile, hw, cfg, uf, ub, fits, forward, back_hops, last)
        # from the criterion pack's start on (at least the forward's first-microbatch path)
        links = (saved * per_in, [lam * no_rec + (1 - lam) * moved + exposed for lam in (0.0, 0.5, 1.0)], ok) \
            if stash else None
        from_crit = fwd_first + fwd_hops + _from_criterion(profile, cfg, ub, fits, end_b, bwd, links,
                                                          w_before * per_in, crit, last)

    def serial(k):
        """(the serial paths, the pipeline ends, the few-backward-packs bound) with ``timers[k]``."""
        bt = timers[k]
        if n == 1:      # every microbatch passes every task in turn: the first one its forward and backward
            return bt(ub[0], 0, R - 1) + fwd_first, np.zeros(len(fits)), np.full(len(fits), np.inf)
        # in a pipeline a backward pack's recompute runs while its dY is on the way: on the handoffs'
        # chains each backward pack counts its backward without it (``_chain_timer``); the first
        # microbatch through the forward, the criterion pack and back, the last pack's other microbatches
        ct = _chain_timer(profile, bt)
        one = fwd_first + bt(ub[0], fits, np.full(len(fits), R - 1)) + ct(ub[0], 0, fits - 1)
        # the criterion pack's path: the first microbatch's trip through the forward layers before s,
        # every microbatch of the criterion pack, the last microbatch's trip back (in timing.py's
        # recurrence the S chain up to the criterion task, its load, the E chain after it); a pack's
        # compute is the sum of its layers', so this holds for every packing of the other layers
        path = fwd_first + crit + ct(ub[-1], 0, fits - 1) + fwd_hops + back_hops
        one = np.maximum.reduce([one + fwd_hops + back_rests[k], path, after + ct(ub[-1], 0, fits - 1), from_crit])
        return (one, *_pipeline_ends(profile, hw, cfg, uf, ub, cap, fits, bt, last))
    if not stash:
        one, ends, few = serial(0)
        base = np.maximum(w_in, one)
        spans = (float(bwd.sum()) + forward) / n
        per = np.maximum(base, np.maximum(spans, np.minimum(spans + ends / n, few)))
        return (fits, per) if per_start else float(np.min(per))
    # the link: every phase takes at least its own traffic (timing.py), so T >= in_F + in_B (the
    # weights of the forward layers and of every layer, stashed activations coming back) and
    # T >= out_F + in_B (stashed activations leaving in the forward, the backward packs' weights,
    # the stashed activations coming back): either may be the link term. The criterion pack's
    # weights come in during the forward phase (timing.py: it ends the phase), so in_B holds only
    # those of the layers before it: with every layer's it counted them twice where out_F is the
    # forward's link term (a last layer of large buffers: 13.6 ms over a plan of 10.5 ms)
    back = saved * per_in
    out = sum(profile.costs("FWD", u).saved for u in uf) * per_out
    best, totals = np.zeros(len(fits)), []
    rec = bwd / n
    for link_s, link_w in ((back, w_in), (back + out, w_before * per_in)):
        for lam in (0.0, 0.25, 0.5, 0.75, 1.0):
            st = (lam * no_rec + (1 - lam) * moved + exposed) / n
            # the bound is concave and piecewise linear in mu: its maximum is at a layer's breakpoint
            # (where recompute and stash cost the same) or an end of [0, 1]
            with np.errstate(divide="ignore", invalid="ignore"):
                knees = np.where(rec - st + link_s > 0, link_s / (rec - st + link_s), 0.0)
            mus = np.clip(np.concatenate([[0.0, 1.0], knees]), 0.0, 1.0)[:, None]
            per_layer = np.where(ok, np.minimum(mus * rec, mus * st + (1 - mus) * link_s), mus * rec).sum(axis=1)
            total = per_layer[:, None] + mus * forward[None, :] / n + (1 - mus) * link_w[None, :]
            best = np.maximum(best, total.max(axis=0))
            totals.append((total, mus))
    per = np.zeros(len(fits))
    for k in range(len(timers)):
        one, ends, few = serial(k)
        with np.errstate(invalid="ignore"):     # a start no packing reaches: its ends are inf, weighed 0 at mu = 0
            best_ends = np.max([(total + np.where(mus > 0, mus * ends[None, :], 0.0) / n).max(axis=0)
                                for total, mus in totals], axis=0)
        per = np.maximum(per, np.maximum.reduce([best, np.broadcast_to(one, best.shape), np.minimum(best_ends, few)]))
    return (fits, per) if per_start else float(np.min(per))


def _backward_work(profile: Profile, hw: Hardware, cfg: Config, ub: list[int]):
    """Per layer, summed over the backward microbatches ``ub``: (backward with its recompute, without
    it, the time its saved activations take to come in over the link, their bytes).

    Without the recompute: ``Profile.stashed_backward``, as measured on the stash path, or else the
    backward less the forward, negative where a layer's backward took less than its forward (a CPU
    profile's tiny or noisy layers). A stashed pack costs the sum over its layers clipped at 0 as a
    whole (tasks.py; plus what its forward costs beyond the plain one, which only adds), at least the
    sum of its layers' values but less than the sum of each clipped at 0 where the pack holds layers
    of both signs: that sum put the bound above the best plan, on one GPU as on several
    (tests/test_bounds.py)."""
    R = profile.num_layers
    # a vDP transfer waits for the server's other replicas (tasks.py), but on the rank's one engine at full
    # bandwidth without copy/compute overlap
    wait = link_rates(hw, cfg)[0] if hw.copy_overlap else 1
    bwd, no_rec, moved, saved = np.zeros(R), np.zeros(R), np.zeros(R), np.zeros(R)
    for u, k in collections.Counter(ub).items():        # at most two sizes (split_microbatches)
        c = profile.costs("BWD", u)
        bwd += k * c.time
        no_rec += k * profile.stashed_backward(u)
        moved += k * c.saved * wait / hw.h2d_bandwidth
        saved += k * c.saved
    return bwd, no_rec, moved, saved


def compute_floor(profile: Profile, hw: Hardware, batch: int, cfg: Config, cap: int, stash: bool) -> float:
    """At most config_bound (same arguments), ten times cheaper or more: the backward work per GPU,
    every layer on every microbatch (a layer with a stash variant at least the least of its
    recompute, its backward without it and its saved activations' way in, each of which
    config_bound's mixes count at least), and the forward before the largest criterion pack that
    fits; inf where no criterion pack fits, as config_bound. On the Table 1 profiles it is within
    1 % of the bound for most configurations, so most are pruned without their bound. Rounded
    down by a billionth: where the two are equal, their float sums may differ in the last bit, and a
    floor above the bound would let in_bound_order visit tied configurations out of order."""
    R = profile.num_layers
    profile = profile.with_compute_scale(hw.compute_scale)
    fits = np.flatnonzero(profile.costs("BWD", cfg.u_bwd).pack_memory(np.arange(R), np.full(R, R - 1)) <= cap)
    if len(fits) == 0:
        return float("inf")
    share = batch if cfg.mode == "vPP" else max(data_shares(batch, cfg.gpus))
    uf, ub = split_microbatches(share, cfg.u_fwd), split_microbatches(share, cfg.u_bwd)
    ok = stash and stashable_layers(profile, hw, cfg, uf, ub)
    bwd, no_rec, moved, _ = _backward_work(profile, hw, cfg, ub)
    # each term of a stashed layer at most its saved activations' way in, which its pack's microbatches
    # take at least (tasks.py), whatever the sign of the layers' backward less forward
    work = float(np.where(ok, np.minimum.reduce([bwd, np.maximum(no_rec, 0.0), moved]), bwd).sum())
    # and the forward of the layers before the largest criterion pack that fits: config_bound's
    # compute counts the forward before each start it weighs, which is least at the first
    work += float(_forward_before(profile, uf, fits[:1])[0])
    return work / cfg.ranks * (1 - 1e-9)


def in_bound_order(configs: list[Config], floor: dict, bound, first: Config | None = None,
                   prune=lambda value: False):
    """``(configuration, bound(configuration))`` in the order of (bound, name), ``first`` first,
    computing ``bound`` only for the configurations reached: each waits in the queue at its
    ``floor`` (a lower bound on ``bound``) until it is the least, then at its bound. Where the
    caller stops once the bound reaches its best plan, most are never computed; where it says
    that it stops at the least floor left (``prune(floor)``), that floor comes instead of the bound,
    and no bound is computed for it."""
    if first is not None and first in floor:
        b = bound(first)
        if np.isfinite(b):
            yield first, b
    heap = [(floor[c], str(c), False, c) for c in configs if c != first]
    heapq.heapify(heap)
    while heap:
        key, name, exact, c = heapq.heappop(heap)
        if exact or prune(key):
            yield c, key
        else:
            heapq.heappush(heap, (bound(c), name, True, c))


def _pipeline_hops(profile: Profile, hw: Hardware, cfg: Config, uf: list[int], ub: list[int], cap: int,
                   fits: np.ndarray, timers: list) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """vPP, per criterion start s in ``fits``, the least over every packing of [0, s - 1] into packs
    that fit of: the handoffs into the forward packs and into the criterion pack; the handoffs into
    the backward packs; the same plus the other microbatches of the last backward pack (the one
    holding layer 0), timed by each of ``timers`` (``_backward_timer``). In timing.py's recurrence a
    task's first microbatch starts after the previous task's, plus the handoff into it (``S_j >=
    S_{j-1} + p_first_{j-1} + hop_j``), its last one after the previous task's last, plus the
    handoff (``E_j``), and the last task ends after all its microbatches; so these add to the first
    and the last microbatch's trips. Shortest paths over the layer boundaries, every boundary a
    candidate (the planner's candidates are a subset)."""
    hf, hc, hb = boundary_hops(profile, hw, cfg, uf, ub)
    R = profile.num_layers
    zero = np.zeros(R)
    fwd = _least_packing(max_pack_end(profile.costs("FWD", cfg.u_fwd), cap), hf, zero, zero)
    end_b = max_pack_end(profile.costs("BWD", cfg.u_bwd), cap)
    back = _least_packing(end_b, zero, hb, zero)
    # the last backward pack [0, b - 1]: its microbatches after the first
    sizes = collections.Counter(ub[1:]).items()
    rests = [sum((k * bt(u, 0, np.arange(R) - 1) for u, k in sizes), zero) for bt in timers]
    return fwd[fits] + hc[fits], back[fits], [_least_packing(end_b, zero, hb, rest)[fits] for rest in rests]


def _after_forward(profile: Profile, hw: Hardware, cfg: Config, uf: list[int], ub: list[int], fits: np.ndarray,
                   forward: np.ndarray, back_hops: np.ndarray, last: float) -> np.ndarray:
    """vPP, per criterion start s in ``fits``: the forward compute per GPU, then the last
    microbatch's trip back but its backward compute through the layers before s (which the caller
    adds, as the stash variants may shorten it). In timing.py's recurrence every forward task runs
    on its GPU between 0 and its end, the tasks of one GPU one after another, and the ends rise
    along the chain, so the last forward task ends no earlier than the forward compute / N; then
    the E chain: the criterion pack's last microbatch and every backward pack's, each after its
    handoff, and the last pack's gradients leave and step (as in ``_pipeline_ends``). ``forward``:
    the forward compute of the layers before s; ``back_hops`` from ``_pipeline_hops``; ``last``:
    ``_last_step``."""
    R, n = profile.num_layers, cfg.ranks
    _, hc, _ = boundary_hops(profile, hw, cfg, uf, ub)
    crit_last = profile.costs("BWD", ub[-1]).pack_time(fits, np.full(len(fits), R - 1))
    return forward / n + hc[fits] + crit_last + back_hops + last


def _from_criterion(profile: Profile, cfg: Config, ub: list[int], fits: np.ndarray, end_b: np.ndarray,
                    bwd: np.ndarray, links, weights_in: np.ndarray, crit: np.ndarray, last: float) -> np.ndarray:
    """vPP, per criterion start s in ``fits``: at least the time from the criterion pack's start to
    the end. In timing.py's recurrence every backward task starts after the criterion pack's first
    microbatch less its own first recompute (which runs while dY is on the way), the tasks of one
    GPU one after another, the criterion pack's GPU runs its backward tasks after it, and the last
    task's gradients leave and step after its end; so N x (T - S_crit) >= the criterion pack's
    compute + (N - 1) x its first microbatch + every backward compute + ``_last_step``, less what
    the other GPUs' first backward packs recompute early (``_hidden_recompute``): ``work``. And the
    backward phase takes at least its traffic (timing.py) after the criterion pack ends: T - S_crit
    >= the criterion pack's compute + the weights of the layers before s + the stashed activations
    coming back (``link``). So T - S_crit >= mu work + (1 - mu) link for every mu in [0, 1], a sum
    over the layers before s where each takes the cheaper of recompute and stash. ``links``: None
    without stash variants, else (each layer's stashed activations over the link, the stashed
    layer's compute at a few mixes (``config_bound``), the layers that have stash variants);
    ``crit``: the criterion pack's compute, every microbatch; ``end_b``: max_pack_end of the
    backward."""
    R, n = profile.num_layers, cfg.ranks
    fixed = crit + (n - 1) * profile.costs("BWD", ub[0]).pack_time(fits, np.full(len(fits), R - 1)) + last \
        - _hidden_recompute(profile, ub, end_b, fits, n - 1)
    cum = np.concatenate([[0.0], np.cumsum(bwd)])[fits]
    work = (fixed + cum) / n
    if links is None:
        return work
    back, stashed, ok = links
    best = np.zeros(len(fits))
    for st in stashed:
        for mu in (0.0, 0.25, 0.5, 0.75, 1.0):
            per = np.where(ok, np.minimum(mu * bwd / n, mu * st / n + (1 - mu) * back), mu * bwd / n)
            cum = np.concatenate([[0.0], np.cumsum(per)])[fits]
            best = np.maximum(best, mu * fixed / n + (1 - mu) * (crit + weights_in) + cum)
    return best


def _pipeline_ends(profile: Profile, hw: Hardware, cfg: Config, uf: list[int], ub: list[int], cap: int,
                   fits: np.ndarray, bt, last: float) -> tuple[np.ndarray, np.ndarray]:
    """vPP, per criterion start s in ``fits``: (what every GPU waits before its first task and after
    its last one, summed over the GPUs; a bound for the plans where that sum does not hold).

    In timing.py's recurrence the task at position j runs on GPU j mod n after the task n positions
    earlier, so GPU g is busy from its first start S_g to its last end, and ``n T >= compute +
    sum_g S_g + sum_g (T - last end on g)``. GPU g starts after the first microbatch of each task
    before it, plus the handoffs (``S_g >= S_{g-1} + p_first + hop``); the last n - 1 tasks' last
    microbatches come after the last task on the other GPUs (``E_j >= E_{j-1} + hop + p_last``),
    and the last task's gradients leave and step after that (``tail + upd``). Which packs sit at
    those positions is open, so the least over packings is taken: one layer per pack, each pack
    starting past the one before (a forward pack at position i starts at layer >= i). Where the
    first n positions cannot all be forward packs (fewer forward packs cover [0, s - 1]), the
    criterion pack and backward packs may sit there; a backward pack there starts its first
    microbatch's recompute before its dY is in, which ``_hidden_recompute`` takes off. The last
    n - 1 positions are backward packs unless at most n - 2 tasks do the whole backward, on as
    many GPUs: for those plans the second array, that backward compute per GPU (inf where no packs
    that fit are so few). ``last``: ``_last_step``."""
    R, n = profile.num_layers, cfg.ranks
    _, bw_in, _, _ = link_rates(hw, cfg)
    hf, _, _ = boundary_hops(profile, hw, cfg, uf, ub)
    layers = np.arange(R)
    f1 = profile.costs("FWD", uf[0]).time
    ct = _chain_timer(profile, bt)          # a backward pack's microbatch on the handoffs' chains
    b1 = ct(ub[0], layers, layers)
    bl = ct(ub[-1], layers, layers)

    # heads: positions 0 .. n - 1, a forward pack at i starting at layer a weighs (n-1-i) p_first
    # + (n-i) hop (every later GPU waits for it); S_0 >= its hop and its weights, n times
    w0 = (profile.param_bytes(0, 0) + profile.buffer_bytes(0, 0)) / bw_in
    run = np.full(R, np.inf)
    run[0] = (n - 1) * f1[0] + n * max(float(hf[0]), float(w0))
    heads_f = [float(run[0])]           # heads_f[k]: forward packs at positions 0 .. k
    for i in range(1, n):
        run = _least_before(run) + (n - 1 - i) * f1 + (n - i) * hf
        run[R - 1:] = np.inf            # forward packs end before the criterion layer
        heads_f.append(float(run.min()))
    # forward packs at positions 0 .. k - 1, the criterion pack at k, backward packs after it
    crit_first = profile.costs("BWD", ub[0]).pack_time(fits, np.full(len(fits), R - 1))
    b1_min = float(b1[1:].min()) if R > 1 else 0.0
    fewest_f = _fewest_packs(max_pack_end(profile.costs("FWD", cfg.u_fwd), cap))[fits]
    heads = np.full(len(fits), heads_f[n - 1])
    end_b = max_pack_end(profile.costs("BWD", cfg.u_bwd), cap)
    for k in range(1, n):
        after = sum((n - 1 - i) * b1_min for i in range(k + 1, n))
        # the GPUs after the criterion pack's recompute their first pack's first microbatch before its dY
        alt = heads_f[k - 1] + (n - 1 - k) * crit_first + after - _hidden_recompute(profile, ub, end_b, fits, n - 1 - k)
        heads = np.where(fewest_f <= k, np.minimum(heads, alt), heads)

    # tails: the backward task at position J-1-m (m < n-1) starts at layer a_m, a_0 = 0 < a_1 < ...
    run = np.full(R, np.inf)
    run[0] = (n - 1) * bl[0]
    for m in range(1, n - 1):
        run = _least_before(run) + (n - 1 - m) * bl
    tails = float(run.min()) + n * last

    ends = np.where(fits > 0, heads + tails, 0.0)         # s = 0: one task, its serial path bounds it
    few = np.full(len(fits), np.inf)
    if n > 2:
        fewest_b = 1 + _fewest_packs(max_pack_end(profile.costs("BWD", cfg.u_bwd), cap))[fits]
        backward = sum(bt(u, 0, R - 1) for u in ub)
        few = np.where(fewest_b <= n - 2, backward / (n - 2), np.inf)
    return ends, few


def pipeline_path_bound(profile: Profile, hw: Hardware, batch: int, cfg: Config, cap: int, stash: bool,
                        stash_layers: np.ndarray | None = None, upto: float = math.inf, ratio: float = 1.03,
                        per_start: bool = False):
    """A lower bound on the model's iteration time of every plan of a vPP configuration (seconds; 0
    on one GPU or in vDP), tighter than ``config_bound`` where a pipeline has few
    microbatches: there a plan's largest pack and its number of handoffs set the time.

    In timing.py's recurrence, for every task k of the chain, the first microbatch runs through
    the tasks before k (``S_j >= S_{j-1} + p_first_{j-1} + hop_j``), k runs all its microbatches,
    and the last microbatch then runs through the tasks after it (``E_j >= E_{j-1} + hop_j +
    p_last_j``): T >= sum_j min(p_first_j, p_last_j) + (load_k - min(p_first_k, p_last_k)) + every
    hop + the last step. The first sum is one microbatch through every layer, the same for every
    packing; the second grows with the largest pack, the hops with the number of packs. Per
    threshold L of a geometric grid (``ratio``, up to where the bound passes ``upto``), the
    packings whose largest pack (but the criterion pack, counted apart) is at most L have at
    least the least hops of packings under L (shortest paths over the layer boundaries, every
    boundary a candidate), and those above the previous threshold a largest pack above it
    (resnet1026 D=64 vPP x4 u=16/16: 3.58 -> 3.7 s; the best plan found 3.75 s). Per criterion
    start, the larger of that and each GPU's path through its whole forward work
    (``_per_gpu_paths``).

    Where stash variants are offered, a layer's backward microbatch counts the lesser of its
    recompute and a mix of what a stashed layer costs (``_backward_timer``: a stashed pack's
    microbatch is not a sum over its layers, but at least that sum for every mix), the larger of
    the bounds of two mixes taken per criterion start. ``per_start``: (the criterion starts, the
    bound per start) instead of the least, as ``config_bound``."""
    if cfg.mode != "vPP" or cfg.ranks < 2:
        return 0.0
    p = _pipeline(profile, hw, batch, cfg, cap, stash, stash_layers)
    if len(p.fits) == 0:
        return (p.fits, np.zeros(0)) if per_start else math.inf
    layers = np.arange(p.profile.num_layers)
    per = np.max([_paths(p.profile, hw, cfg, p.uf, p.ub, p.end_f, p.end_b, p.fits,
                         [bt(u, layers, layers) for u in p.ub], _chain_one(p.profile, p.ub, bt), p.bw_out, upto,
                         ratio) for bt in p.timers], axis=0)
    return (p.fits, per) if per_start else float(per.min())


class _Pipeline(NamedTuple):
    """What the vPP path bounds share: the profile at the hardware's compute scale, the microbatch
    sizes, max_pack_end per phase, the criterion starts whose pack fits, the link's GPU->host rate
    and the backward timers (``_backward_timer``, one per stash mix where stash variants are offered)."""
    profile: Profile
    uf: list[int]
    ub: list[int]
    end_f: np.ndarray
    end_b: np.ndarray
    fits: np.ndarray
    bw_out: float
    timers: list


def _pipeline(profile: Profile, hw: Hardware, batch: int, cfg: Config, cap: int, stash: bool,
              stash_layers: np.ndarray | None) -> _Pipeline:
    R = profile.num_layers
    profile = profile.with_compute_scale(hw.compute_scale)
    uf, ub = split_microbatches(batch, cfg.u_fwd), split_microbatches(batch, cfg.u_bwd)
    ok = stashable_layers(profile, hw, cfg, uf, ub) if stash_layers is None else np.asarray(stash_layers, bool)
    end_f = max_pack_end(profile.costs("FWD", cfg.u_fwd), cap)
    end_b = max_pack_end(profile.costs("BWD", cfg.u_bwd), cap)
    fits = np.flatnonzero(end_b >= R - 1)          # the criterion starts: [s, R-1] fits
    _, bw_in, bw_out, _ = link_rates(hw, cfg)
    if not hw.copy_overlap:     # tasks.py: a stashed layer's activations move at full bandwidth on the rank
        bw_in = hw.h2d_bandwidth
    timers = [_backward_timer(profile, lam, bw_in, ok) for lam in ((1.0, 0.0) if stash and ok.any() else (None,))]
    return _Pipeline(profile, uf, ub, end_f, end_b, fits, bw_out, timers)


def _paths(profile: Profile, hw: Hardware, cfg: Config, uf: list[int], ub: list[int], end_f: np.ndarray,
           end_b: np.ndarray, fits: np.ndarray, times_b: list[np.ndarray], one_chain: np.ndarray, bw_out: float,
           upto: float, ratio: float) -> np.ndarray:
    """``pipeline_path_bound`` per criterion start in ``fits``, with each backward microbatch's compute
    per layer ``times_b`` (at most what any pack's option charges for it), and ``one_chain``
    (``_chain_one``) for one microbatch of a layer below the criterion pack; ``end_f``, ``end_b``:
    max_pack_end per phase."""
    R = profile.num_layers

    def split(times):
        """Per layer: one microbatch's compute (the lesser of the first and the last), and the rest."""
        one = np.minimum(times[0], times[-1])
        return one, sum(times) - one
    one_f, rest_f = split([profile.costs("FWD", u).time for u in uf])
    one_b, rest_b = split(times_b)
    pre_f, pre_b = (np.concatenate([[0.0], np.cumsum(r)]) for r in (rest_f, rest_b))
    hf, hc, hb = boundary_hops(profile, hw, cfg, uf, ub)
    last = _last_step(profile, hw, bw_out)
    pre_one = np.concatenate([[0.0], np.cumsum(one_b)])
    pre_chain = np.concatenate([[0.0], np.cumsum(one_chain)])
    base = np.concatenate([[0.0], np.cumsum(one_f)])[fits] + pre_chain[fits] + pre_one[R] - pre_one[fits] + \
        hc[fits] + last
    crit = pre_b[R] - pre_b[fits]
    zero = np.zeros(R)

    best = np.full(len(fits), math.inf)
    hi = min(upto - float(base.min()), max(pre_f[-1], pre_b[-1]))     # above: every packing
    # any first threshold above 0 gives a valid bound (the first band is every packing under it); at
    # least 1e-4 of the range, so a first layer that takes no time cannot stall the grid at 0
    prev, L = 0.0, max(float(max(rest_f[0], rest_b[0])), 1e-4 * hi)
    while True:
        final = L >= hi
        if final:                   # every packing above the previous threshold
            fwd = _least_packing(end_f, hf, zero, zero)
            back = _least_packing(end_b, zero, hb, zero)
        else:
            fwd = _least_packing(_reach(end_f, pre_f, L), hf, zero, zero)
            back = _least_packing(_reach(end_b, pre_b, L), zero, hb, zero)
        best = np.minimum(best, np.maximum(prev, crit) + fwd[fits] + back[fits])
        if final:
            break
        prev, L = L, L * ratio
    path = base + best
    per_gpu = _per_gpu_paths(profile, cfg, uf, end_b, fits, one_chain, (pre_one[R] - pre_one[fits]), rest_b, hb,
                             last, upto, path)
    return np.maximum(path, per_gpu)


def _per_gpu_paths(profile: Profile, cfg: Config, uf: list[int], end_b: np.ndarray, fits: np.ndarray,
                   one: np.ndarray, one_crit: np.ndarray, rest: np.ndarray, hb: np.ndarray, last: float, upto: float,
                   path: np.ndarray, ratio: float = 1.03, most: int = 40) -> np.ndarray:
    """vPP, per criterion start s in ``fits``: a bound on the plans whose backward (the criterion
    pack included) runs in at least N tasks, 0 where fewer can do it. Where a pipeline has more
    forward microbatches than GPUs the forward keeps every GPU busy, and one microbatch's trip
    through it (``pipeline_path_bound``) undercounts it; here each GPU's forward work counts whole
    (resnet1026 D=64 vPP x4 u=13/16: 3.64 -> 3.69 s; its best plan found 3.83 s).

    In timing.py's recurrence GPU g runs its forward tasks before its first backward task, at
    position f_g (``S_j >= E_{j-N} >= S_{j-N} + load_{j-N}``), so ``S_{f_g} >= F_g``, its forward
    work; from there the first microbatch passes every backward task after f_g (``S_j >= S_{j-1} +
    p_first_{j-1} + hop_j``) up to a task k, which runs all its microbatches, and the last
    microbatch passes the rest (``E_j >= E_{j-1} + hop_j + p_last_j``), then the last step. So
    ``T >= F_g + sum_{j >= f_g} (one_j + hop_{j+1}) + rest_k + last`` for every k >= f_g (one: a
    microbatch's compute, the lesser of the first and the last, per criterion start ``one_crit`` for
    the criterion pack's, ``_chain_one`` below it; rest: the other microbatches).
    With N or more backward tasks f_g takes the positions c .. c + N - 1 after the criterion
    pack's c, one per GPU; averaged over the GPUs, sum_g F_g is the forward compute of the layers
    before s, and the task at position c + p counts its one with weight min(p + 1, N) / N, the
    handoff into it min(p, N) / N, and its rest min(p + 1, N) / N, for the largest such.

    The least over packings: the packings whose largest weighted rest lies in a band (P, L] take
    at least P plus the least of the rest with every weighted rest at most L: a shortest path over
    the layer boundaries for the tasks at positions N - 1 and on (weight 1), then the N - 2 tasks
    before them, each a window minimum over where it may start. Any partition into bands gives a
    valid bound, and splitting a band only raises it: bands double from the largest layer's rest
    up to where every plan is above ``upto``, and the one binding the bound (beside ``path``, the
    other bound per s) is halved geometrically, at most ``most`` times, until it is within
    ``ratio``; the first band, from 0, at its middle: no packing is without a rest, so its lower
    part holds none and the band's floor rises to what the packings left in it have at least
    (bert_large D=64 vPP x4 u=8/16: 3.90 -> 4.08 s; the best plan found 4.28 s)."""
    n, R = cfg.ranks, profile.num_layers
    pre_one, pre_rest = (np.concatenate([[0.0], np.cumsum(r)]) for r in (one, rest))
    forward = _forward_before(profile, uf, fits)
    crit_rest = (pre_rest[R] - pre_rest[fits]) / n
    base = forward / n + one_crit / n + last
    bounds = np.arange(R + 1)
    hop = np.concatenate([hb, [0.0]])           # per boundary: the handoff into the pack ending below it

    def least(L):
        """Per s, the least of the weighted ones and handoffs over the packings whose weighted rests
        are at most L."""
        # positions N - 1 on: packings of [0, x - 1] into at least one pack, the top one's handoff
        # counting (N - 1) / N
        v = np.concatenate([_least_packing(_reach(end_b, pre_rest, L), -pre_one[:R], pre_one[:R] + hb, np.zeros(R)),
                            [np.inf]]) - hop / n
        v[0] = np.inf
        for p in range(n - 2, 0, -1):           # position p: a pack [x, m - 1] on top of v's packing
            w = (p + 1) / n
            # the lowest start of a pack [x, m - 1] whose weighted rest is at most L (x >= 1: v's packing holds a pack)
            lo = np.searchsorted(_reach(end_b, pre_rest, L / w), np.maximum(bounds - 1, 0))
            lo = np.maximum(np.minimum(lo, bounds), 1)
            v = w * pre_one + (p / n) * hop + _window_min(v - w * pre_one, lo, bounds - 1)
        return v[fits]

    every = least(math.inf)
    hi = min(upto - float(np.min(base + crit_rest + every)), pre_rest[-1])   # above: every plan is above upto
    tops = [float(rest.max())]                  # the bands (P, L] with least(L); the first from 0
    while tops[-1] < hi:
        tops.append(2 * tops[-1])
    bands = [(P, L, least(L)) for P, L in zip([0.0] + tops, tops)] + [(tops[-1], math.inf, every)]
    for _ in range(most + len(bands)):
        values = np.array([np.maximum(P, crit_rest) + v for P, _, v in bands])
        per_s = base + values.min(axis=0)
        i = int(np.argmin(np.maximum(path, per_s)))
        j = int(np.argmin(values[:, i]))
        P, L, v = bands[j]
        if L == math.inf or L <= P * ratio or (P == 0.0 and L <= 1e-9):
            break
        mid = L / 2 if P == 0.0 else math.sqrt(P * L)
        bands[j: j + 1] = [(P, mid, least(mid)), (mid, L, v)]
    return np.where(_fewest_packs(end_b)[fits] >= n - 1, per_s, 0.0)


def vpp_bound(profile: Profile, hw: Hardware, batch: int, cfg: Config, cap: int, stash: bool,
              stash_layers: np.ndarray | None = None, upto: float = math.inf, per_start: bool = False):
    """The tightest bound of a vPP configuration (0 on one GPU or in vDP): per criterion start s the
    largest of ``config_bound``'s, ``pipeline_path_bound``'s and ``pipeline_gpu_bound``'s, each
    valid for the plans of that s, then the least over s. Taken term by term, each bound's least
    lands on a start where the others are high (bert_large D=64 vPP x4 u=8/8: config_bound 3.88 s
    at s = 21, pipeline_gpu_bound 3.85 s at s = 15; together 3.94 s; the best plan found 4.16 s).
    ``per_start``: as ``config_bound``."""
    if cfg.mode != "vPP" or cfg.ranks < 2:
        return 0.0
    args = (profile, hw, batch, cfg, cap, stash, stash_layers)
    fits, per = config_bound(*args, per_start=True)
    if len(fits) == 0:
        return (fits, per) if per_start else math.inf
    for f, v in (pipeline_path_bound(*args, upto=upto, per_start=True), pipeline_gpu_bound(*args, per_start=True)):
        if not np.array_equal(f, fits):     # both take the criterion packs that fit; a mismatch would void the max
            raise AssertionError("vpp_bound: the bounds disagree on the criterion starts")
        per = np.maximum(per, v)
    return (fits, per) if per_start else float(per.min())


#: The weight ``pipeline_gpu_bound`` gives the criterion pack's GPU beside every GPU alike (the rest
#: shared alike by the others): that GPU runs the criterion pack's serial piece of work.
CRITERION_WEIGHTS = (0.3, 0.35, 0.4, 0.5, 0.6, 0.8, 1.0)


def pipeline_gpu_bound(profile: Profile, hw: Hardware, batch: int, cfg: Config, cap: int, stash: bool,
                       stash_layers: np.ndarray | None = None, per_start: bool = False):
    """A lower bound on the model's iteration time of every plan of a vPP configuration (seconds; 0
    on one GPU or in vDP) from each GPU's whole path, its wait for the first microbatch, all its
    tasks and the last microbatch's trip after them, weighed together over one packing.

    In timing.py's recurrence GPU g (positions j = g mod N) starts after the first microbatch has
    passed the tasks before it (``S_g >= sum_{i<g} p_first_i + sum_{i<=g} hop_i``), runs its tasks
    one after another (``E_j >= S_j + load_j``, ``S_{j+N} >= E_j``), and the last microbatch then
    passes every later task (``E_i >= E_{i-1} + hop_i + p_last_i``) before the last step: ``T >=
    P_g`` for each g, so ``T >= sum_g w_g P_g`` for weights w summing to 1. Indexed by the offset
    (g - the criterion pack's position) mod N, the weighted sum is a sum over the tasks of costs
    set by each task's position class (exact below N from its end of the chain, else modulo N),
    and its least over packings a shortest path over the layer boundaries (``_class_packing``):
    forward packs from layer 0 per residue of the criterion pack's position, backward packs from
    layer 0 up per residue of their number, joined at each criterion start s (``_weighted_paths``).
    ``config_bound`` takes the GPUs' busy time as their average and the waits at the ends apart,
    each the least over packings on its own; here a packing that idles a GPU at the ends, or loads
    the criterion pack's, pays for it on that GPU's path. Each start takes the best weights of
    ``CRITERION_WEIGHTS``; plans of fewer than N tasks their busiest GPU, at least the compute
    over N - 1. Where stash variants are offered, backward microbatches are timed as in
    ``pipeline_path_bound``, each mix a valid bound. ``per_start``: as ``config_bound``."""
    if cfg.mode != "vPP" or cfg.ranks < 2:
        return 0.0
    p = _pipeline(profile, hw, batch, cfg, cap, stash, stash_layers)
    n, R, profile, uf, ub, fits = cfg.ranks, profile.num_layers, p.profile, p.uf, p.ub, p.fits
    if len(fits) == 0:
        return (fits, np.zeros(0)) if per_start else math.inf
    layers = np.arange(R)
    hf, hc, hb = boundary_hops(profile, hw, cfg, uf, ub)
    top = np.full(len(fits), R - 1)
    crit = (sum(k * profile.costs("BWD", u).pack_time(fits, top) for u, k in collections.Counter(ub).items()),
            profile.costs("BWD", ub[0]).pack_time(fits, top), profile.costs("BWD", ub[-1]).pack_time(fits, top),
            hc[fits])
    prefix = lambda a: np.concatenate([[0.0], np.cumsum(a)])
    fwd = (prefix(sum(profile.costs("FWD", u).time for u in uf)), prefix(profile.costs("FWD", uf[0]).time), hf)
    w = np.array([np.full(n, 1.0 / n)] + [[c] + [(1 - c) / (n - 1)] * (n - 1) for c in CRITERION_WEIGHTS])
    last = _last_step(profile, hw, p.bw_out)
    per = np.zeros(len(fits))
    # the GPUs after the criterion pack wait for its first microbatch, less the head start of their first
    # pack's recompute (``_hidden_recompute``); a backward pack's last microbatch on the E chain: its backward
    crit = (crit[0], crit[1] - _hidden_recompute(profile, ub, p.end_b, fits, 1), *crit[2:])
    for bt in p.timers:
        last_b = _chain_timer(profile, bt)(ub[-1], layers, layers)
        bwd = (prefix(sum(bt(u, layers, layers) for u in ub)), prefix(last_b), hb)
        tasks = (fwd[0][fits] + crit[0] + bwd[0][fits]) / (n - 1)     # fewer than N tasks: N - 1 GPUs at most
        paths = _weighted_paths(n, w, fits, p.end_f, p.end_b, fwd, bwd, crit) + last
        per = np.maximum(per, np.minimum(paths, tasks).max(axis=0))
    return (fits, per) if per_start else float(per.min())


def _weighted_paths(n: int, w: np.ndarray, fits: np.ndarray, end_f: np.ndarray, end_b: np.ndarray, fwd, bwd, crit
               ) -> np.ndarray:
    """``pipeline_gpu_bound``'s least weighted sum of the GPUs' paths (the last step aside), per row
    of ``w`` (weights by offset from the criterion pack's GPU) and criterion start in ``fits``; inf
    where no packing of N tasks or more is. ``fwd``: the forward packs' load and first microbatch
    (prefix sums), their handoffs per start layer; ``bwd``: the backward packs' load and last
    microbatch, their handoffs per top boundary; ``crit``: the criterion pack's load, first and last
    microbatch and handoff, per start."""
    V, top = len(w), int(fits.max())
    classes = np.arange(2 * n)      # k < n: the k-th pack (from its end of the chain); n + m: further, m modulo n

    def offsets(shift, sign):       # per class, its task's offset from the criterion pack's position
        return (sign * (classes % n - shift)) % n

    def waiting(off):
        """Per class below n, the weights of the GPUs whose paths pass its task's first microbatch
        (forward: the positions after it) or last one (backward: the positions beyond it from the end)."""
        out = np.zeros((V, 2 * n))
        for k in range(n):
            out[:, k] = w[:, [off[e] for e in range(k + 1, n)]].sum(axis=1)
        return out
    # the criterion pack at position a (mod n): forward classes by position; b backward packs (mod n):
    # classes by count from the end, offset b - k. Every residue's weights rows in one packing.
    f_own = [w[:, offsets(a, 1)] for a in range(n)]
    f_wait = [waiting(offsets(a, 1)) for a in range(n)]
    b_own = [w[:, offsets(b, -1)] for b in range(n)]
    b_wait = [waiting(offsets(b, -1)) for b in range(n)]
    hop = [first + np.where(classes < n, own, 0.0) for own, first in zip(f_own, f_wait)]  # its own GPU waits too
    f_rows = _class_packing(n, top, end_f, fwd, True, *map(np.vstack, (f_own, f_wait, hop)))[fits].reshape(
        len(fits), n, V, 2 * n).transpose(1, 0, 2, 3)
    b_rows = _class_packing(n, top, end_b, bwd, False, *map(np.vstack, (b_own, b_wait, b_wait)))[fits].reshape(
        len(fits), n, V, 2 * n).transpose(1, 0, 2, 3)
    load, first, last, hop = crit
    best = np.full((V, len(fits)), np.inf)
    for a in range(n):
        for ca in (a, n + a):       # a forward packs (ca < n) or a plus a multiple of n
            v_a = f_rows[a][:, :, ca].T + w[:, :1] * load
            if ca < n:              # the criterion pack among the first N: the later GPUs wait for its first microbatch
                later = f_wait[a][:, ca:ca + 1]
                v_a = v_a + later * first + (later + w[:, :1]) * hop
            for b in range(n):
                for cb in (b, n + b):
                    if ca < n and cb < n and ca + 1 + cb < n:
                        continue    # fewer than N tasks: pipeline_gpu_bound's ``tasks``
                    v = v_a + b_rows[b][:, :, cb].T
                    if cb < n - 1:  # among the last N - 1: the GPUs done before it wait for its last microbatch
                        v = v + b_wait[b][:, cb:cb + 1] * (hop + last)
                    best = np.minimum(best, v)
    return best


def _class_packing(n: int, top: int, end: np.ndarray, cols, hop_at_start: bool, w_load: np.ndarray,
                   w_micro: np.ndarray, w_hop: np.ndarray) -> np.ndarray:
    """``least[c, v, k]``: per weights row v (rows of the ``w_*``, one column per class), the least
    cost of packing layers [0, c - 1] into packs that fit (``end``) with class k (``_weighted_paths``)
    next; the pack placed in class k costs ``w_load[v, k] * load + w_micro[v, k] * micro`` (``cols``:
    load and micro prefix-summed, the handoffs) ``+ w_hop[v, k] * hop``, the handoff at its start
    layer (``hop_at_start``) or at its top boundary. Every weights row at once: one vector step per
    boundary."""
    load, micro, hop = cols
    V, K = w_load.shape
    nxt = np.array([k + 1 if k + 1 < n else n for k in range(n)] + [n + (m + 1) % n for m in range(n)])
    scatter = (np.arange(V)[:, None] * K + nxt[None, :]).ravel()
    least = np.full((top + 1, V * K), np.inf)
    least[0, ::K] = 0.0
    opened = np.full((top + 1, V * K), np.inf)      # least[x] less what a pack from x is charged below x
    hops = np.concatenate([hop, [0.0]])
    wl, wm, wh = w_load.ravel(), w_micro.ravel(), w_hop.ravel()
    for c in range(1, top + 1):
        x = c - 1
        opened[x] = least[x] - wl * load[x] - wm * micro[x] + (wh * hops[x] if hop_at_start else 0.0)
        ok = np.flatnonzero(end[:c] >= x)
        if len(ok) == 0:
            continue
        cand = opened[ok].min(axis=0) + wl * load[c] + wm * micro[c] + (0.0 if hop_at_start else wh * hops[c])
        np.minimum.at(least[c], scatter, cand)
    return least.reshape(top + 1, V, K)


def _forward_before(profile: Profile, uf: list[int], starts: np.ndarray) -> np.ndarray:
    """Per criterion start s, the forward compute of the layers before it, every forward microbatch."""
    return sum(k * profile.costs("FWD", u).pack_time(0, starts - 1) for u, k in collections.Counter(uf).items())


def _reach(end: np.ndarray, pre: np.ndarray, L: float) -> np.ndarray:
    """Per start a, the last layer a pack [a, e] may end at: it fits (``end``), and its prefix-summed
    ``pre`` (the microbatches' compute beyond one) is at most L."""
    if L == math.inf:
        return end
    top = np.searchsorted(pre, pre[:-1] + L * (1 + 1e-12), side="right") - 2
    return np.minimum(end, np.maximum(top, np.arange(len(end)) - 1))


def _window_min(values: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Per i, ``min(values[lo[i]: hi[i] + 1])`` (inf where empty): a sparse table, O(R log R)."""
    levels = [np.asarray(values, float)]
    while 2 ** len(levels) <= len(values):
        k = 2 ** (len(levels) - 1)
        levels.append(np.minimum(levels[-1][:-k], levels[-1][k:]))
    out = np.full(len(lo), np.inf)
    ok = hi >= lo
    lo, hi = lo[ok], hi[ok]
    level = np.floor(np.log2(hi - lo + 1)).astype(int)
    res = np.empty(len(lo))
    for j in np.unique(level):
        m = level == j
        res[m] = np.minimum(levels[j][lo[m]], levels[j][hi[m] - 2 ** j + 1])
    out[ok] = res
    return out


def _last_step(profile: Profile, hw: Hardware, bw_out: float) -> float:
    """At least what follows the last backward task's compute: layer 0's gradients leave and step
    (on the CPU, or its state too leaves after a GPU step, whichever is less)."""
    w, k_opt = profile.param_bytes(0, 0), profile.optimizer_bytes(0, 0)
    if not hw.copy_overlap:     # tasks.py counts the way out in the task's load (a GPU step in its last
        return 0.0              # microbatch): after it at least nothing
    return float(min(w / bw_out + profile.cpu_update_time(0, 0) * hw.cpu_optimizer_scale,
                     (w + k_opt) / bw_out + (3 * w + 2 * k_opt) / hw.gpu_optimizer_bandwidth))


def _least_before(run: np.ndarray) -> np.ndarray:
    """Per layer a, the least of ``run`` over the layers before a (inf at 0): the cheapest way to the
    previous position when each position's pack starts past the one before."""
    return np.concatenate([[np.inf], np.minimum.accumulate(run)[:-1]])


def _fewest_packs(max_end: np.ndarray) -> np.ndarray:
    """Per boundary b, at most the fewest packs that fit (``c - 1 <= max_end[a]``) covering layers
    [0, b - 1]: greedy, each pack reaching as far as any pack starting at or before its start could
    (a relaxation where a later start may reach less far), so never more than the fewest."""
    reach = np.maximum.accumulate(np.maximum(max_end, np.arange(len(max_end)) - 1)) + 1
    ends = [0]
    while ends[-1] < len(max_end) and reach[ends[-1]] > ends[-1]:
        ends.append(int(reach[ends[-1]]))
    b = np.arange(len(max_end) + 1)
    return np.where(b <= ends[-1], np.searchsorted(np.asarray(ends), b), 10**9)


def _least_packing(max_end: np.ndarray, at_start: np.ndarray, at_top: np.ndarray, first: np.ndarray) -> np.ndarray:
    """``least[b]``: the least total cost of packing layers [0, b - 1] into packs [a, c - 1] that fit
    (``c - 1 <= max_end[a]``), a pack costing ``at_start[a] + at_top[c]``, plus ``first[c]`` for the
    one starting at layer 0 (inf where no packing exists). O(R log R): each pack start waits in a
    heap until the boundaries it reaches are passed."""
    R = len(max_end)
    reach, start, top, first = (max_end + 1).tolist(), at_start.tolist(), at_top.tolist(), first.tolist()
    least = [0.0] * R
    heap: list[tuple[float, int]] = []       # (least[a] + at_start[a], last boundary a reaches)
    for c in range(1, R):
        a = c - 1
        if a >= 1 and least[a] < math.inf:
            heapq.heappush(heap, (least[a] + start[a], reach[a]))
        while heap and heap[0][1] < c:
            heapq.heappop(heap)
        best = heap[0][0] if heap else math.inf
        if reach[0] >= c:
            best = min(best, start[0] + first[c])
        least[c] = best + top[c]
    return np.asarray(least)


def _recompute(profile: Profile, u: int) -> np.ndarray:
    """Per layer, the recompute of a backward microbatch of ``u`` samples: its backward less its
    stashed backward, at least 0. Summed over a pack's layers it is at least the pack's recompute
    as the simulator plays it (the backward less ``stashed_backward_time``, which clips the pack's
    sum, not each layer's, at 0)."""
    return np.maximum(profile.costs("BWD", u).time - profile.stashed_backward(u), 0.0)


def _chain_timer(profile: Profile, bt):
    """``time(u, a, b)``: at most what a backward microbatch of ``u`` samples adds over packs [a, b]
    to a vPP pipeline's handoff chains (timing.py's S and E chains). A recomputing pack's
    microbatch recomputes while its dY is on its way (tasks.py), so it adds its backward without the
    recompute, ``min(backward, stashed_backward)`` per layer (``_recompute``); a stashed pack's adds
    at least what ``bt`` (``_backward_timer``) counts."""
    layers = np.arange(profile.num_layers)
    sums = {}

    def time(u, a, b):
        if u not in sums:
            per = np.minimum(bt(u, layers, layers), profile.costs("BWD", u).time - _recompute(profile, u))
            sums[u] = np.concatenate([[0.0], np.cumsum(per)])
        a, b = np.asarray(a), np.asarray(b)
        return np.where(b >= a, sums[u][b + 1] - sums[u][a], 0.0)
    return time


def _chain_one(profile: Profile, ub: list[int], bt) -> np.ndarray:
    """Per layer below the criterion pack: at most its share of a backward pack's first microbatch on
    the S chain, of its last on the E chain (``_chain_timer``), and of the pack's microbatches but the
    others' (``pipeline_path_bound``'s rest) on a path that runs them all, where the pack's load less
    its first microbatch's recompute counts (timing.py: ``S_k`` waits for dY less that recompute)."""
    ct, layers = _chain_timer(profile, bt), np.arange(profile.num_layers)
    return np.minimum.reduce([ct(ub[0], layers, layers), ct(ub[-1], layers, layers),
                              profile.costs("BWD", ub[-1]).time - _recompute(profile, ub[0])])


def _hidden_recompute(profile: Profile, ub: list[int], end_b: np.ndarray, fits: np.ndarray, packs: int
                      ) -> np.ndarray:
    """Per criterion start s in ``fits``: at least what the first microbatches of ``packs`` backward
    packs below s recompute together (each before its dY is in, a head start on the handoff
    chains): their layers are apart, so at most one microbatch's recompute of every layer before s,
    and at most ``packs`` times the largest pack's that fits (``end_b``)."""
    if packs <= 0:
        return np.zeros(len(fits))
    pre = np.concatenate([[0.0], np.cumsum(_recompute(profile, ub[0]))])
    starts = np.arange(len(end_b))
    largest = float(np.max(pre[np.minimum(end_b, len(end_b) - 2) + 1] - pre[starts], initial=0.0))
    return np.minimum(pre[fits], packs * largest)


def _backward_timer(profile: Profile, lam: float | None, bw_in: float, ok: np.ndarray | None = None):
    """``time(u, a, b)``: at least the backward compute of one microbatch of ``u`` samples over packs
    [a, b] (0 where empty), whatever the pack's option. Where stash may replace the recompute
    (``lam`` not None), a stashed pack's microbatch takes max(stashed backward, saved / link)
    (tasks.py) >= lam * first + (1 - lam) * second, a sum over its layers: each layer counts the
    lesser of that and its recompute (only the recompute where ``ok``, tasks.stashable_layers, says
    it has no stash variant). Every lam in [0, 1] gives a valid bound; 1 leaves out the link, 0 the
    compute saved."""
    if lam is None:
        return lambda u, a, b: profile.costs("BWD", u).pack_time(a, b)
    sums = {}

    def time(u, a, b):
        if u not in sums:
            c = profile.costs("BWD", u)
            per = np.minimum(c.time, lam * profile.stashed_backward(u) + (1 - lam) * c.saved / bw_in)
            per = per if ok is None else np.where(ok, per, c.time)
            sums[u] = np.concatenate([[0.0], np.cumsum(per)])
        a, b = np.asarray(a), np.asarray(b)
        return np.where(b >= a, sums[u][b + 1] - sums[u][a], 0.0)
    return time
