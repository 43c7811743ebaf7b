//! The `kvroute` binary on bad input, and the provenance of its reports: every impossible input
//! exits non-zero at once with one line that names the flag (or the file's key or line), and a
//! report JSON says which version, configuration, seed and trace made it.

use std::path::PathBuf;
use std::process::{Command, Output};

/// Runs `kvroute` with `args`.
fn kvroute(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .output()
        .expect("running kvroute")
}

/// A fresh scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvroute-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
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
