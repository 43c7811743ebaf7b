#!/usr/bin/env bash
# Where a routing decision's time goes: `perf record` of `kvroute bench route`, the samples
# inside the timed `Router::handle_request` calls (not the untimed load set-up's) split by the
# part of the decision on their stack.
#
#   scripts/route-split.sh KVROUTE_BIN [bench route flags...]
#   e.g. scripts/route-split.sh target/release/kvroute --workers 256 --prompt-tokens 131072 --samples 6000
#
# Needs perf (cpu-clock samples are enough) and a binary with line tables (the release profile
# keeps them). Parts: hash (`prepare`: hashing, and in a build that feeds the index walk while
# hashing, that walk, counted apart as `index` when its frames are on the stack), index
# (`find_matches`/`MatchWalk`), active_depth (the per-worker active-set probes of the scan),
# scan_other (the rest of the scan and the policy), book (`commit`), other.
set -eu
BIN="$1"; shift
OUT="${OUT:-$(mktemp -d)}"
perf record -q -o "$OUT/perf.data" -g --call-graph=dwarf -F 2000 "$BIN" bench route "$@"
perf script -i "$OUT/perf.data" -F ip,sym 2>/dev/null > "$OUT/stacks.txt"
python3 - "$OUT/stacks.txt" <<'PY'
import collections, sys
stacks, cur = [], []
for line in open(sys.argv[1]):
    line = line.strip()
    if not line:
        if cur:
            stacks.append(cur)
        cur = []
        continue
    parts = line.split(None, 1)
    cur.append(parts[1] if len(parts) > 1 else parts[0])
if cur:
    stacks.append(cur)
parts, n = collections.Counter(), 0
for s in stacks:
    frames = list(reversed(s))  # outermost first
    at = [k for k, f in enumerate(frames) if 'handle_request' in f]
    # Only the timed decisions: those `run_case` makes, not the load `setup` routes first
    # (about a third of the calls at 256 workers and 2,000 samples).
    if not at or any('setup' in f for f in frames[:at[-1]]):
        continue
    n += 1
    below = ' | '.join(frames[at[-1] + 1:])
    if 'find_matches' in below or 'MatchWalk' in below or 'walk_one_word' in below:
        part = 'index'
    elif 'prepare' in below or 'hash_prompt' in below or 'hash_blocks' in below:
        part = 'hash'
    elif 'depth' in below and ('candidate' in below or 'scan' in below):
        part = 'active_depth'
    elif 'commit' in below or 'book' in below:
        part = 'book'
    elif 'choose' in below or 'scan' in below:
        part = 'scan_other'
    elif not below:
        # Code inlined into handle_request without inline frames: the fused hashing loop
        # (its xxh3 constants show in `perf annotate`).
        part = 'inlined'
    else:
        part = 'other'
    parts[part] += 1
print(f'{n} samples in Router::handle_request')
for part, v in parts.most_common():
    print(f'{part:13} {v:6} {100 * v / max(n, 1):5.1f}%')
PY
