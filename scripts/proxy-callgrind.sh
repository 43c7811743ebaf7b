#!/usr/bin/env bash
# User-space instructions per request of `kvroute serve` (callgrind; steady on a loaded machine)
# in front of N proxybench mock workers, at concurrency 64, warm-up excluded.
#
#   scripts/proxy-callgrind.sh KVROUTE_BIN WORKERS stream|unary REQUESTS [TAG]
#
# Needs MOCKWORKER (proxybench's mock, release), OHA, valgrind. Prints one line: Ir per request.
set -eu
BIN="$1"; N="$2"; MODE="$3"; NREQ="$4"; TAG="${5:-$MODE-w$N}"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PB="${PROXYBENCH:-$ROOT/../shared/bench/proxybench}"
MODEL_DIR="${MODEL_DIR:-$ROOT/crates/kvroute-http/tests/data/tiny-model}"
OHA="${OHA:-oha}"; OUT="${OUT:-$(mktemp -d)}"; PORT="${PORT:-30091}"; mkdir -p "$OUT"
body="$PB/bodies/chat_nostream.json"; [ "$MODE" = stream ] && body="$PB/bodies/chat_stream.json"
"$MOCKWORKER" --ports "$(seq -s, 9301 $((9300 + N)))" --threads 1 > "$OUT/mock.log" 2>&1 & MP=$!
W=""; for p in $(seq 9301 $((9300 + N))); do W="$W --worker http://127.0.0.1:$p"; done
valgrind --tool=callgrind --callgrind-out-file="$OUT/cg-$TAG.out" "$BIN" serve --threads 1 \
  --listen 127.0.0.1:$PORT --admin-listen 127.0.0.1:0 --cache approximate --model-dir "$MODEL_DIR" \
  --health-interval-ms 0 $W > "$OUT/kvroute-$TAG.log" 2>&1 & KP=$!
trap 'kill $KP $MP 2>/dev/null; wait $KP $MP 2>/dev/null' EXIT
URL="http://127.0.0.1:$PORT/v1/chat/completions"
for _ in $(seq 1 300); do curl -sf -o /dev/null -H 'content-type: application/json' --data-binary @"$body" "$URL" && break; sleep 0.5; done
load() { "$OHA" --no-tui -n "$1" -c 64 -m POST -T application/json -D "$body" --output-format json "$URL"; }
load 200 > /dev/null 2>&1
callgrind_control -z $KP > /dev/null
load "$NREQ" > "$OUT/oha-$TAG.json" 2>/dev/null
callgrind_control -d $KP > /dev/null; sleep 1
IR=$(callgrind_annotate "$OUT/cg-$TAG.out.1" | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1; exit}')
python3 -c "import json,sys; d=json.load(open('$OUT/oha-$TAG.json')); c=d.get('statusCodeDistribution') or {}; n=sum(c.values())
print('$TAG: %d requests %s, %.0f Ir per request' % (n, c, $IR / max(n, 1)))"
