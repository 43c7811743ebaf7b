//! The `kvroute` binary on bad input, and the provenance of its reports: every impossible input
//! exits non-zero at once with one line that names the flag (or the file's key or line), and a
//! report JSON says which version, configuration, seed and trace made it.

use std::process::{Command, Output};

use kvroute_testkit::Scratch;

/// Runs `kvroute` with `args`.
fn kvroute(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .output()
        .expect("running kvroute")
}

/// A fresh scratch directory for one test, removed when it is dropped.
fn scratch(name: &str) -> Scratch {
    Scratch::new(&format!("cli-{name}"))
}

/// `kvroute args` fails with exactly one line on stderr that contains every one of `needles`.
#[track_caller]
fn refused(args: &[&str], needles: &[&str]) {
    let out = kvroute(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{args:?} succeeded: {stderr}");
    assert_ne!(out.status.code(), None, "{args:?} died of a signal: {stderr}");
    assert_eq!(
        stderr.trim_end().lines().count(),
        1,
        "{args:?}: not one line:\n{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    for needle in needles {
        assert!(stderr.contains(needle), "{args:?}: {needle:?} not in {stderr:?}");
    }
    assert!(out.stdout.is_empty(), "{args:?} did work before refusing");
}

#[test]
fn synthetic_rates_must_be_positive_numbers() {
    refused(
        &["replay", "--format", "synthetic", "--rate", "0"],
        &["--rate", "positive"],
    );
    refused(
        &["replay", "--format", "synthetic", "--rate", "NaN"],
        &["--rate", "NaN"],
    );
    refused(&["replay", "--format", "synthetic", "--rate=-3"], &["--rate"]);
    refused(
        &["replay", "--format", "synthetic", "--arrival-cv", "0"],
        &["--arrival-cv"],
    );
    refused(
        &["replay", "--format", "synthetic", "--requests", "0"],
        &["--requests"],
    );
    refused(&["replay", "--format", "synthetic", "--turns", "0"], &["--turns"]);
    refused(&["replay", "--format", "synthetic", "--isl", "0"], &["--isl"]);
    refused(
        &["replay", "--format", "synthetic", "--osl", "512-64"],
        &["--osl"],
    );
}

#[test]
fn noise_flags_are_checked_and_named() {
    refused(
        &["replay", "--isl-spread", "normal:0.1"],
        &["--isl-spread", "uniform, lognormal"],
    );
    refused(
        &["replay", "--osl-spread", "uniform:1"],
        &["--osl-spread", "uniform spread 1"],
    );
    refused(
        &["replay", "--step-jitter", "lognormal"],
        &["--step-jitter", "KIND:AMOUNT"],
    );
    refused(
        &["replay", "--step-jitter", "lognormal:-1"],
        &["--step-jitter", "sigma"],
    );
    refused(&["replay", "--worker-speed", "1,0,1"], &["--worker-speed"]);
    refused(&["replay", "--worker-speed", "uniform:x"], &["--worker-speed"]);
    refused(&["replay", "--http-latency-ms", "0"], &["--http-latency-ms"]);
    refused(
        &["replay", "--http-jitter", "lognormal:0.5"],
        &["--http-jitter", "--http-latency-ms"],
    );
}

#[test]
fn speedups_and_limits_must_be_positive() {
    refused(&["replay", "--arrival-speedup", "0"], &["--arrival-speedup"]);
    refused(&["replay", "--arrival-speedup", "inf"], &["--arrival-speedup"]);
    refused(&["replay", "--engine-speedup=-1"], &["--engine-speedup"]);
    refused(&["replay", "--limit", "0"], &["--limit"]);
    refused(&["replay", "--workers", "0"], &["--workers"]);
    refused(&["replay", "--concurrency", "0"], &["--concurrency"]);
    refused(&["replay", "--block-size", "0"], &["--block-size"]);
    refused(&["replay", "--trace-block-size", "0"], &["--trace-block-size"]);
    refused(&["replay", "--kv-loss", "1.5"], &["--kv-loss"]);
    refused(&["replay", "--kv-lag-ms=-1"], &["--kv-lag-ms"]);
    refused(&["replay", "--replicas", "0"], &["--replicas"]);
    refused(&["replay", "--sync", "maybe"], &["--sync"]);
    refused(&["replay", "--sync-loss", "0.1"], &["--sync-loss", "--sync on"]);
    refused(
        &["replay", "--sync", "on", "--sync-loss", "1.5"],
        &["--sync-loss"],
    );
    refused(
        &["replay", "--sync", "on", "--sync-delay-ms=-1"],
        &["--sync-delay-ms"],
    );
    refused(&["replay", "--replica-spread", "sticky"], &["--replica-spread"]);
    refused(
        &["replay", "--replica-fail-s", "5"],
        &["--replica-fail-s", "--replicas 2"],
    );
    refused(
        &["replay", "--replicas", "2", "--replica-join-s=-1"],
        &["--replica-join-s"],
    );
    refused(
        &[
            "replay",
            "--replicas",
            "2",
            "--replica-join-s",
            "9",
            "--replica-fail-s",
            "3",
        ],
        &["leaves none"],
    );
    refused(&["replay", "--policy", "kv:spread=-1"], &["spread_tolerance"]);
    refused(&["replay", "--kv-transfer-gbps", "0"], &["--kv-transfer-gbps"]);
    refused(
        &["replay", "--kv-bytes-per-token", "0"],
        &["--kv-bytes-per-token"],
    );
    refused(
        &["replay", "--busy-requests-fraction", "NaN"],
        &["--busy-requests-fraction"],
    );
    refused(
        &["replay", "--prefill-workers", "2"],
        &["--prefill-workers", "--decode-workers"],
    );
    refused(&["replay", "--rate-profile", "0:1,0:2"], &["--rate-profile"]);
    refused(&["replay", "--multiply", "0"], &["--multiply"]);
    refused(
        &["replay", "--sla-window-s", "60"],
        &["--sla-window-s", "--planner"],
    );
    refused(&["demo", "--speedup", "0"], &["--speedup"]);
    refused(&["demo", "--limit", "0"], &["--limit"]);
    refused(&["mock", "--speedup", "NaN"], &["--speedup"]);
    refused(&["bench", "serve", "--seconds", "0"], &["--seconds"]);
}

#[test]
fn synthetic_options_need_the_synthetic_format() {
    refused(
        &["replay", "--requests", "10"],
        &["--requests", "--format synthetic"],
    );
    refused(&["replay", "--isl", "100"], &["--isl", "--format synthetic"]);
    refused(&["replay", "--format", "synthetic", "--limit", "5"], &["--limit"]);
    refused(
        &["replay", "--format", "synthetic", "some.jsonl"],
        &["--format synthetic"],
    );
    refused(&["replay", "--format", "parquet"], &["--format"]);
}

#[test]
fn every_policy_is_known_before_any_runs() {
    refused(&["replay", "--policy", "kv,nosuch"], &["--policy", "nosuch"]);
    refused(&["replay", "--policy", "kv:bogus"], &["--policy", "bogus"]);
    refused(&["replay", "--policy", "kv,kv"], &["--policy", "twice"]);
}

#[test]
fn a_refused_option_value_is_named_once() {
    let args = ["replay", "--policy", "kv:temperature=-1"];
    refused(&args, &["temperature = -1 is out of range"]);
    let stderr = String::from_utf8_lossy(&kvroute(&args).stderr).into_owned();
    assert_eq!(stderr.matches("temperature = -1").count(), 1, "{stderr}");
}

#[test]
fn bench_counts_must_be_at_least_one() {
    refused(&["bench", "route", "--workers", "0"], &["--workers"]);
    refused(&["bench", "route", "--workers", "16,0"], &["--workers"]);
    refused(&["bench", "route", "--samples", "0"], &["--samples"]);
    refused(&["bench", "hash", "--block-size", "0"], &["--block-size"]);
    refused(
        &["bench", "hash", "--block-size", "4294967296"],
        &["--block-size"],
    );
    refused(&["bench", "index", "--reps", "0"], &["--reps"]);
}

#[test]
fn values_past_u32_are_refused_not_truncated() {
    refused(&["replay", "--block-size", "4294967296"], &["--block-size"]);
    refused(&["serve", "--block-size", "4294967296"], &["--block-size"]);
    refused(&["mock", "--dp", "4294967296"], &["--dp"]);
    refused(
        &["serve", "--worker", "http://127.0.0.1:1,dp=4294967296"],
        &["--worker", "dp="],
    );
    refused(
        &["serve", "--worker", "http://127.0.0.1:1,block-size=4294967312"],
        &["--worker", "block-size="],
    );
}

#[test]
fn ports_past_65535_are_named() {
    refused(
        &["serve", "--listen", "127.0.0.1:70000"],
        &["--listen", "70000", "65535"],
    );
    refused(&["mock", "--port", "70000"], &["--port", "70000"]);
    refused(
        &["mock", "--port", "65534", "--workers", "4"],
        &["--port", "65535"],
    );
    refused(
        &["mock", "--event-port", "65530", "--workers", "4"],
        &["--event-port", "65535"],
    );
    refused(
        &[
            "serve",
            "--worker",
            "http://127.0.0.1:1,role=prefill,bootstrap-port=70000",
        ],
        &["--worker", "bootstrap-port"],
    );
}

#[test]
fn a_trace_row_before_the_first_is_an_error_naming_its_line() {
    let dir = scratch("early-row");
    let trace = dir.join("trace.jsonl");
    std::fs::write(
        &trace,
        "{\"timestamp\": 100, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [1]}\n\
         {\"timestamp\": 50, \"input_length\": 10, \"output_length\": 2, \"hash_ids\": [2]}\n",
    )
    .unwrap();
    refused(
        &["replay", trace.to_str().unwrap()],
        &["line 2", "before the first row"],
    );
    let csv = dir.join("trace.csv");
    std::fs::write(
        &csv,
        "TIMESTAMP,ContextTokens,GeneratedTokens\n\
         2023-11-16 18:15:46.6805900,374,44\n\
         2023-11-16 18:15:45.0000000,396,109\n",
    )
    .unwrap();
    refused(
        &["replay", csv.to_str().unwrap()],
        &["line 3", "before the first row"],
    );
}

#[test]
fn config_files_name_unknown_keys_and_wrong_types() {
    let dir = scratch("config");
    let file = |name: &str, text: &str| {
        let path = dir.join(name);
        std::fs::write(&path, text).expect("a config file");
        path.to_str().expect("a UTF-8 path").to_owned()
    };
    let unknown = file("unknown.toml", "workers = 4\nblock_size = 64\n");
    refused(&["replay", "--config", &unknown], &["line 2", "block_size"]);
    let wrong = file("wrong.toml", "workers = \"four\"\n");
    refused(&["replay", "--config", &wrong], &["line 1", "`workers`"]);
    let bad_value = file("bad.toml", "arrival-speedup = 0.0\n");
    refused(&["replay", "--config", &bad_value], &["--arrival-speedup"]);
    let serve = file("serve.toml", "queue_capacity = 4\n");
    refused(&["serve", "--config", &serve], &["queue_capacity"]);
    let worker = file(
        "worker.toml",
        "[[worker]]\nurl = \"http://127.0.0.1:1\"\ndp_size = 2\n",
    );
    refused(&["serve", "--config", &worker], &["dp_size"]);
}

#[test]
fn a_report_names_its_version_config_seed_and_trace() {
    let dir = scratch("provenance");
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/mooncake_30.jsonl");
    let config = dir.join("replay.toml");
    std::fs::write(&config, "workers = 3\nseed = 7\nblock-size = 32\n").unwrap();
    let report = dir.join("report.json");
    let out = kvroute(&[
        "replay",
        trace,
        "--config",
        config.to_str().unwrap(),
        "--seed",
        "9",
        "--report-json",
        report.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(json["num_workers"], 3);
    let p = &json["provenance"];
    assert_eq!(p["kvroute_version"], env!("CARGO_PKG_VERSION"));
    assert!(p["git_commit"].is_null() || p["git_commit"].as_str().is_some_and(|c| c.len() == 40));
    // The flag beat the file; the file's other keys stayed.
    assert_eq!(p["seed"], 9);
    assert_eq!(p["config"]["seed"], 9);
    assert_eq!(p["config"]["workers"], 3);
    assert_eq!(p["config"]["block-size"], 32);
    assert_eq!(p["trace"]["name"], trace);
    // `sha256sum tests/data/mooncake_30.jsonl`, computed when the fixture was made.
    assert_eq!(
        p["trace"]["sha256"],
        "4cd7c6ddfc29d4e771383628c02e12063797eac2eb2390c8d7f99dcd46566f8c"
    );
}

#[test]
fn reports_are_byte_identical_across_runs() {
    let dir = scratch("determinism");
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/mooncake_30.jsonl");
    let run = |name: &str| {
        let path = dir.join(name);
        let out = kvroute(&[
            "replay",
            trace,
            "--workers",
            "2",
            "--policy",
            "kv,round-robin",
            "--report-json",
            path.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        std::fs::read(path).unwrap()
    };
    assert_eq!(run("a.json"), run("b.json"));
}

#[test]
fn model_and_hardware_flags_are_checked_and_named() {
    let base = ["replay", "--limit", "5"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> { base.iter().chain(extra).copied().collect() };
    refused(&with(&["--tp", "0"]), &["--tp"]);
    refused(
        &with(&["--model", "llama-3.1-8b", "--gpu-memory-utilization", "1.5"]),
        &["--gpu-memory-utilization", "1.5"],
    );
    refused(&with(&["--model", "gpt-9"]), &["--model gpt-9", "llama-3.1-8b"]);
    refused(
        &with(&["--model", "llama-3.1-8b", "--gpu", "b200"]),
        &["--gpu b200", "a100-sxm-40gb"],
    );
    refused(&with(&["--gpu", "h100"]), &["--gpu", "--model"]);
    refused(
        &with(&["--timing", "roofline"]),
        &["--timing roofline", "--model"],
    );
    refused(&with(&["--timing", "table"]), &["--timing table:FILE"]);
    refused(
        &with(&["--timing", "/no/such/timing.toml"]),
        &["--timing /no/such/timing.toml"],
    );
    refused(&with(&["--kv-blocks", "0"]), &["--num-blocks"]);
    refused(
        &with(&["--model", "llama-3.1-70b", "--gpu", "A100-40GB", "--tp", "2"]),
        &["llama-3.1-70b on 2 x a100-sxm-40gb", "no room"],
    );
    let dir = scratch("bad-timing");
    let bad = dir.join("timing.toml");
    std::fs::write(&bad, "kind = \"roofline\"\n").unwrap();
    refused(
        &["replay", "--limit", "5", "--timing", bad.to_str().unwrap()],
        &["--timing", "timing.toml"],
    );
}

#[test]
fn slo_and_sweep_flags_are_checked_and_named() {
    refused(&["replay", "--slo", "ttft-p42=5"], &["--slo", "ttft-p42=5"]);
    refused(&["replay", "--slo", "ttft-p90=0ms"], &["--slo"]);
    refused(&["replay", "--sweep", "workers=0..3"], &["--sweep"]);
    refused(&["replay", "--sweep", "workers=5..3"], &["--sweep", "above"]);
    refused(&["replay", "--sweep", "replicas=1..3"], &["--sweep"]);
    refused(
        &["replay", "--sweep", "workers=1..3", "--workers", "4"],
        &["--sweep", "--workers"],
    );
    refused(
        &["replay", "--sweep", "workers=1,2", "--policy", "kv,random"],
        &["--sweep", "--policy"],
    );
}

/// The report's keys of each run of a `--report-json` file with several runs, by name.
fn runs_of(path: &std::path::Path) -> serde_json::Map<String, serde_json::Value> {
    let bytes = std::fs::read(path).expect("the report");
    let v: serde_json::Value = serde_json::from_slice(&bytes).expect("JSON");
    let mut runs = v.as_object().expect("an object").clone();
    runs.remove("provenance");
    runs
}

/// A sweep's verdict is the first size meeting the SLO, recomputed from its own report; its
/// runs, made at once on every core, are the same as run again.
#[test]
fn a_sweep_names_the_first_fleet_size_that_meets_the_slo() {
    let dir = scratch("sweep");
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/mooncake_30.jsonl");
    let sweep = |name: &str, slo: Option<&str>| {
        let path = dir.join(name);
        let mut args = vec![
            "replay",
            trace,
            "--arrival-speedup",
            "20",
            "--sweep",
            "workers=1..4",
            "--report-json",
            path.to_str().unwrap(),
        ];
        if let Some(slo) = slo {
            args.extend(["--slo", slo]);
        }
        let out = kvroute(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        (String::from_utf8(out.stdout).unwrap(), runs_of(&path))
    };
    let (_, plain) = sweep("plain.json", None);
    let p90 = |r: &serde_json::Value| r["p90_ttft_ms"].as_f64().unwrap();
    let names: Vec<String> = (1..=4).map(|n| format!("workers={n}")).collect();
    assert_eq!(plain.keys().cloned().collect::<Vec<_>>(), names);
    // A bound between the best and the worst p90, so some sizes meet it and some do not.
    let (lo, hi) = plain
        .values()
        .map(p90)
        .fold((f64::INFINITY, 0.0_f64), |(lo, hi), v| (lo.min(v), hi.max(v)));
    assert!(lo < hi, "the sweep's sizes all gave a TTFT p90 of {lo}");
    let limit = (lo + hi) / 2.0;
    let (stdout, judged) = sweep("judged.json", Some(&format!("ttft-p90={limit}ms")));
    let first = names.iter().find(|n| {
        let r = &judged[n.as_str()];
        p90(r) <= limit && r["rejected_requests"] == 0 && r["unfinished_requests"] == 0
    });
    let expected = match first {
        Some(n) => {
            let workers = &n["workers=".len()..];
            format!("smallest fleet meeting the SLO: {workers} workers ({workers} GPUs)")
        }
        None => "no fleet size tried meets the SLO".to_owned(),
    };
    assert!(
        stdout.lines().any(|l| l == expected),
        "{expected:?} not in\n{stdout}"
    );
    for n in &names {
        let r = &judged[n.as_str()];
        let met = p90(r) <= limit && r["rejected_requests"] == 0 && r["unfinished_requests"] == 0;
        assert_eq!(r["slo_met"], if met { "yes" } else { "no" }, "{n}");
        // The verdict aside, the parallel runs are the plain ones.
        let mut r = judged[n.as_str()].as_object().unwrap().clone();
        r.remove("slo");
        r.remove("slo_met");
        assert_eq!(serde_json::Value::Object(r), plain[n.as_str()], "{n}");
    }
}

/// `--model` (a config.json), `--gpu` (an alias) and `--tp`: the engine's blocks are what the
/// deployment fits, GPU-hours count every GPU, and each request's record has its cached tokens
/// and its waits.
#[test]
fn a_model_from_its_config_json_sizes_the_engine_and_gpu_hours_count_tp() {
    use kvroute_engine::capacity::{Deployment, PassLimits};
    let dir = scratch("model");
    let trace = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/mooncake_30.jsonl");
    let config_json = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../kvroute-engine/tests/data/hf/qwen3-8b.config.json"
    );
    let (report, requests) = (dir.join("r.json"), dir.join("r.jsonl"));
    let out = kvroute(&[
        "replay",
        trace,
        "--workers",
        "2",
        "--model",
        config_json,
        "--gpu",
        "H100-80GB",
        "--tp",
        "2",
        "--report-json",
        report.to_str().unwrap(),
        "--per-request-jsonl",
        requests.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let model = kvroute_engine::ModelSpec::builtin("qwen3-8b").unwrap();
    let gpu = kvroute_engine::GpuSpec::builtin("h100-sxm").unwrap();
    let blocks = Deployment {
        model: &model,
        gpu: &gpu,
        tensor_parallel: 2,
        gpu_memory_utilization: 0.9,
    }
    .kv_blocks(PassLimits {
        block_size: 64,
        max_num_batched_tokens: 8192,
        max_num_seqs: 256,
    })
    .unwrap();
    assert!(
        stderr.contains(&format!(
            "engine: qwen3-8b on 2 x h100-sxm, {blocks} KV blocks of 64 tokens"
        )),
        "{stderr}"
    );
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&report).unwrap()).unwrap();
    let (gpu_hours, worker_s) = (
        r["gpu_hours"].as_f64().unwrap(),
        r["worker_seconds"].as_f64().unwrap(),
    );
    assert!(
        (gpu_hours - worker_s * 2.0 / 3600.0).abs() < 1e-9,
        "{gpu_hours} {worker_s}"
    );
    assert_eq!(r["provenance"]["config"]["tp"], 2);
    let text = std::fs::read_to_string(&requests).unwrap();
    let mut cached = 0;
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        if v["outcome"] != "completed" {
            continue;
        }
        let ms = |k: &str| v[k].as_f64().unwrap_or_else(|| panic!("{k} in {line}"));
        assert!(
            (ms("queue_ms") - ms("router_queue_ms") - ms("engine_queue_ms")).abs() < 1e-6,
            "{line}"
        );
        assert!(ms("queue_ms") <= ms("ttft_ms"), "{line}");
        let c = v["cached_tokens"].as_u64().unwrap();
        assert!(c < v["input_tokens"].as_u64().unwrap(), "{line}");
        cached += c;
    }
    // The engines' total, from the report, is the sum of the first admissions' hits here (no
    // preemption on an idle two-worker fleet).
    assert_eq!(r["preemptions"], 0);
    let reuse = r["prefix_cache_reused_ratio"].as_f64().unwrap();
    let input = r["total_input_tokens"].as_f64().unwrap();
    assert!(
        (cached as f64 / input - reuse).abs() < 1e-9,
        "{cached} / {input} vs {reuse}"
    );
}

#[test]
fn a_synthetic_workload_of_seed_zero_is_the_default_one() {
    let dir = scratch("seed-zero");
    let records = |name: &str, seed: &[&str]| {
        let path = dir.join(name);
        let mut args = vec![
            "replay",
            "--format",
            "synthetic",
            "--requests",
            "40",
            "--workers",
            "2",
            "--per-request-jsonl",
            path.to_str().unwrap(),
        ];
        args.extend_from_slice(seed);
        let out = kvroute(&args);
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        std::fs::read_to_string(&path).unwrap()
    };
    let default = records("default.jsonl", &[]);
    assert_eq!(default.lines().count(), 40);
    assert_eq!(records("zero.jsonl", &["--seed", "0"]), default);
    assert_ne!(records("one.jsonl", &["--seed", "1"]), default);
}
