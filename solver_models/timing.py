"""The planner's model of the simulator: the iteration time of a sequence of tasks.

A plan's tasks form one chain: forward packs in layer order, the criterion pack (the one
holding the loss), then the backward packs in reverse layer order (``sequence_of``). In vPP
the task at position j runs on GPU j mod N; in vDP every GPU runs the whole chain on its data
share. With the per-task constants of tasks.py, the simulator's iteration time is, to within
a few percent (docs/planner.md has the measurements), the least solution of::

    S_j >= S_{j-1} + p_first_{j-1} + hop_j        first microbatch handed on
    E_j >= S_j + load_j                           the task's microbatches run back to back
    E_j >= E_{j-1} + hop_j + p_last_j             ... and its last one waits for the producer's last
    S_j >= E_q                                    q = j - N: the previous task on the same GPU
    W_j >= S_q,  S_j >= W_j + w_load_j            weights are prefetched once q computes ...
    W_j >= FREE_q        unless mem_q + wb_j  <= cap   ... if they fit beside q's working set
    S_j >= FREE_q        unless mem_q + mem_j <= cap   the working set waits for q's memory
    FREE_j >= E_j + tail_j,  T >= E_j,  T >= FREE_j + upd_j

(S: first compute starts, E: last compute ends, W: weights start coming in, FREE: the task
releases its memory). In vPP, where the minibatch's last microbatch is smaller than the others
(``Tasks.pen_chain``), the last but one also passes every task in turn (``p_pen``: its compute;
not across the re-batching into the criterion pack, position c)::

    L_j >= S_j + load_j - p_last_j,  L_j >= L_{j-1} + hop_j + p_pen_j  (j != c),  E_j >= L_j + p_last_j

(gpt2_medium D=64 vPP x4 u=5/3, 21 microbatches of 3 and one of 1: without it a plan was rated
10.57 s that the simulator plays in 11.14 s, its backward packs handing on the microbatches of 3
one after another after the criterion pack). ``pipeline.py`` encodes this for vPP. When one GPU
runs the whole chain (vDP, or N = 1) the time is a sum over consecutive pairs (``chain_gap``),
which ``chain.py`` and the DP (dp.py) encode. Then the shared host link: the forward phase (through the end of
the criterion pack) and the backward phase each last at least as long as their own traffic
takes on it (all replicas' in vDP, which meet at every backward pack's all-reduce, so the
slowest sets the pace): ``T = max(T_F, link_F) + max(T_B, link_B)``. A phase's traffic cannot
hide in the other: activations stashed in the forward leave the GPUs while the forward runs
and come back while the backward runs (vPP with stashed layers: the model without the phases
rated a gpt2_xl plan 36.8 s that the simulator plays in 62.5 s). In a chain the forward phase
also waits for its traffic out at each forward pack boundary (``forward_queue``): the next pack's
last input leaves behind the outputs and checkpoints queued before it, and the compute of that
microbatch and of the packs after it follows (vgg416, D=64, vDP on 4 GPUs with 106 backward
packs, each stashing its input: without it the model rated a chain 9.9 s that the simulator
plays in 11.6 s, its forward phase bounded only by the phase's whole traffic; now 10.4 s).

In vPP a recomputing backward task's microbatch recomputes while its dY is on the way (the
simulator, as the executor): tasks.py takes the first microbatch's recompute ``r_first`` off the
task's ``hop_in`` and puts it in place of each later chained microbatch's own in ``p_last`` and
``p_pen``, so the chains count only its backward (``E_j >= E_{j-1} + hop_j + p_last_j - r_last_j``)
and ``S_j`` is when the recompute would start for the backward to start as dY comes in (gpt2_medium
D=64 vPP x4, Harmony's plan: rated 12.424 s with the recompute after dY, which the simulator plays
in 12.204 s; now 12.202 s).

A chain's task also waits for the memory of the task two back (``two_back``): where the memory of
tasks j - 2 and j - 1 leaves no room for task j's weights (or its working set), they wait for task
j - 2 to free its memory, and its tail (its last outputs, its gradients' all-reduce and way out)
can outlast task j - 1's compute (bert_96, D=16, vDP on 4 GPUs with 13 backward packs: rated 5.20 s
without it, 5.70 s with it, simulated 5.71 s).

Where the hardware charges the host's time per instruction (``Hardware.host_instruction_s``, a GPU's
calibration), the step also lasts at least each rank's issuing thread's time, the sum of its tasks'
``issuing`` (``issuing_floor``; the simulator's ``host_floor``).

``evaluate`` computes either exactly as the CP-SAT models do, in integer ticks (the forward queue
and the waits for the task two back aside, which they leave out: ``pairwise=True`` computes what they
count): it scores hints and candidates, and checks that a solver's objective is what its packs are
worth.
"""
from __future__ import annotations

