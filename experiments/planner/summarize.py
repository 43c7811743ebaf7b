#!/usr/bin/env python3
"""One table row per report JSON of a `kvroute replay --planner` run (EXPERIMENTS.md, Planner)."""
import json
import sys

print("| run | SLA windows met | GPU-hours | mean workers | prefill mean | decode mean | TTFT mean | p90 | p99 | TPOT mean | decisions | windows missed (start s: TTFT ms / ITL ms) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for path in sys.argv[1:]:
    r = json.load(open(path))
    p = r["planner"]
    dur = r["duration_ms"] / 1e3

    def pool_mean(pool):
        s = sum(
            max(0.0, min(w["removed_s"] if w["removed_s"] is not None else dur, dur) - w["provisioned_s"])
            for w in p["workers"]
            if w["pool"] == pool
        )
        return "-" if s == 0 else f"{s / dur:.2f}"

    missed = ", ".join(
        f"{w['start_s']:.0f}: {w['mean_ttft_ms'] or 0:.0f} / {w['mean_itl_ms'] or 0:.1f}"
        for w in p["windows"]
        if w["arrived"] > 0 and not w["met"]
    )
    print(
        f"| {path.rsplit('/', 1)[-1].removesuffix('.json')} | {r['sla_windows_met']}/{r['sla_windows']} "
        f"({100 * r['sla_attainment']:.0f}%) | {r['gpu_hours']:.3f} | {r['planner_mean_workers']:.2f} "
        f"| {pool_mean('prefill')} | {pool_mean('decode')} | {r['mean_ttft_ms']:.0f} | {r['p90_ttft_ms']:.0f} "
        f"| {r['p99_ttft_ms']:.0f} | {r['mean_tpot_ms']:.1f} | {r['planner_decisions']} | {missed or '-'} |"
    )
