//! The `--config` file decoder is a decoder of outside input: whatever text it is given, it
//! returns the options or a one-line error naming the line, and never panics. What it accepts
//! lays over itself unchanged (file, then the same options as flags), and the whole `serve`
//! pipeline (file, flags, defaults, checks) refuses what it cannot run with an error, never a
//! panic.

use kvroute::config::{layered, parse};
use kvroute::plan::PlanFile;
use kvroute::replay::ReplayConfig;
use kvroute::serve::{ServeArgs, ServeOptions};
use kvroute_planner::PlannerConfig;
use proptest::prelude::*;

/// Keys of `kvroute replay`, of `kvroute serve`, misspelt ones and snake_case ones.
const KEYS: &[&str] = &[
    "workers",
    "block-size",
    "rate",
    "seed",
    "policy",
    "trace",
    "format",
    "kv-loss",
    "arrival-speedup",
    "trace-block-size",
    "concurrency",
    "requests",
    "listen",
    "queue-capacity",
    "when-empty",
    "health-interval-ms",
    "max-prompt-tokens",
    "threads",
    "discover-dns",
    "discover-file",
    "discover-interval-ms",
    "discover-port",
    "session-header",
    "max-sessions",
    "block_size",
    "blok-size",
    "",
];

/// A TOML value: of every type, in range or not.
fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u64..100).prop_map(|n| n.to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        Just("18446744073709551616".to_owned()),
        Just("4294967296".to_owned()),
        any::<f64>().prop_map(|f| format!("{f:?}")),
        Just("nan".to_owned()),
        Just("-inf".to_owned()),
        Just("true".to_owned()),
        "[a-z0-9:./,-]{0,12}".prop_map(|s| format!("{s:?}")),
        Just("[\"kv\", \"round-robin\"]".to_owned()),
        Just("[1, \"a\"]".to_owned()),
        Just("{ a = 1 }".to_owned()),
        Just("1979-05-27T07:32:00Z".to_owned()),
        Just("'''two\nlines'''".to_owned()),
    ]
}

/// A line of a config file: a key and a value, a worker table, or anything.
fn line() -> impl Strategy<Value = String> {
    prop_oneof![
        6 => (prop::sample::select(KEYS), value()).prop_map(|(k, v)| format!("{k} = {v}")),
        1 => Just("[[worker]]".to_owned()),
        1 => (prop::sample::select(&["url", "dp", "max-requests", "role", "events", "nope"][..]), value())
            .prop_map(|(k, v)| format!("{k} = {v}")),
        1 => Just("[planner]".to_owned()),
        1 => "\\PC{0,30}",
    ]
}

/// A refusal: one line, naming where.
fn check_refusal(e: &anyhow::Error) -> Result<(), TestCaseError> {
    let message = format!("{e:#}");
    prop_assert!(message.starts_with("line "), "{}", message);
    prop_assert_eq!(message.lines().count(), 1, "{}", message);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_text_never_panics(text in "\\PC{0,200}") {
        if let Err(e) = parse::<ReplayConfig>(&text) { check_refusal(&e)?; }
        if let Err(e) = parse::<ServeOptions>(&text) { check_refusal(&e)?; }
        if let Err(e) = parse::<PlannerConfig>(&text) { check_refusal(&e)?; }
        if let Err(e) = parse::<PlanFile>(&text) { check_refusal(&e)?; }
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        // Files are read as UTF-8; what is not is refused by the read, before the decoder.
        let text = String::from_utf8_lossy(&bytes);
        let _ = parse::<ReplayConfig>(&text);
        let _ = parse::<ServeOptions>(&text);
    }

    #[test]
    fn config_files_are_read_or_refused_by_line(lines in prop::collection::vec(line(), 0..8)) {
        let text = lines.join("\n");
        // As flags over no file, the options read back the same (compared as text: NaN is a
        // value a file may give).
        match parse::<ReplayConfig>(&text) {
            Ok(c) => prop_assert_eq!(format!("{:?}", layered(None, &c).unwrap()), format!("{c:?}")),
            Err(e) => check_refusal(&e)?,
        }
        match parse::<ServeOptions>(&text) {
            Ok(c) => prop_assert_eq!(format!("{:?}", layered(None, &c).unwrap()), format!("{c:?}")),
            Err(e) => check_refusal(&e)?,
        }
    }
}

proptest! {
    // Each case writes a file.
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn the_serve_pipeline_refuses_without_panicking(lines in prop::collection::vec(line(), 0..8)) {
        let dir = kvroute_testkit::Scratch::new("config-fuzz");
        let path = dir.write("serve.toml", lines.join("\n"));
        let args = ServeArgs { config: Some(path.clone()), log_format: Default::default(), options: ServeOptions::default(), planner: Vec::new() };
        if let Err(e) = args.to_config() {
            let message = format!("{e:#}");
            prop_assert!(!message.is_empty());
        }
    }
}