import numpy as np

from .tasks import B, C, F, Tasks


def sequence_of(tasks: Tasks, packs_fwd, packs_bwd, options) -> list[int]:
    """Task rows of a plan in chain order; KeyError if a pack is not one of the candidates."""
    idx = tasks.table.index()
    seq = [idx[(F, int(a), int(b), True, False)] for a, b in packs_fwd]
    bwd = list(zip(packs_bwd, options))
    (a, b), (_, g) = bwd[-1]
    seq.append(idx[(C, int(a), int(b), True, bool(g))])
    for (a, b), (r, g) in reversed(bwd[:-1]):
        seq.append(idx[(B, int(a), int(b), bool(r), bool(g))])
    return seq


def sequence_of_plan(tasks: Tasks, plan) -> list[int]:
    """:func:`sequence_of` a Plan's packs and per-pack options."""
    return sequence_of(tasks, plan.packs_fwd, plan.packs_bwd,
                       [(o.recompute, o.optimizer == "gpu") for o in plan.options])


def pack_starts(plan) -> list[int]:
    """The first layer of every pack of a Plan: the cuts its packs need among the candidates."""
    return [a for a, _ in plan.packs_fwd] + [a for a, _ in plan.packs_bwd]


def packs_of(tasks: Tasks, seq: list[int]) -> tuple[list, list, list]:
    """(forward packs, backward packs, backward options as (recompute, gpu optimizer)) of a sequence."""
    t = tasks.table
    fwd = [(int(t.start[k]), int(t.end[k])) for k in seq if t.kind[k] == F]
    bwd = [k for k in seq if t.kind[k] != F][::-1]
    return (fwd, [(int(t.start[k]), int(t.end[k])) for k in bwd],
            [(bool(t.recompute[k]), bool(t.gpu_opt[k])) for k in bwd])


def stash_fits(tasks: Tasks, seq: list[int]) -> bool:
    """Forward packs hold one microbatch of the saved activations of their stashed layers."""
    t = tasks.table
    if tasks.saved_fwd is None:
        return True
    stashed = np.zeros(tasks.num_layers, bool)
    for k in seq:
        if t.kind[k] == B and not t.recompute[k]:
            stashed[t.start[k]: t.end[k] + 1] = True
    if not stashed.any():
        return True
    for k in seq:
        if t.kind[k] == F:
            a, b = int(t.start[k]), int(t.end[k])
            if t.mem[k] + float(np.sum(tasks.saved_fwd[a: b + 1][stashed[a: b + 1]])) > tasks.cap:
                return False
    return True


def host_fits(tasks: Tasks, host_mib: int) -> bool:
    """The plan's activation buffers (``host`` MiB summed over its tasks) fit the host's budget."""
    return tasks.host_budget is None or host_mib <= tasks.host_budget


def evaluate(tasks: Tasks, seq: list[int], pairwise: bool = False) -> float:
    """The model's iteration time of a task sequence in seconds (inf where GPU or host memory does not
    fit); ``pairwise=True``: what the DP and the CP-SAT chain model count, consecutive tasks only
    (without the forward queue and the waits for the task two back)."""
    return evaluate_ticks(tasks, seq, pairwise) / tasks.ticks_per_s


def evaluate_ticks(tasks: Tasks, seq: list[int], pairwise: bool = False) -> float:
    parts = phase_parts(tasks, seq, pairwise)
    if parts is None:
        return float("inf")
    fwd_part, fwd_link, bwd_part, bwd_link = parts
    T = max(fwd_part, fwd_link) + max(bwd_part, bwd_link)
    if tasks.host_bound:
        T = max(T, issuing_floor(tasks, seq))
    return float(T)


