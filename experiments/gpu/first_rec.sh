#!/usr/bin/env bash
# What slows a backward pack's first recompute? GPT-2 XL, D=2, the committed 11 GB plans, each run alone
# in a fresh process (experiments.gpu.trial), settings alternated (results/gpu/first_rec_h200.md):
#   experiments/gpu/first_rec.sh headroom    ours at allocator caps of 11 and 13 GB, and Harmony's at 11 GB
#   experiments/gpu/first_rec.sh allocator   ours with and without expandable segments, and with 8 CPU-optimizer
#                                            threads instead of cores - 2
#   experiments/gpu/first_rec.sh launch      ours with CUDA_LAUNCH_BLOCKING=1 (every kernel alone) and without, the
#                                            host time of each recompute's handler beside the device time
#   experiments/gpu/first_rec.sh hostprof    ours twice, each measured recompute's handler under cProfile: per call,
#                                            the functions' own host time in first and in later microbatches
#   experiments/gpu/first_rec.sh gate        ours with each CPU optimizer step held until the next pack's first
#                                            recompute is issued (at most 0.2 s), and without, alternated
# On a GPU machine; results in /tmp/<check>, packed into $OUT/<check>.tgz after each run.
set -u
check=${1:-}
case $check in
    headroom | allocator | launch | hostprof | gate) ;;
    *) echo "experiments/gpu/first_rec.sh: error: give the check to run, headroom, allocator, launch, hostprof or" \
            "gate (got '$check')" >&2
       exit 2 ;;
esac
cd "$(dirname "$0")/../.."
out=/tmp/$check; mkdir -p "$out"; k=0
. experiments/gpu/env.sh
case=experiments/results/gpu/gpt2_xl_cap11GB
trial() {   # METHOD CAP_GB NAME [python -c prelude]: one run, its median step and first-recompute excess
    local job="{\"method\": \"$1\", \"model\": \"gpt2-xl\", \"batch\": 2, \"cap\": ${2}000000000, \"warmup\": 2,
                \"steps\": 6, \"device\": \"cuda\", \"plan\": \"$case/$1.plan.json\",
                \"trace_path\": \"$out/$3.trace.json\"}"
    timeout 200 python3 -c "${4:-}
import sys
from experiments.gpu.trial import main
main(sys.argv[1:])" "$job" "$out/$3.run.json"
    python3 -c "import json, sys; r = json.load(open(sys.argv[1])); print(sys.argv[1], r.get('step_s_median'),
                r.get('peak_reserved'), r.get('error'))" "$out/$3.run.json"
    python3 -m experiments.gpu.first_rec "$out/$3.trace.json"
    [ -n "${OUT:-}" ] && tar czf "$OUT/$check.tgz" -C /tmp "$check"
}
cuda_tests() {   # the executor's and profiler's CUDA tests, before the runs
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_executor.py tests/test_profiler.py 2>&1 \
        | tail -3 | tee "$out/tests.txt"
}
# expandable segments unless a run says otherwise (the allocator check sets or unsets it per run)
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device.txt"
if [ "$check" = headroom ]; then
    cuda_tests
    for spec in ours:11 ours:13 harmony:11 ours:11 ours:13; do
        k=$((k + 1)); trial "${spec%:*}" "${spec#*:}" "$k.${spec%:*}.${spec#*:}"
    done
elif [ "$check" = launch ]; then
    cuda_tests
    # the host time of every recompute's handler (launching its kernels), written at exit to $HOST_TIMES
    timed="import atexit, json, os, time, runtime.executor as X
from harmony_opt.compile.program import Kind
rows, rec = [], X._HANDLERS[Kind.REC]
def timed_rec(self, ins, e):
    t = time.perf_counter(); made = rec(self, ins, e)
    rows.append([self.step, str(ins.layers), ins.mb, (time.perf_counter() - t) * 1e3]); return made
