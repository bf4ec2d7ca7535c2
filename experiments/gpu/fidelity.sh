#!/usr/bin/env bash
# The simulator's fidelity on a GPU, in one call of at most SECONDS (default 560): the CUDA tests, then
# benchmarks/bench_fidelity.py --device cuda (profile, probe, calibrate on Harmony's plan, plan again, run
# every planner's plan) into benchmarks/results/fidelity_<gpu>.{md,csv,png}; cut short, the cases done
# are in fidelity_<gpu>.partial.csv. With $OUT set (the device tool) the results and the log go there,
# and keep.tgz: every case's profile, hardware, plans, run times and traces (--keep), to refit offline.
#   experiments/gpu/fidelity.sh [SECONDS] [more arguments of bench_fidelity.py]
set -u
limit=${1:-560}; shift || true
start=$SECONDS
cd "$(dirname "$0")/../.."
. experiments/gpu/env.sh
# the GPU's name without the vendor, in lower case and dashes: h200, h100-80gb-hbm3, geforce-rtx-4090
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr 'A-Z' 'a-z' | sed 's/^nvidia //; s/[^a-z0-9]\+/-/g; s/-$//')
res=benchmarks/results/fidelity_${gpu:-gpu}
log=${OUT:-/tmp}/log.txt
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, ortools; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'ortools', ortools.__version__)"
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tail -8 | tee "$res.tests.txt"
    left=$((limit - (SECONDS - start) - 15))
    timeout "$left" python3 benchmarks/bench_fidelity.py --device cuda --out "$res" --keep /tmp/fidelity_keep "$@"
    echo "exit $?"
} 2>&1 | tee "$log"
if [ -n "${OUT:-}" ]; then
    cp "$res".* "$OUT"/ 2>/dev/null
    [ -d /tmp/fidelity_keep ] && tar czf "$OUT/keep.tgz" -C /tmp fidelity_keep
fi
exit 0
