#!/usr/bin/env python3
"""The tables of EXPERIMENTS.md's noise section from `kvroute replay --report-json` files (one per noise)."""
import json
import sys

runs = [(p.rsplit("/", 1)[-1].removesuffix(".json"), json.load(open(p))) for p in sys.argv[1:]]

print("| noise | policy | req/s | out tok/s | TTFT mean | p90 | p99 | ITL mean | E2E p50 | E2E p99 | imbalance |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for name, r in runs:
    for policy, x in r.items():
        if policy == "provenance":
            continue
        print(
            f"| {name} | {policy} | {x['request_throughput_rps']:.1f} | {x['output_throughput_tok_s']:.0f} "
            f"| {x['mean_ttft_ms']:.1f} | {x['p90_ttft_ms']:.1f} | {x['p99_ttft_ms']:.1f} | {x['mean_itl_ms']:.1f} "
            f"| {x['median_e2e_latency_ms']:.1f} | {x['p99_e2e_latency_ms']:.1f} | {x['load_imbalance']:.3f} |"
        )

print()
P = ["dynamo:full", "dynamo:staged", "kv", "least-loaded", "round-robin"]
print("| noise | " + " | ".join(f"{p} req/s" for p in P)
      + " | staged vs full | staged vs least-loaded | TTFT mean full / staged / least-loaded |")
print("| --- " * (len(P) + 4) + "|")
for name, r in runs:
    rps = [r[p]["request_throughput_rps"] for p in P]
    ttft = [r[p]["mean_ttft_ms"] for p in ("dynamo:full", "dynamo:staged", "least-loaded")]
    print(
        f"| {name} | " + " | ".join(f"{x:.0f}" for x in rps)
        + f" | {100 * (rps[1] / rps[0] - 1):+.1f} % | {100 * (rps[1] / rps[3] - 1):+.1f} % "
        f"| {ttft[0]:.0f} / {ttft[1]:.0f} / {ttft[2]:.0f} |"
    )
