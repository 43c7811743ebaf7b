#!/usr/bin/env python3
"""EXPERIMENTS.md's "Is `kv` the best policy everywhere?" tables from `kvroute replay --report-json`
files named WORKLOAD-NOISE.json (one object per policy, under its spec). Each `kv` spec is set
against the best of the other policies (those not `kv`)."""
import json
import sys

METRICS = [("p90_ttft_ms", "TTFT p90"), ("median_e2e_latency_ms", "E2E p50")]
REUSE = "prefix_cache_reused_ratio"

runs = [(p.rsplit("/", 1)[-1].removesuffix(".json"), json.load(open(p))) for p in sys.argv[1:]]


def is_kv(p):
    return p == "kv" or p.startswith("kv:")


print("| workload, noise | kv spec | TTFT p90 | best other (policy) | gap | E2E p50 | best other (policy) | gap "
      "| reuse | most reuse (policy) |")
print("| --- " * 10 + "|")
for name, r in runs:
    pol = {k: v for k, v in r.items() if k != "provenance"}
    others = [p for p in pol if not is_kv(p)]
    for kv in (p for p in pol if is_kv(p)):
        cells = []
        for key, _ in METRICS:
            best = min(others, key=lambda p: pol[p][key])
            gap = 100 * (pol[kv][key] / pol[best][key] - 1)
            cells.append(f"{pol[kv][key]:.1f} | {pol[best][key]:.1f} ({best}) | {gap:+.1f} %")
        most = max(others, key=lambda p: pol[p][REUSE])
        print(f"| {name} | {kv} | " + " | ".join(cells) + f" | {pol[kv][REUSE]:.3f} | {pol[most][REUSE]:.3f} ({most}) |")

# Every policy: reuse against queueing (TTFT) and E2E, per workload.
for name, r in runs:
    print(f"\n{name}:\n")
    print("| policy | TTFT mean | p90 | E2E p50 | reuse (engine) | overlap (router) | preempt |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for p, x in r.items():
        if p == "provenance":
            continue
        print(f"| {p} | {x['mean_ttft_ms']:.1f} | {x['p90_ttft_ms']:.1f} | {x['median_e2e_latency_ms']:.1f} "
              f"| {x[REUSE]:.3f} | {x['router_predicted_overlap_ratio']:.3f} | {x.get('preemptions', 0)} |")
