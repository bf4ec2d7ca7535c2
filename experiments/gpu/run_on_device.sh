#!/usr/bin/env bash
# Run the GPU experiment on a GPU machine in one command, within a time limit, resumable.
#
#   experiments/gpu/run_on_device.sh [SECONDS] [extra arguments of python -m experiments.gpu]
#
# Installs the wheels in .whl/ when there are any (ortools, DeepSpeed and their needs, for a
# machine without a package index), runs the CUDA tests, then the experiment's stages until
# SECONDS (default 540) are nearly spent; what is done is kept, so the same command again goes
# on where it stopped. With $OUT set (the device tool), the results are packed into
# $OUT/results.tgz and the log into $OUT/log.txt.
set -u
limit=${1:-540}; shift || true
start=$SECONDS
cd "$(dirname "$0")/../.."
. experiments/gpu/env.sh
log=${OUT:-/tmp}/log.txt
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, ortools; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'ortools', ortools.__version__)"
    if [ ! -e experiments/results/gpu/tests.txt ]; then
        mkdir -p experiments/results/gpu
        python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_executor.py tests/test_profiler.py 2>&1 \
            | tail -5 | tee experiments/results/gpu/tests.txt
    fi
    left=$((limit - (SECONDS - start) - 20))
    timeout "$left" python3 -m experiments.gpu --stages probe,profile,plan,correct "$@"
    left=$((limit - (SECONDS - start) - 20))
    [ "$left" -gt 30 ] && timeout "$left" python3 -m experiments.gpu --stages train "$@"
    python3 -m experiments.gpu --stages report "$@"
} 2>&1 | tee "$log"
if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/results.tgz" profiles/hardware profiles/h100 profiles/h200 experiments/results/gpu \
        experiments/results/gpu_* 2>/dev/null
fi
