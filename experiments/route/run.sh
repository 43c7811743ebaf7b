#!/bin/sh
# Re-runs "Is `kv` the best policy everywhere?" of EXPERIMENTS.md: every policy on each routing
# workload of that file (the Mooncake conversation and synthetic traces, the overloaded
# generated sessions, the small-cache case, the staged-cost benchmark), noise off and on.
# Usage (from the repository root, after `cargo build --release -p kvroute`):
#   experiments/route/run.sh                 # every workload
#   WORKLOADS="small conv" experiments/route/run.sh
# Reports go to $OUT (default /tmp/route-exp); the tables to stdout. Needs ../shared/data.
set -eu
K=${K:-target/release/kvroute}
D=${D:-../shared/data}
OUT=${OUT:-/tmp/route-exp}
P=${P:-round-robin,random,least-loaded,power-of-two,kv,kv:stall=0,dynamo,sglang-cache-aware,llmd-weighted}
WORKLOADS=${WORKLOADS:-conv msyn gen small staged}
NOISE="--step-jitter lognormal:0.05 --worker-speed uniform:0.05 --isl-spread lognormal:0.2 \
--http-latency-ms 2 --http-jitter lognormal:0.5"
mkdir -p "$OUT"
args() {
  case $1 in
    conv) echo "$D/mooncake_conversation_trace.jsonl.gz --workers 16" ;;
    msyn) echo "$D/mooncake_synthetic_trace.jsonl.gz --workers 16" ;;
    gen) echo "--format synthetic --requests 20000 --rate 40 --turns 3 --think-ms 3000 --workers 16" ;;
    small) echo "$D/mooncake_conversation_trace.jsonl.gz --limit 300 --workers 4 --block-size 16 --num-blocks 16384" ;;
    staged) echo "--format synthetic --requests 50000 --isl 256 --osl 32 --prefix-groups 0 --concurrency 1024 --workers 8" ;;
  esac
}
files=""
for w in $WORKLOADS; do
  for noise in off on; do
    extra=""
    [ "$noise" = on ] && extra=$NOISE
    # shellcheck disable=SC2046
    $K replay $(args "$w") --policy "$P" $extra --report-json "$OUT/$w-$noise.json" > /dev/null 2>&1
    files="$files $OUT/$w-$noise.json"
  done
done
python3 "$(dirname "$0")/summarize.py" $files
