#!/usr/bin/env bash
# The closed loop a user runs, through the CLI, with every file kept: profile and probe on DEVICE,
# Harmony's plan, calibrate on it, plan again (ours and the baselines) on the calibrated hardware, then
# run each plan with a trace (ours twice, first and last; Harmony's uncalibrated plan too), each run
# ending with its simulated and measured step and busy time by kind of work.
#   experiments/gpu/closed_loop.sh DEVICE MODEL CAP_BYTES [--set KEY=VALUE ...]
# Files in /tmp/closed_loop, packed into ${OUT:-/tmp}/closed_loop.tgz (experiments/results/gpu/closed_loop_h200.md).
set -u
if [ $# -lt 3 ]; then
    echo "experiments/gpu/closed_loop.sh: error: give DEVICE (cpu or cuda), MODEL and CAP_BYTES, then any --set KEY=VALUE" >&2
    exit 2
fi
DEV=$1; M=$2; CAP=$3; shift 3; SETS="$*"
cd "$(dirname "$0")/../.."
. experiments/gpu/env.sh
D=/tmp/closed_loop; mkdir -p $D
H="python3 -m harmony_opt.cli"
t0=$SECONDS
$H profile $M $SETS --device $DEV -u 1,2,4,8 -o $D/prof --no-progress > $D/profile.log 2>&1 || tail -3 $D/profile.log
$H probe --device $DEV -o $D/hw.json > $D/probe.log 2>&1 || tail -3 $D/probe.log
echo "profile+probe $((SECONDS-t0)) s"
$H baseline --planner harmony --profile $D/prof --hardware $D/hw.json --batch 8 --memory-cap $CAP -o $D/harmony.json > $D/harmony.log 2>&1 || tail -3 $D/harmony.log
$H calibrate $D/harmony.json --model $M $SETS --device $DEV --steps 9 --no-progress -o $D/cal.json > $D/cal.log 2>&1; tail -30 $D/cal.log
$H plan --profile $D/prof --hardware $D/cal.json --batch 8 --memory-cap $CAP --time-limit 10 -o $D/ours.json > $D/ours.log 2>&1 || tail -3 $D/ours.log
for b in harmony l2l naive-swap; do $H baseline --planner $b --profile $D/prof --hardware $D/cal.json --batch 8 --memory-cap $CAP -o $D/c_$b.json > $D/c_$b.log 2>&1 || tail -2 $D/c_$b.log; done
echo "plans $((SECONDS-t0)) s"
for x in ours c_harmony c_l2l c_naive-swap harmony ours; do
  [ -f $D/$x.json ] || continue
  k=$x.$SECONDS
  $H run $D/$x.json --model $M $SETS --device $DEV --steps 8 --no-progress --trace $D/run_$k.trace.json > $D/run_$k.log 2>&1
  echo "== $x"; grep -v "^$" $D/run_$k.log | tail -14
done
echo "all $((SECONDS-t0)) s"
tar czf ${OUT:-/tmp}/closed_loop.tgz -C /tmp closed_loop
