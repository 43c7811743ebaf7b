//! The op-stream reader is a decoder of outside input: whatever bytes it is given, it returns a
//! stream or an error naming the line, and never panics.

use std::io::Cursor;

use kvroute::opstream::OpStream;
use proptest::prelude::*;

const HEADER: &str = r#"{"format":"kv-opstream","version":1,"workers":2,"block_size":16}"#;

/// Lines that are valid, nearly valid, or valid JSON of the wrong shape.
fn line() -> impl Strategy<Value = String> {
    let n = any::<u64>().prop_map(|v| v.to_string());
    prop_oneof![
        (0u32..4, n.clone()).prop_map(|(w, h)| format!(
            r#"{{"op":"store","w":{w},"parent":null,"local":[{h}],"ext":[{h}]}}"#
        )),
        (0u32..4, n.clone()).prop_map(|(w, h)| format!(r#"{{"op":"remove","w":{w},"ext":[{h}]}}"#)),
        (0u32..4).prop_map(|w| format!(r#"{{"op":"clear","w":{w}}}"#)),
        (n.clone(), "[a-z0-9\"-]{0,6}")
            .prop_map(|(h, k)| format!(r#"{{"op":"match","local":[{h}],"expect":{{"{k}":1}}}}"#)),
        n.clone()
            .prop_map(|h| format!(r#"{{"op":"store","w":0,"local":[{h},{h}],"ext":[{h}]}}"#)),
        n.prop_map(|h| format!(r#"{{"op":"teleport","w":{h}}}"#)),
        Just(r#"{"op":"store","w":-1,"local":[1],"ext":[1]}"#.to_owned()),
        Just(r#"{"op":"match","local":[18446744073709551616],"expect":{}}"#.to_owned()),
        Just("[]".to_owned()),
        Just("{".to_owned()),
        "\\PC{0,40}",
    ]
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = OpStream::parse(Cursor::new(bytes));
    }

    #[test]
    fn arbitrary_lines_never_panic(lines in proptest::collection::vec(line(), 0..12)) {
        let text = std::iter::once(HEADER.to_owned()).chain(lines.iter().cloned()).collect::<Vec<_>>().join("\n");
        match OpStream::parse(Cursor::new(text)) {
            Ok(stream) => prop_assert!(stream.ops.len() <= lines.len()),
            // A refused stream names the line at fault.
            Err(e) => prop_assert!(format!("{e:#}").contains("line "), "error without a line: {e:#}"),
        }
    }
}

#[test]
fn bad_inputs_name_what_is_wrong() {
    let cases = [
        ("", "empty op-stream"),
        (
            r#"{"format":"other","version":1,"workers":1,"block_size":1}"#,
            "expected format kv-opstream",
        ),
        (
            &format!("{HEADER}\n{{\"op\":\"store\",\"w\":0,\"local\":[1,2],\"ext\":[1]}}"),
            "2 local and 1 ext",
        ),
        (&format!("{HEADER}\n{{\"op\":\"warp\"}}"), "unknown op \"warp\""),
        (
            &format!("{HEADER}\n{{\"op\":\"match\",\"local\":[1],\"expect\":{{\"x\":1}}}}"),
            "not a worker id",
        ),
        (&format!("{HEADER}\n{{\"op\":\"clear\"}}"), "clear needs a worker"),
    ];
    for (text, want) in cases {
        let err = OpStream::parse(Cursor::new(text.to_owned())).expect_err(text);
        let msg = format!("{err:#}");
        assert!(msg.contains(want), "{text:?}: {msg:?} does not mention {want:?}");
    }
}
