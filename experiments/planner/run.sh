#!/bin/sh
# Re-runs the Planner experiments of EXPERIMENTS.md; reports go to $OUT (default /tmp/planner-exp).
# Usage (from the repository root, after `cargo build --release`): experiments/planner/run.sh
set -eu
K=${K:-target/release/kvroute}
D=${D:-../shared/data}
E=experiments/planner
OUT=${OUT:-/tmp/planner-exp}
mkdir -p "$OUT"
CONV=$D/mooncake_conversation_trace.jsonl.gz
SYN=$D/mooncake_synthetic_trace.jsonl.gz
RAMP=0:0.5,1200:3
DIURNAL=0:0.25,600:3,1200:0.25,1800:3,2400:0.25
for shape in ramp diurnal; do
  if [ $shape = ramp ]; then P=$RAMP; else P=$DIURNAL; fi
  for s in 0 30 60 120; do
    $K replay $CONV --workers 2 --planner $E/agg-startup-$s.toml --rate-profile $P --report-json $OUT/$shape-planner-startup-$s.json > /dev/null 2>&1
  done
  for n in 4 5 6 8; do
    $K replay $CONV --workers $n --planner $E/static-$n.toml --rate-profile $P --report-json $OUT/$shape-static-$n.json > /dev/null 2>&1
  done
done
for v in kv nokv; do
  for blocks in 16384 65536; do
    $K replay $SYN --prefill-workers 2 --decode-workers 2 --num-blocks $blocks --planner $E/disagg-$v.toml --report-json $OUT/syn-$blocks-both-$v.json > /dev/null 2>&1
    $K replay $SYN --prefill-workers 2 --decode-workers 2 --num-blocks $blocks --planner $E/disagg-throughput-$v.toml --report-json $OUT/syn-$blocks-throughput-$v.json > /dev/null 2>&1
  done
done
for shape in ramp diurnal; do
  python3 $E/summarize.py $OUT/$shape-planner-startup-30.json $OUT/$shape-static-*.json
  python3 $E/summarize.py $OUT/$shape-planner-startup-*.json
done
python3 $E/summarize.py $OUT/syn-*.json
