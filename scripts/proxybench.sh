#!/usr/bin/env bash
# kvroute side by side with sglang-router (cache_aware) in proxybench (../shared/bench/proxybench):
# ROUNDS interleaved rounds (kvroute, then sglang-router), each one run.sh pass over CONCURRENCIES x
# STREAMS; results in $OUTDIR/results.jsonl, a table via summarize.py. Other run.sh knobs (DURATION,
# WORKER_PORTS, PIN, ...) pass through the environment.
#
#   scripts/proxybench.sh ROUNDS OUTDIR [kvroute|sglang|both]
#
# Needs: KVROUTE (release binary), MOCKWORKER (proxybench's mock, built release), OHA, SGLANG_ROUTER
# (sglang-router 0.3.2's launcher), NODELAY (proxybench/nodelay's shim, built; sglang-router leaves
# Nagle on), MODEL_DIR (a local tokenizer directory both routers read).
set -eu
ROUNDS="${1:?usage: proxybench.sh ROUNDS OUTDIR [kvroute|sglang|both]}"
export OUTDIR="${2:?usage: proxybench.sh ROUNDS OUTDIR [kvroute|sglang|both]}"
WHO="${3:-both}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PB="${PROXYBENCH:-$ROOT/../shared/bench/proxybench}"
KVROUTE="${KVROUTE:-$ROOT/target/release/kvroute}"
SGLANG_ROUTER="${SGLANG_ROUTER:-sglang-router}"
NODELAY="${NODELAY:-$PB/nodelay/libnodelay.so}"
MODEL_DIR="${MODEL_DIR:-$ROOT/crates/kvroute-http/tests/data/tiny-model}"
export CONCURRENCIES="${CONCURRENCIES:-16 64}" DURATION="${DURATION:-15s}"
KV="$KVROUTE serve --listen 127.0.0.1:{PORT} --admin-listen 127.0.0.1:0 --cache approximate \
--model-dir $MODEL_DIR --health-interval-ms 0 \$(for u in {WORKER_URLS}; do echo --worker \$u; done)"
SGL="HF_HUB_OFFLINE=1 LD_PRELOAD=$NODELAY $SGLANG_ROUTER launch --host 127.0.0.1 --port {PORT} \
--worker-urls {WORKER_URLS} --model-path $MODEL_DIR --tokenizer-path $MODEL_DIR --policy cache_aware \
--log-level warn"
for r in $(seq 1 "$ROUNDS"); do
  [ "$WHO" = sglang ] || "$PB/run.sh" "kvroute-r$r" "$KV"
  [ "$WHO" = kvroute ] || "$PB/run.sh" "sglang-r$r" "$SGL"
  echo "round $r done; load average: $(cut -d' ' -f1-3 /proc/loadavg)" >&2
done