X._HANDLERS[Kind.REC] = timed_rec
atexit.register(lambda: json.dump(rows, open(os.environ['HOST_TIMES'], 'w')))"
    for spec in async blocking async blocking; do
        k=$((k + 1))
        if [ $spec = blocking ]; then export CUDA_LAUNCH_BLOCKING=1; else unset CUDA_LAUNCH_BLOCKING; fi
        HOST_TIMES="$out/$k.$spec.host.json" trial ours 11 "$k.$spec" "$timed"
        python3 -m experiments.gpu.first_rec --host "$out/$k.$spec.host.json"
    done
elif [ "$check" = hostprof ]; then
    # the measured steps' recompute handlers under cProfile, first microbatches apart from later ones; at exit
    # $HOST_PROFILE gets [function, ms per first call, ms per later call] by the difference, largest first
    profiled="import atexit, cProfile, json, os, pstats, runtime.executor as X
from harmony_opt.compile.program import Kind
rec, profs, calls = X._HANDLERS[Kind.REC], {True: cProfile.Profile(), False: cProfile.Profile()}, {True: 0, False: 0}
def profiled_rec(self, ins, e):
    if self.step < 2:
        return rec(self, ins, e)
    first = not ins.mb
    calls[first] += 1
    return profs[first].runcall(rec, self, ins, e)
X._HANDLERS[Kind.REC] = profiled_rec
def dump():
    own = {}
    for first, prof in profs.items():
        for (f, line, name), row in pstats.Stats(prof).stats.items():
            key = f'{name} ({os.path.basename(f)}:{line})'
            own.setdefault(key, {})[first] = row[2] * 1e3 / max(1, calls[first])
    rows = sorted(([k, v.get(True, 0.0), v.get(False, 0.0)] for k, v in own.items()), key=lambda r: r[2] - r[1])
    json.dump({'calls': {'first': calls[True], 'later': calls[False]}, 'rows': rows},
              open(os.environ['HOST_PROFILE'], 'w'))
atexit.register(dump)"
    for k in 1 2; do
        HOST_PROFILE="$out/$k.hostprof.json" trial ours 11 "$k.hostprof" "$profiled"
        python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(d['calls'])
for name, a, b in d['rows'][:12]:
    print(f'{a - b:8.2f} ms  first {a:8.2f}  later {b:8.2f}  {name}')" "$out/$k.hostprof.json"
        [ -n "${OUT:-}" ] && tar czf "$OUT/$check.tgz" -C /tmp "$check"
    done
elif [ "$check" = gate ]; then
    # a CPU step submitted after the k-th first recompute waits (on the worker) for the (k+1)-th to be issued
    gated="import threading, runtime.executor as X
from harmony_opt.compile.program import Kind, Stream
rec, update, cond, issued = X._HANDLERS[Kind.REC], X._HANDLERS[Kind.UPD], threading.Condition(), [0]
def counted_rec(self, ins, e):
    made = rec(self, ins, e)
    if not ins.mb:
        with cond:
            issued[0] += 1
            cond.notify_all()
    return made
class Held:
    def __init__(self, pool):
        self.pool = pool
    def submit(self, fn):
        after = issued[0]
        def held():
            with cond:
                cond.wait_for(lambda: issued[0] > after, timeout=0.2)
            return fn()
        return self.pool.submit(held)
def held_update(self, ins, e):
    if ins.stream is not Stream.CPU:
        return update(self, ins, e)
    pool, self.pool = self.pool, Held(self.pool)
    try:
        return update(self, ins, e)
    finally:
        self.pool = pool
X._HANDLERS[Kind.REC], X._HANDLERS[Kind.UPD] = counted_rec, held_update"
    for spec in held plain held; do
        k=$((k + 1))
        if [ $spec = held ]; then trial ours 11 "$k.$spec" "$gated"; else trial ours 11 "$k.$spec"; fi
    done
else
    eight="import runtime.worker as w; w.host_threads = lambda world, device, current=None: min(8, current or 8)"
    for spec in expandable plain threads8 plain expandable; do
        k=$((k + 1))
        case $spec in
            expandable) (export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; trial ours 11 "$k.$spec") ;;
            plain) (unset PYTORCH_CUDA_ALLOC_CONF; trial ours 11 "$k.$spec") ;;
            threads8) (export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; trial ours 11 "$k.$spec" "$eight") ;;
        esac
    done
fi
