//! `kvroute tune` on a tiny in-repo trace: deterministic, its pick the lowest score of its own
//! table, each candidate's figures those `kvroute replay` gives for the same spec, and bad
//! options refused by name.

use std::process::{Command, Output};

const TRACE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/mooncake_30.jsonl");

fn kvroute(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
        .args(args)
        .output()
        .expect("running kvroute")
}

/// The ranked rows of tune's table: (policy, metric values, score).
fn rows(stdout: &str) -> Vec<(String, Vec<f64>, f64)> {
    stdout
        .lines()
        .skip(1)
        .take_while(|l| !l.starts_with("best:"))
        .map(|l| {
            let cells: Vec<&str> = l.split_whitespace().collect();
            let numbers: Vec<f64> = cells[2..].iter().map(|c| c.parse().expect("a number")).collect();
            let (score, values) = numbers.split_last().expect("a score");
            (cells[1].to_owned(), values.to_vec(), *score)
        })
        .collect()
}

#[test]
fn tune_is_deterministic_picks_its_lowest_score_and_scores_what_replay_reports() {
    let args = [
        "tune",
        TRACE,
        "--workers",
        "4",
        "--grid",
        "scale=1,16",
        "--grid",
        "evict=0,16",
    ];
    let first = kvroute(&args);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let again = kvroute(&args);
    assert_eq!(first.stdout, again.stdout, "the same options gave another table");
    let stdout = String::from_utf8(first.stdout).expect("UTF-8");
    let rows = rows(&stdout);
    assert_eq!(rows.len(), 4, "{stdout}");
    assert!(
        rows.windows(2).all(|w| w[0].2 <= w[1].2),
        "not ranked by score: {stdout}"
    );
    // Each metric's best candidate scores 1 on it, so every score is at least the metric count.
    assert!(rows.iter().all(|r| r.2 >= 2.0 - 1e-9), "{stdout}");
    let best = stdout
        .lines()
        .find_map(|l| l.strip_prefix("best: "))
        .expect("a best line");
    assert_eq!(best, rows[0].0);
    assert!(
        stdout.contains(&format!("kvroute serve --policy {best}")),
        "{stdout}"
    );

    // The pick, replayed: the same figures as in tune's table.
    let dir = kvroute_testkit::Scratch::new("tune");
    let json = dir.join("report.json");
    let replay = kvroute(&[
        "replay",
        TRACE,
        "--workers",
        "4",
        "--policy",
        best,
        "--report-json",
        json.to_str().expect("a path"),
    ]);
    assert!(
        replay.status.success(),
        "{}",
        String::from_utf8_lossy(&replay.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json).expect("the report")).expect("JSON");
    let run = report.as_object().and_then(|o| o.get(best)).unwrap_or(&report);
    for (key, tuned) in ["p90_ttft_ms", "median_e2e_latency_ms"].iter().zip(&rows[0].1) {
        let replayed = run[key].as_f64().expect("a number");
        assert!(
            (replayed - tuned).abs() < 1e-3 + 1e-6 * replayed.abs(),
            "{key}: replay {replayed}, tune {tuned}"
        );
    }
}

#[test]
fn bad_tune_options_are_refused_by_name() {
    for (args, needle) in [
        (vec!["tune", TRACE, "--grid", "scale"], "--grid"),
        (vec!["tune", TRACE, "--grid", "scale=1,"], "empty value"),
        (vec!["tune", TRACE], "--grid"),
        (
            vec!["tune", TRACE, "--policy", "kv,dynamo", "--grid", "scale=1"],
            "--policy",
        ),
        (vec!["tune", TRACE, "--grid", "nonsense=1"], "nonsense"),
        (
            vec!["tune", TRACE, "--grid", "scale=1", "--objective", "no_such_key"],
            "no_such_key",
        ),
        (
            vec!["tune", TRACE, "--grid", "scale=1", "--samples", "0"],
            "--samples",
        ),
    ] {
        let out = kvroute(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
        assert!(stderr.contains(needle), "{args:?}: {needle:?} not in {stderr}");
        assert!(
            !String::from_utf8_lossy(&out.stdout).contains("best:"),
            "{args:?} picked a policy"
        );
    }
}
