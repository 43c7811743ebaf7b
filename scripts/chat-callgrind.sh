#!/usr/bin/env bash
# User-space instructions per request of `kvroute serve` (callgrind; steady on a loaded machine) on
# long chat conversations: each of CONVERSATIONS conversations grows over TURNS turns to about
# TOKENS prompt tokens of the built-in tiny tokenizer (a token a byte), sent one request at a time
# to a `kvroute bench upstream`; a warm-up conversation excluded. Also prints the instructions a
# request spends in block hashing (`kvroute_core::hash`'s functions and its code inlined elsewhere).
#
#   scripts/chat-callgrind.sh KVROUTE_BIN [TOKENS] [TURNS] [CONVERSATIONS] [TAG]
#
# Needs valgrind (callgrind_control, callgrind_annotate), python3, curl. Prints one line.
set -eu
BIN="$1"; TOKENS="${2:-131072}"; TURNS="${3:-16}"; CONVS="${4:-4}"; TAG="${5:-chat}"
OUT="${OUT:-$(mktemp -d)}"; PORT="${PORT:-30191}"; UP="${UP_PORT:-30192}"; mkdir -p "$OUT"
"$BIN" bench upstream --port "$UP" --count 1 > "$OUT/upstream.log" 2>&1 & UPID=$!
valgrind --tool=callgrind --callgrind-out-file="$OUT/cg-$TAG.out" "$BIN" serve --threads 1 \
  --listen 127.0.0.1:$PORT --admin-listen 127.0.0.1:0 --approximate-tokenizer \
  --max-prompt-tokens $((TOKENS * 4)) --health-interval-ms 0 --worker "http://127.0.0.1:$UP" \
  > "$OUT/kvroute-$TAG.log" 2>&1 & KP=$!
trap 'kill $KP $UPID 2>/dev/null; wait $KP $UPID 2>/dev/null' EXIT
URL="http://127.0.0.1:$PORT/v1/chat/completions"
WARM='{"model":"tiny","messages":[{"role":"user","content":"warm up"}],"max_tokens":8}'
for _ in $(seq 1 300); do curl -sf -o /dev/null -H 'content-type: application/json' -d "$WARM" "$URL" && break; sleep 0.5; done
# Conversation C's turns, as a client sends them (the whole conversation each time), posted in order.
send() {
  python3 - "$URL" "$TOKENS" "$TURNS" "$@" <<'EOF'
import http.client, json, sys, urllib.parse
url, tokens, turns, convs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), [int(c) for c in sys.argv[4:]]
u = urllib.parse.urlparse(url)
words = ["routing ", "the ", "blocks ", "of ", "a ", "long ", "chat, ", "turn ", "by ", "turn; ", "cache ",
         "prefix ", "tokens ", "engine ", "worker. ", "Why? ", "Because ", "42 ", "fleets ", "grow\n"]
size = max(16, tokens // (2 * turns))
def text(c, seed):
    s, w = f"[{c}.{seed}] ", (seed * 2654435761 + c) % (1 << 64)
    while len(s) < size:
        s += words[w % len(words)]
        w = ((w * 6364136223846793005 + 1442695040888963407) % (1 << 64)) >> 7
    return s
conn, failed = http.client.HTTPConnection(u.hostname, u.port), 0
for c in convs:
    messages = [{"role": "system", "content": f"You are assistant {c}; answer briefly."}]
    for t in range(turns):
        messages.append({"role": "user", "content": text(c, 2 * t)})
        body = json.dumps({"model": "tiny", "messages": messages, "max_tokens": 8})
        conn.request("POST", u.path, body, {"content-type": "application/json"})
        r = conn.getresponse(); r.read(); failed += r.status != 200
        messages.append({"role": "assistant", "content": text(c, 2 * t + 1)})
print(failed)
EOF
}
send 1000000 > /dev/null
callgrind_control -z $KP > /dev/null
FAILED=$(send $(seq 1 "$CONVS"))
callgrind_control -d $KP > /dev/null; sleep 1
N=$((CONVS * TURNS))
IR=$(callgrind_annotate "$OUT/cg-$TAG.out.1" | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1; exit}')
# Exclusive costs of the hash module's functions and of its code inlined elsewhere.
HASH=$(callgrind_annotate --auto=no --threshold=100 --inclusive=no "$OUT/cg-$TAG.out.1" 2>/dev/null \
  | awk '/kvroute_core::hash::|kvroute-core\/src\/hash\.rs:/ {gsub(",", "", $1); s += $1} END {print s + 0}')
python3 -c "print('$TAG: %d requests (%s failed), %.0f Ir per request, %.0f of them in kvroute_core::hash' % ($N, '$FAILED', $IR / $N, $HASH / $N))"