def issuing_floor(tasks: Tasks, seq: list[int]) -> int:
    """The step lasts at least what each rank's issuing thread spends (``simulator.host_floor``): the
    largest over ranks of its tasks' ``issuing`` (ticks; the task at position j runs on rank j mod N)."""
    col = tasks.ticks()["issuing"][seq]
    n = tasks.cfg.ranks
    return int(col.sum()) if n == 1 else int(np.bincount(np.arange(len(seq)) % n, weights=col, minlength=n).max())


def phase_parts(tasks: Tasks, seq: list[int], pairwise: bool = False) -> tuple[int, int, int, int] | None:
    """(forward phase, its link floor, backward phase, its link floor) in ticks; None where GPU or
    host memory does not fit. ``pairwise=True``: as the DP and the CP-SAT chain model count them."""
    d = tasks.ticks()
    cols = d["stacked"][:, seq]            # one gather: times, exact memory, mem, wb, link columns, phase, host
    if cols[7].max() > d["cap_exact"] or not stash_fits(tasks, seq) or not host_fits(tasks, int(cols[14].sum())):
        return None
    link_in, link_out, out_fwd, bwd = cols[10], cols[11], cols[12], cols[13].astype(bool)
    crit = int((~bwd).sum()) - 1
    if tasks.cfg.ranks > 1:
        T, e_crit = _pipeline_time(*cols[:7].tolist(), cols[8].tolist(), cols[9].tolist(), d["cap"],
                                   tasks.cfg.ranks, crit, cols[18].tolist() if tasks.pen_chain else None)
        fwd_part, bwd_part = e_crit, T - e_crit
    else:
        fwd_part, bwd_part = _chain_time(*cols[:7], cols[8], cols[9], d["cap"], crit, pairwise)
    # the forward phase (through the criterion pack) and the backward phase each take at least
    # their own traffic on the shared link
    fwd_link = max(int(link_in[~bwd].sum()), int(out_fwd.sum()))
    if not pairwise and tasks.cfg.ranks == 1 and crit > 0:
        fwd_link = max(fwd_link, forward_queue(cols[15], cols[16], cols[1], cols[2], cols[17], crit))
    bwd_link = max(int(link_in[bwd].sum()), int(link_out.sum() - out_fwd.sum()))
    return int(fwd_part), fwd_link, int(bwd_part), bwd_link


def forward_queue(start, end, p_last, load, queued, crit: int) -> int:
    """The forward phase of a chain waits for its traffic out: the last microbatch of forward task
    j + 1 waits for its input, which leaves its GPU behind everything queued before it on the
    swap-out stream (in vDP, on the host link all replicas share): the outputs of tasks 0..j and
    the checkpoints of the backward packs starting in them (``queued``: stashed activations leave
    as they are made, not counted); then that microbatch computes, and the tasks after it, the
    criterion pack included. The largest such ``sent + compute left`` over j (columns in chain
    order; crit > 0)."""
    b_start, b_out = start[:crit:-1], queued[:crit:-1]        # the backward packs, by ascending start
    checkpoints = np.concatenate(([0], np.cumsum(b_out)))[np.searchsorted(b_start, end[:crit], "right")]
    sent = np.cumsum(queued[:crit]) + checkpoints
    after = np.cumsum(load[crit:1:-1])[::-1]                  # load of tasks j + 2 .. crit, j = 0 .. crit - 2
    left = p_last[1:crit + 1] + np.concatenate((after, [0]))
    return int((sent + left).max())


