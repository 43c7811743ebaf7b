"""How robust are the planner's decisions on the demo's ramp to noise the simulator can add?

Replays the ramp of `kvroute demo --planner` (the first 1,000 rows of the example trace, the
demo's rate profile, its planner file or another) once without noise, then under each noise
with seeds 1..N, and prints a Markdown table: in how many runs every scaling decision had the
noise-free run's direction and GPU-hours stayed within 10 %, and the spread of GPU-hours.

Usage, from the repository root after `cargo build --release`:
    python3 experiments/planner/robustness.py [N] [PLAN.toml ...]
(default: 20 seeds, the demo's own planner file).
"""

import json
import os
import subprocess
import sys
import tempfile

K = os.environ.get("K", "target/release/kvroute")
RAMP = "0:0.3,60:0.3,90:2,150:2,180:0.3"
NOISES = [
    ("none (seeds only)", []),
    ("HTTP 5 ms, jitter lognormal 0.5", ["--http-latency-ms", "5", "--http-jitter", "lognormal:0.5"]),
    ("HTTP 30 ms, jitter lognormal 0.5", ["--http-latency-ms", "30", "--http-jitter", "lognormal:0.5"]),
    ("step jitter lognormal 0.05", ["--step-jitter", "lognormal:0.05"]),
    ("step jitter lognormal 0.2", ["--step-jitter", "lognormal:0.2"]),
    ("worker speed uniform 0.05", ["--worker-speed", "uniform:0.05"]),
    ("worker speed uniform 0.2", ["--worker-speed", "uniform:0.2"]),
    ("the three, small", ["--http-latency-ms", "5", "--http-jitter", "lognormal:0.5",
                          "--step-jitter", "lognormal:0.05", "--worker-speed", "uniform:0.05"]),
    ("the three, large", ["--http-latency-ms", "30", "--http-jitter", "lognormal:0.5",
                          "--step-jitter", "lognormal:0.2", "--worker-speed", "uniform:0.2"]),
]


def run(plan, extra, seed, out):
    subprocess.run(
        [K, "replay", "--limit", "1000", "--rate-profile", RAMP, "--planner", plan,
         "--planner-observe", "router", "--workers", "1", "--seed", str(seed),
         "--report-json", out] + extra,
        check=True, capture_output=True)
    with open(out) as f:
        report = json.load(f)
    steps = [(c["to"] > c["from"], d["at_s"]) for d in report["planner"]["decisions"] for c in d["changes"]]
    return report["gpu_hours"], steps


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    plans = sys.argv[2:] or ["crates/kvroute/src/demo/planner.toml"]
    out = os.path.join(tempfile.mkdtemp(), "report.json")
    for plan in plans:
        gpu0, steps0 = run(plan, [], 0, out)
        shown = " ".join(f"{'+' if up else '-'}1@{at:.0f}" for up, at in steps0)
        print(f"\n{plan}: without noise {gpu0:.3f} GPU-hours, {shown}\n")
        print("| noise | same directions, GPU-hours within 10 % | GPU-hours against no noise |")
        print("| --- | --- | --- |")
        for name, extra in NOISES:
            same, devs = 0, []
            for seed in range(1, n + 1):
                gpu, steps = run(plan, extra, seed, out)
                dev = gpu / gpu0 - 1
                same += [u for u, _ in steps] == [u for u, _ in steps0] and abs(dev) <= 0.10
                devs.append(dev)
            print(f"| {name} | {same}/{n} | {min(devs):+.1%} to {max(devs):+.1%} |")


if __name__ == "__main__":
    main()
