//! `kvroute validate` and `kvroute calibrate` from outside: a small runs folder in the repo
//! (`tests/data/validate/`), bad input refused by name, and the shipped calibration set where
//! `../shared` sits beside the checkout (skipped, saying so, elsewhere).

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn kvroute() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/validate")
}

/// Runs `validate --json` with `extra` arguments; returns the per-run objects and the summary.
fn validate_json(runs: &Path, extra: &[&str]) -> (Vec<Value>, Value) {
    let out = kvroute()
        .arg("validate")
        .arg(runs)
        .arg("--json")
        .args(extra)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let mut lines: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let summary = lines.pop().unwrap();
    assert_eq!(summary["summary"], true, "the summary comes last");
    (lines, summary)
}

#[test]
fn validate_simulates_what_it_can_and_names_why_it_cannot_the_rest() {
    let (runs, summary) = validate_json(&fixture().join("runs.csv"), &["--max-stage-secs", "60"]);
    assert_eq!(runs.len(), 5);
    assert_eq!(summary["runs"], 5);
    assert_eq!(summary["runs_simulated"], 3);
    assert_eq!(summary["runs_not_simulated"], 2);
    let by_id = |id: &str| runs.iter().find(|r| r["run_id"] == id).unwrap();
    let gpu = by_id("made-up-unknown-gpu");
    assert_eq!(gpu["status"], "not_simulated");
    assert!(gpu["reason"].as_str().unwrap().contains("TPU-v5"), "{gpu}");
    let model = by_id("made-up-missing-model");
    assert!(
        model["reason"].as_str().unwrap().contains("models.csv"),
        "{model}"
    );
    for r in runs.iter().filter(|r| r["status"] == "simulated") {
        for m in [
            "ttft_mean_ape",
            "ttft_p90_ape",
            "e2e_mean_ape",
            "e2e_p90_ape",
            "itl_ape",
        ] {
            assert!(r[m].as_f64().unwrap().is_finite(), "{m}: {r}");
        }
        assert_eq!(r["completed"], r["requests"], "{r}");
    }
    for m in ["median_e2e_mean_ape", "median_ttft_mean_ape", "median_itl_ape"] {
        assert!(summary[m].as_f64().unwrap().is_finite(), "{m}: {summary}");
    }
    // The same input gives the same output.
    assert_eq!(
        validate_json(&fixture().join("runs.csv"), &["--max-stage-secs", "60"]).1,
        summary
    );
}

#[test]
fn bad_input_is_refused_naming_the_file_line_and_field() {
    let dir = kvroute_testkit::Scratch::new("validate");
    for f in ["models.csv", "workload_profiles.csv"] {
        std::fs::copy(fixture().join(f), dir.join(f)).unwrap();
    }
    let good = std::fs::read_to_string(fixture().join("runs.csv")).unwrap();
    let cases = [
        (
            good.replacen(",H100-80GB,4,", ",H100-80GB,four,", 1),
            "runs.csv line 3: tp \"four\"",
        ),
        (
            good.replacen(",2.5x600;6x600,", ",2.5x600;6,", 1),
            "rate stage \"6\"",
        ),
        (
            good.replacen(",53.7,", ",,", 1),
            "runs.csv line 3: ttft_mean_ms is empty",
        ),
        (
            good.replacen("e2e_mean_ms", "e2e_mean", 1),
            "no column \"e2e_mean_ms\"",
        ),
    ];
    for (text, expected) in cases {
        std::fs::write(dir.join("runs.csv"), text).unwrap();
        let out = kvroute()
            .arg("validate")
            .arg(dir.join("runs.csv"))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{expected}");
        assert!(stderr.contains(expected), "expected {expected:?} in {stderr}");
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    std::fs::write(dir.join("runs.csv"), &good).unwrap();
    let models = std::fs::read_to_string(fixture().join("models.csv")).unwrap();
    std::fs::write(
        dir.join("models.csv"),
        models.replacen(",32,4096,", ",32,40x96,", 1),
    )
    .unwrap();
    let out = kvroute()
        .arg("validate")
        .arg(dir.join("runs.csv"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("models.csv line 2"), "{stderr}");
    let out = kvroute()
        .args(["validate", "--model-file"])
        .arg(dir.join("models.csv"))
        .arg(dir.join("runs.csv"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("model file"));
}

/// The shipped calibration set, where `../shared` exists: every run is simulated (stages cut
/// short, so the test stays quick), the summary has its keys and finite medians.
#[test]
fn validate_runs_on_the_shared_calibration_set() {
    let runs =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/data/real-vllm/calibration_runs.csv");
    if !runs.exists() {
        eprintln!("skipped: {} is not there", runs.display());
        return;
    }
    let (rows, summary) = validate_json(&runs, &["--max-stage-secs", "10"]);
    assert_eq!(summary["runs"].as_u64().unwrap() as usize, rows.len());
    assert_eq!(summary["runs_not_simulated"], 0, "{summary}");
    assert!(
        summary["runs_saturated_excluded"].as_u64().unwrap() >= 3,
        "{summary}"
    );
    for m in ["median_e2e_mean_ape", "median_ttft_mean_ape", "median_itl_ape"] {
        assert!(summary[m].as_f64().unwrap().is_finite(), "{m}: {summary}");
    }
}

#[test]
fn calibrate_writes_a_model_file_that_validate_reads() {
    let dir = kvroute_testkit::Scratch::new("calibrate");
    for (from, to) in [
        ("runs.csv", "calibration_runs.csv"),
        ("models.csv", "models.csv"),
        ("workload_profiles.csv", "workload_profiles.csv"),
    ] {
        std::fs::copy(fixture().join(from), dir.join(to)).unwrap();
    }
    let model = dir.join("model.toml");
    let out = kvroute()
        .arg("calibrate")
        .arg(dir.path())
        .arg("--out")
        .arg(&model)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&model).unwrap();
    assert!(text.contains("kind = \"calibrated\""), "{text}");
    let model_arg = model.to_str().unwrap();
    let (_, summary) = validate_json(
        &dir.join("calibration_runs.csv"),
        &["--model-file", model_arg, "--max-stage-secs", "60"],
    );
    assert_eq!(summary["runs_simulated"], 3);
}