def _pipeline_time(p1, pl, load, hop, wl, tail, upd, mem, wb, cap, n, crit: int, pp=None) -> tuple[int, int]:
    """The recurrence of the module docstring, tasks at positions j on GPU j mod n: the iteration
    time and the end of the criterion pack (position ``crit``); ``pp``: each task's ``p_pen``, where
    the chain of the last microbatch but one counts. (Plain Python on ints, branches instead of
    max(): the local search evaluates it thousands of times.)"""
    S, E, FREE = [], [], []
    T = s_prev = p1_prev = e_prev = l_prev = 0
    for j, (p1j, plj, loadj, hopj, wlj, tailj, updj, memj, wbj) in enumerate(
            zip(p1, pl, load, hop, wl, tail, upd, mem, wb)):
        if j == 0:
            s = hopj if hopj > wlj else wlj
        else:
            s = s_prev + p1_prev + hopj
        if j >= n:
            q = j - n
            sq, fq, mq = S[q], FREE[q], mem[q]
            w = (sq if mq + wbj <= cap else (sq if sq > fq else fq)) + wlj
            if w > s:
                s = w
            if E[q] > s:
                s = E[q]
            if mq + memj > cap and fq > s:
                s = fq
        elif wlj > s:
            s = wlj
        e = s + loadj
        alt = e_prev + hopj + plj
        if alt > e:
            e = alt
        if pp is not None:          # the last microbatch but one ends at l, the last one after it
            l_ = s + loadj - plj
            if j and j != crit:
                alt = l_prev + hopj + pp[j]
                if alt > l_:
                    l_ = alt
            if l_ + plj > e:
                e = l_ + plj
            l_prev = l_
        f = e + tailj
        S.append(s)
        E.append(e)
        FREE.append(f)
        if e > T:
            T = e
        if f + updj > T:
            T = f + updj
        s_prev, p1_prev, e_prev = s, p1j, e
    return T, E[crit]


def _chain_time(p1, pl, load, hop, wl, tail, upd, mem, wb, cap, crit: int, pairwise: bool = False
                ) -> tuple[int, int]:
    """One GPU runs the chain: the first task's inputs, every task's compute, the gaps, the last
    tail; split at the end of the criterion pack (position ``crit``) into the forward and the
    backward phase. (Columns of integer ticks, every consecutive pair at once; then, unless
    ``pairwise``, the waits for the task two back.)"""
    gap = chain_gap(p1[:-1], load[:-1], tail[:-1], mem[:-1], hop[1:], pl[1:], load[1:], wl[1:], wb[1:], mem[1:], cap)
    ends = int(max(hop[0], wl[0]) + load[0]) + np.concatenate(([0], np.cumsum(load[1:] + gap)))
    if not pairwise and len(ends) > 2:
        ends = two_back(ends, gap, load, wl, tail, mem, wb, cap)
    fwd = int(ends[crit])
    return fwd, int(ends[-1]) - fwd + int(tail[-1]) + int(upd[-1])


def two_back(ends, gap, load, wl, tail, mem, wb, cap):
    """The ends of a chain's tasks (``ends``: counted pair by pair) where task j also waits for task
    j - 2 to free its memory: its weights where the memory of j - 2 and j - 1 leaves no room for them
    (then they come in, and j computes), else its working set where it leaves none for that."""
    held = mem[:-2] + mem[1:-1]
    wait = np.where(held + wb[2:] > cap, wl[2:], np.where(held + mem[2:] > cap, 0, -1))     # -1: no wait
    if not (wait >= 0).any():
        return ends
    e, gap, load, tail, wait = ends.tolist(), gap.tolist(), load.tolist(), tail.tolist(), wait.tolist()
    for j in range(2, len(e)):
        e[j] = e[j - 1] + gap[j - 1] + load[j]
        if wait[j - 2] >= 0:
            e[j] = max(e[j], e[j - 2] + tail[j - 2] + wait[j - 2] + load[j])
    return e


def chain_gap(p1_a, load_a, tail_a, mem_a, hop_b, pl_b, load_b, wl_b, wb_b, mem_b, cap):
    """Idle time of the GPU between task a and the next task b in one chain (numpy-broadcasting).

    From the recurrence with q = a: b starts after a ends, plus what is not hidden of b's first
    input (a's first output, handed on), of b's last input (not hidden by b's other
    microbatches) and of b's weights (prefetched while a computes); where the memory does not
    fit, b's weights or its working set wait for a to free its memory (a's tail). And b's
    outputs leave on the same swap-out stream as a's gradients, after them: the next task
    cannot have its input before a's tail is over, so b lasts at least that long."""
    gap = np.maximum(np.maximum(np.maximum(0, np.add(p1_a, hop_b) - load_a),
                                np.maximum(np.add(hop_b, pl_b) - load_b, np.subtract(wl_b, load_a))),
                     np.subtract(tail_a, load_b))      # b's outputs queue behind a's on the swap-out stream
    gap = np.where(np.add(mem_a, wb_b) > cap, np.maximum(gap, np.add(tail_a, wl_b)), gap)
    return np.where(np.add(mem_a, mem_b) > cap, np.maximum(gap, tail_a), gap)
