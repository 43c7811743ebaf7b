//! The trace readers are decoders of outside input (`kvroute replay --trace`, the live demo):
//! whatever bytes or rows they are given, they return a workload or a typed [`TraceError`]
//! (a parse error naming a line of the input), and never panic.

use kvroute_sim::trace::{TraceError, read_azure, read_mooncake, read_mooncake_tokens};
use proptest::prelude::*;

/// Trace block size of the Mooncake readers; engine block size.
const TBS: u32 = 16;
const BS: u32 = 16;

/// A number as JSON writes it: ordinary, negative, fractional, huge, or of the wrong type.
fn json_number() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u64..100_000).prop_map(|n| n.to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        any::<f64>()
            .prop_filter("JSON has no NaN or infinity", |f| f.is_finite())
            .prop_map(|f| format!("{f:e}")),
        Just("1e400".to_owned()),
        Just("18446744073709551616".to_owned()),
        Just("\"12\"".to_owned()),
        Just("null".to_owned()),
        Just("[]".to_owned()),
    ]
}

/// Mooncake rows: well-formed, with aliases, with fields missing or of the wrong type, or not
/// JSON at all.
fn mooncake_line() -> impl Strategy<Value = String> {
    let ids = prop::collection::vec(any::<u64>(), 0..8)
        .prop_map(|v| format!("[{}]", v.iter().map(u64::to_string).collect::<Vec<_>>().join(",")));
    prop_oneof![
        4 => (json_number(), json_number(), json_number(), ids.clone()).prop_map(|(t, i, o, h)| {
            format!(r#"{{"timestamp":{t},"input_length":{i},"output_length":{o},"hash_ids":{h}}}"#)
        }),
        2 => (0u32..1_000_000, 0u64..200, 0u64..100, ids.clone()).prop_map(|(t, i, o, h)| {
            format!(r#"{{"timestamp":{t},"input_length":{i},"output_length":{o},"hash_ids":{h}}}"#)
        }),
        1 => (0u32..1_000, 0u64..200, 0u64..100).prop_map(|(t, i, o)| {
            format!(r#"{{"created_time":{t},"input_tokens":{i},"output_tokens":{o}}}"#)
        }),
        1 => ids.prop_map(|h| format!(r#"{{"timestamp":1,"hash_ids":{h}}}"#)),
        1 => Just(r#"{"timestamp":1,"input_length":1,"output_length":1,"hash_ids":[-1]}"#.to_owned()),
        1 => Just(String::new()),
        1 => Just("{".to_owned()),
        1 => "\\PC{0,40}",
    ]
}

/// Azure rows: well-formed, with dates and times out of range, fields missing or not numbers,
/// or anything.
fn azure_line() -> impl Strategy<Value = String> {
    let int = prop_oneof![
        (0u64..100_000).prop_map(|n| n.to_string()),
        any::<i64>().prop_map(|n| n.to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
        Just("x".to_owned()),
    ];
    let stamp = prop_oneof![
        (
            2020i64..2030,
            1i64..13,
            1i64..29,
            0u64..24,
            0u64..60,
            0u64..60,
            "[0-9]{0,12}"
        )
            .prop_map(|(y, mo, d, h, mi, s, f)| format!("{y}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}.{f}")),
        (
            any::<i64>(),
            any::<i64>(),
            any::<i64>(),
            any::<u64>(),
            any::<u64>(),
            any::<u64>()
        )
            .prop_map(|(y, mo, d, h, mi, s)| format!("{y}-{mo}-{d}T{h}:{mi}:{s}")),
        "[0-9T:. -]{0,30}",
        "\\PC{0,20}",
    ];
    prop_oneof![
        // Context lengths stay small: each row's prompt is synthesized token by token.
        4 => (stamp.clone(), 0u32..5_000, int.clone()).prop_map(|(t, c, g)| format!("{t},{c},{g}")),
        2 => (stamp, int.clone(), int).prop_map(|(t, c, g)| format!("{t},{c},{g}")),
        1 => Just("TIMESTAMP,ContextTokens,GeneratedTokens".to_owned()),
        1 => Just(String::new()),
        1 => "\\PC{0,40}",
    ]
}

/// A refusal is a parse error naming a line of the input (or a failed read: bytes that are
/// not UTF-8).
fn check_refusal(e: &TraceError, lines: usize) -> Result<(), TestCaseError> {
    match e {
        TraceError::Parse { line, message } => {
            prop_assert!(
                (1..=lines.max(1)).contains(line),
                "line {line} of {lines}: {message}"
            );
            prop_assert!(!message.is_empty());
        }
        TraceError::Io(_) => {}
        other => prop_assert!(false, "unexpected error: {other}"),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let lines = bytes.split(|&b| b == b'\n').count();
        if let Err(e) = read_mooncake(bytes.as_slice(), TBS, BS, None) {
            check_refusal(&e, lines)?;
        }
        if let Err(e) = read_mooncake_tokens(bytes.as_slice(), TBS, None) {
            check_refusal(&e, lines)?;
        }
        if let Err(e) = read_azure(bytes.as_slice(), BS, None) {
            check_refusal(&e, lines)?;
        }
    }

    #[test]
    fn mooncake_rows_are_read_or_refused_by_line(rows in prop::collection::vec(mooncake_line(), 0..10)) {
        let text = rows.join("\n");
        match read_mooncake(text.as_bytes(), TBS, BS, None) {
            Ok(w) => {
                prop_assert!(w.requests.len() <= rows.len());
                // A prompt is cut at its hash ids' tokens.
                for r in &w.requests {
                    prop_assert!(r.prompt_tokens <= 8 * TBS);
                    prop_assert_eq!(r.locals.len(), (r.prompt_tokens / BS) as usize);
                }
                // The token reader takes the same rows, arrivals and lengths.
                let tokens = read_mooncake_tokens(text.as_bytes(), TBS, None).unwrap();
                prop_assert_eq!(tokens.len(), w.requests.len());
                for (t, r) in tokens.iter().zip(&w.requests) {
                    prop_assert_eq!(t.tokens.len(), r.prompt_tokens as usize);
                    prop_assert_eq!(t.output_tokens, r.output_tokens);
                }
            }
            Err(e) => {
                check_refusal(&e, rows.len())?;
                prop_assert!(read_mooncake_tokens(text.as_bytes(), TBS, None).is_err());
            }
        }
    }

    #[test]
    fn azure_rows_are_read_or_refused_by_line(rows in prop::collection::vec(azure_line(), 0..10)) {
        let text = rows.join("\n");
        match read_azure(text.as_bytes(), BS, None) {
            Ok(w) => prop_assert!(w.requests.len() <= rows.len()),
            Err(e) => check_refusal(&e, rows.len())?,
        }
    }
}

#[test]
fn dates_out_of_range_are_refused_by_line() {
    for row in [
        "99999999999999999-01-01 00:00:00,5,5",
        "2023-13-01 00:00:00,5,5",
        "2023-01-01 99999999999999999999:00:00,5,5",
        "2023-01-01 18446744073709551615:00:00,5,5",
        "9999-12-31 23:59:59,5,5",
        "-9223372036854775808-01-01 00:00:00,5,5",
    ] {
        let text = format!("TIMESTAMP,ContextTokens,GeneratedTokens\n{row}\n");
        match read_azure(text.as_bytes(), BS, None) {
            Err(TraceError::Parse { line: 2, message }) => assert_eq!(message, "bad timestamp", "{row}"),
            other => panic!("{row}: {other:?}"),
        }
    }
}
