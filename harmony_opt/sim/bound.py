"""A lower bound on the iteration time of any plan, so every plan's efficiency is known.

For a (Profile, Hardware, minibatch D) and any mode, GPU count, microbatch sizes,
packing and per-pack options, an iteration needs at least:

* compute: every sample passes every layer's forward once and every layer's backward
  once; at best each at its most efficient profiled size per sample, spread evenly over
  all GPUs: ``D * sum_l min(min_u tB(u,l)/u, min_u tF(u,l)/u + min_u (tB(u,l) - tF(u,l))/u) / N``.
  A layer in the criterion pack runs only its backward (its forward inside), one recomputed
  runs both, one stashed its forward (at least the plain one) and its backward without the
  recompute (``Profile.stashed_backward``: as measured on the stash path, or else its backward
  less its forward): the simulator charges a stashed pack the sum over its layers, at least 0,
  which is at least the sum of its layers' values, negative where a layer's backward took
  less than its forward (a CPU profile's noise): clipped at 0 layer by layer, the bound passed
  plans on such profiles. Times are linear in u between profiled sizes, so each least per
  sample is at a profiled size (for the difference, of either phase; the forward at the
  nearest profiled size beyond its range, as the simulator takes it);
* host link: if the model's weights and buffers do not fit in the GPUs together, the
  excess must come in over the host links at least once per iteration; what of weights,
  gradients and optimizer state does not fit must leave (as gradients to a CPU
  optimizer, or as updated weights and state from a GPU step), at least up to the
  size of the weights: ``bytes / link bandwidth`` per direction, the bandwidth of every
  server's link together (of every GPU's, where each has its own).

The hardware's execution terms (docs/cost_model.md): kernel times count at ``compute_scale``;
the criterion pack issues a backward for each of its microbatches, at least ``ceil(D / largest
backward size)`` of them over all GPUs, so the compute term counts that many ``issue_overhead_s``;
without ``copy_overlap`` every GPU's transfers run one at a time with its compute, so the bytes
that must cross the link join the compute term at one transfer's bandwidth. Other terms (latencies, per-call costs) depend on the plan and are left out.

The CPU optimizer is not a term: a plan may step every pack on the GPU instead.

efficiency = bound / simulated time (1.0 would be perfect).
"""
from __future__ import annotations

import numpy as np

from ..core.hardware import Hardware
from ..core.profile import Profile


def lower_bound(profile: Profile, hw: Hardware, batch: int, memory_cap: int | None = None) -> dict:
    cap = memory_cap or hw.gpu_memory_bytes
    n = hw.gpus
    R = profile.num_layers
    profile = profile.with_compute_scale(hw.compute_scale)
    fs, bs = profile.sizes("FWD"), profile.sizes("BWD")
    f_rate = np.min(np.stack([profile.costs("FWD", int(u)).time / u for u in fs]), axis=0)
    b_rate = np.min(np.stack([profile.costs("BWD", int(u)).time / u for u in bs]), axis=0)
    # the stashed backward per sample: at the sizes where either phase is profiled
    at = sorted({int(u) for u in bs} | {int(u) for u in fs if bs[0] <= u <= bs[-1]})
    b_only = np.min(np.stack([profile.stashed_backward(u) / u for u in at]), axis=0)
    compute = batch * max(float(np.sum(np.minimum(b_rate, f_rate + b_only))), 0.0)
    wb = int(profile.param_bytes(0, R - 1) + profile.buffer_bytes(0, R - 1))
    k = int(profile.optimizer_bytes(0, R - 1))
    link = hw.link_bandwidth or hw.h2d_bandwidth
    link = link * (n if not hw.shared_host_link else hw.servers)
    h2d_bytes = max(0, wb - n * cap)
    w = int(profile.param_bytes(0, R - 1))
    d2h_bytes = min(w, max(0, wb + k + w - n * cap))
    if hw.issue_overhead_s:
        compute += -(-batch // int(bs[-1])) * hw.issue_overhead_s
    if not hw.copy_overlap:
        compute += h2d_bytes / hw.h2d_bandwidth + d2h_bytes / hw.d2h_bandwidth
    terms = {"compute_s": compute / n, "h2d_s": h2d_bytes / link, "d2h_s": d2h_bytes / link}
    return {"bound_s": max(terms.values()), **terms}
