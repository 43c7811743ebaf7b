#!/bin/sh
# Re-runs "Which noise lets the staged decode cost beat the plain KV cost?" of EXPERIMENTS.md:
# Dynamo's staged-cost benchmark (synthetic, ISL 256, OSL 32, no shared prefix, 8 workers,
# 1,024 in flight) under five policies, with each noise alone and all together.
# Usage (from the repository root, after `cargo build --release -p kvroute`):
#   experiments/noise/run.sh            # REQUESTS=50000 by default
# Reports go to $OUT (default /tmp/noise-exp); the table to stdout.
set -eu
K=${K:-target/release/kvroute}
OUT=${OUT:-/tmp/noise-exp}
REQUESTS=${REQUESTS:-50000}
mkdir -p "$OUT"
POLICIES=dynamo:full,dynamo:staged,kv,least-loaded,round-robin
run() {
  name=$1
  shift
  $K replay --format synthetic --requests "$REQUESTS" --isl 256 --osl 32 --prefix-groups 0 \
    --concurrency 1024 --workers 8 --policy $POLICIES --report-json "$OUT/$name.json" "$@" > /dev/null 2>&1
}
run off
run isl --isl-spread lognormal:0.5
run isl-0.1 --isl-spread lognormal:0.1
run osl --osl-spread lognormal:0.5
run osl-0.1 --osl-spread lognormal:0.1
run jitter --step-jitter lognormal:0.2
run jitter-0.02 --step-jitter lognormal:0.02
run speed --worker-speed uniform:0.25
run speed-0.05 --worker-speed uniform:0.05
run http --http-latency-ms 5 --http-jitter lognormal:0.5
run http-5ms-fixed --http-latency-ms 5
run kv-lag --kv-lag-ms 20
run all-but-osl --isl-spread lognormal:0.5 --step-jitter lognormal:0.2 --worker-speed uniform:0.25 \
  --http-latency-ms 5 --http-jitter lognormal:0.5 --kv-lag-ms 20
run all --isl-spread lognormal:0.5 --osl-spread lognormal:0.5 --step-jitter lognormal:0.2 \
  --worker-speed uniform:0.25 --http-latency-ms 5 --http-jitter lognormal:0.5 --kv-lag-ms 20
cd "$OUT"
python3 "$OLDPWD/experiments/noise/summarize.py" off.json isl.json isl-0.1.json osl.json osl-0.1.json jitter.json \
  jitter-0.02.json speed.json speed-0.05.json http.json http-5ms-fixed.json kv-lag.json all-but-osl.json all.json
