//! What the proxy reads of a worker's answer on its way: a unary body gathered whole, or a
//! stream of server-sent events read event by event for its last usage and its error events,
//! with the usage-only chunk taken out when the proxy asked for it itself.

use std::sync::LazyLock;

use bytes::Bytes;
use kvroute_http::openai::types::Usage;
use memchr::memmem::Finder;

use super::MAX_SCANNED;
use super::skim::ChunkView;
use crate::outcome::CachedReport;

/// What is read of a body for its usage.
pub(super) enum Scan {
    /// Nothing (an error answer, or a body too large to read).
    Off,
    /// A unary body, gathered whole.
    Unary(Vec<u8>),
    /// A stream, event by event.
    Stream(SseScan),
}

impl Scan {
    /// Takes a frame's bytes; returns what goes to the client.
    pub(super) fn feed(&mut self, data: Bytes) -> Bytes {
        match self {
            Self::Off => data,
            Self::Unary(buf) => {
                if buf.len() + data.len() > MAX_SCANNED {
                    *self = Self::Off;
                } else {
                    buf.extend_from_slice(&data);
                }
                data
            }
            Self::Stream(sse) => sse.feed(data),
        }
    }

    /// The body ended: what is left to hand out.
    pub(super) fn finish(&mut self) -> Option<Bytes> {
        match self {
            Self::Stream(sse) => sse.finish(),
            Self::Off | Self::Unary(_) => None,
        }
    }

    /// Whether what goes to the client may be shorter than what the worker sent (a stream
    /// whose usage-only chunk is taken out).
    pub(super) fn shortens(&self) -> bool {
        matches!(self, Self::Stream(sse) if sse.strip_usage)
    }

    /// Whether a stream passed its `data: [DONE]`.
    pub(super) fn done(&self) -> bool {
        matches!(self, Self::Stream(sse) if sse.seen.done)
    }

    /// Whether a stream carried an error event.
    pub(super) fn error_event(&self) -> bool {
        matches!(self, Self::Stream(sse) if sse.seen.error_event)
    }

    /// The body's usage (a stream's last), if it had one.
    pub(super) fn usage(&self) -> Option<Usage> {
        match self {
            Self::Off => None,
            Self::Unary(buf) => serde_json::from_slice::<UsageOnly>(buf)
                .ok()
                .and_then(|u| u.usage),
            Self::Stream(sse) => sse.seen.usage.clone(),
        }
    }

    /// Whether the answer came as a stream of chunks.
    pub(super) fn streamed(&self) -> bool {
        matches!(self, Self::Stream(_))
    }
}

/// A unary answer as far as its usage: the rest of the body is skipped, not built (a body
/// whose `usage` is not one reads as none, as in [`ChunkView::usage`]).
#[derive(serde::Deserialize)]
struct UsageOnly {
    #[serde(default)]
    usage: Option<Usage>,
}

/// What `usage` says of cached prompt tokens.
pub fn cached_report(usage: Option<&Usage>) -> CachedReport {
    match usage {
        None => CachedReport::NoUsage,
        Some(u) => match u.prompt_tokens_details.as_ref().and_then(|d| d.cached_tokens) {
            Some(tokens) => CachedReport::Reported(u64::from(tokens)),
            None => CachedReport::Absent,
        },
    }
}

/// Reads a stream of server-sent events (`data: <json>\n\n`) for its last usage and its
/// error events, and takes out the usage-only chunk when asked to. Without stripping, frames
/// pass on as they came; with it, only whole events pass (the proxy holds back a partial one
/// until its end arrives). A frame of whole events is read where it lies and, unless an event
/// is taken out of it, passed on as it came (no copy); only an event cut across frames is
/// gathered.
pub(super) struct SseScan {
    strip_usage: bool,
    /// The start of an event whose end has not arrived.
    partial: Vec<u8>,
    /// What the events said.
    seen: Seen,
    /// An event grew past [`MAX_SCANNED`]: the rest passes unread.
    overflowed: bool,
}

/// What a stream's events said so far.
#[derive(Default)]
struct Seen {
    /// The last usage seen.
    usage: Option<Usage>,
    /// An event of the form `data: {"error": ...}` passed.
    error_event: bool,
    /// `data: [DONE]`, the stream's last event, passed.
    done: bool,
}

impl SseScan {
    pub(super) fn new(strip_usage: bool) -> Self {
        Self {
            strip_usage,
            partial: Vec::new(),
            seen: Seen::default(),
            overflowed: false,
        }
    }

    fn feed(&mut self, data: Bytes) -> Bytes {
        if self.overflowed {
            return data;
        }
        if self.partial.is_empty() {
            // The common case: the frame starts with an event.
            let (end, kept) = self.events(&data);
            if end == data.len() || data.len() - end > MAX_SCANNED {
                // The frame ends with an event; or what is left of it is past reading (it
                // passes on, and so does the rest of the stream).
                self.overflowed = end < data.len();
                return match kept {
                    Kept::All => data,
                    Kept::Some(mut out) => {
                        out.extend_from_slice(&data[end..]);
                        Bytes::from(out)
                    }
                };
            }
            self.partial.extend_from_slice(&data[end..]);
            return match (self.strip_usage, kept) {
                (false, _) => data,
                (true, Kept::All) => data.slice(..end),
                (true, Kept::Some(out)) => Bytes::from(out),
            };
        }
        self.partial.extend_from_slice(&data);
        let buf = std::mem::take(&mut self.partial);
        let (end, kept) = self.events(&buf);
        let out = match kept {
            _ if !self.strip_usage => Bytes::new(),
            Kept::All => Bytes::copy_from_slice(&buf[..end]),
            Kept::Some(out) => Bytes::from(out),
        };
        self.partial = buf;
        self.partial.drain(..end);
        if self.partial.len() > MAX_SCANNED {
            self.overflowed = true;
            let rest = std::mem::take(&mut self.partial);
            if self.strip_usage {
                return [out, Bytes::from(rest)].concat().into();
            }
        }
        if self.strip_usage { out } else { data }
    }

    /// Reads the whole events at the start of `buf`: where the last one ends, and which of
    /// them go on to the client.
    fn events(&mut self, buf: &[u8]) -> (usize, Kept) {
        let mut kept = Kept::All;
        let mut start = 0;
        while let Some(len) = event_len(&buf[start..]) {
            let end = start + len;
            let keep = self.seen.inspect(&buf[start..end], self.strip_usage);
            match &mut kept {
                Kept::All if !keep => kept = Kept::Some(buf[..start].to_vec()),
                Kept::Some(out) if keep => out.extend_from_slice(&buf[start..end]),
                _ => {}
            }
            start = end;
        }
        (start, kept)
    }

    fn finish(&mut self) -> Option<Bytes> {
        let rest = std::mem::take(&mut self.partial);
        (self.strip_usage && !self.overflowed).then(|| Bytes::from(rest))
    }
}

/// Which of a frame's events go on.
enum Kept {
    /// All of them.
    All,
    /// Those gathered here (one was taken out).
    Some(Vec<u8>),
}

impl Seen {
    /// Reads `event` (one whole event); whether it goes on to the client (with `strip_usage`,
    /// a usage-only chunk does not).
    fn inspect(&mut self, event: &[u8], strip_usage: bool) -> bool {
        if event.starts_with(b"data:") && event[5..].trim_ascii_start().starts_with(b"[DONE]") {
            self.done = true;
            return true;
        }
        // Most events (a token each) name neither: they are passed without a closer look.
        if USAGE_KEY.find(event).is_none() && ERROR_KEY.find(event).is_none() {
            return true;
        }
        let Ok(text) = std::str::from_utf8(event) else {
            return true;
        };
        let mut keep = true;
        for line in text.lines() {
            let Some(payload) = line.strip_prefix("data:").map(str::trim_start) else {
                continue;
            };
            if !payload.starts_with('{')
                || (USAGE_KEY.find(payload.as_bytes()).is_none()
                    && ERROR_KEY.find(payload.as_bytes()).is_none())
            {
                continue;
            }
            let Ok(chunk) = serde_json::from_str::<ChunkView>(payload) else {
                continue;
            };
            if chunk.error {
                self.error_event = true;
            }
            if let Some(usage) = chunk.usage() {
                self.usage = Some(usage);
                if !chunk.choices && strip_usage {
                    keep = false;
                }
            }
        }
        keep
    }
}

/// The searches every streamed event goes through, built once.
static USAGE_KEY: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"usage\""));
static ERROR_KEY: LazyLock<Finder<'static>> = LazyLock::new(|| Finder::new(b"\"error\""));

/// The length of the whole event at the start of `buf` (through its blank line), if it is
/// all there.
fn event_len(buf: &[u8]) -> Option<usize> {
    memchr::memchr_iter(b'\n', buf)
        .find(|&at| buf.get(at + 1) == Some(&b'\n'))
        .map(|at| at + 2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    const CHUNK: &str = "data: {\"id\":\"c\",\"object\":\"text_completion\",\"choices\":[{\"index\":0,\"text\":\"a\",\"logprobs\":null,\"finish_reason\":null}]}\n\n";
    const USAGE: &str = "data: {\"id\":\"c\",\"object\":\"text_completion\",\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2,\"total_tokens\":42,\"prompt_tokens_details\":{\"cached_tokens\":32}}}\n\n";
    const DONE: &str = "data: [DONE]\n\n";

    /// Feeds `frames` to a scan; what the client got, and the scan.
    fn run(strip: bool, frames: &[&str]) -> (String, SseScan) {
        let mut scan = SseScan::new(strip);
        let mut out = Vec::new();
        for f in frames {
            out.extend_from_slice(&scan.feed(Bytes::from(f.to_string())));
        }
        if let Some(rest) = scan.finish() {
            out.extend_from_slice(&rest);
        }
        (String::from_utf8(out).unwrap(), scan)
    }

    #[test]
    fn the_usage_chunk_is_read_and_taken_out_only_when_the_proxy_asked_for_it() {
        let whole = format!("{CHUNK}{USAGE}{DONE}");
        // Each split of the stream into two frames, events cut anywhere.
        for cut in 0..=whole.len() {
            let frames = [&whole[..cut], &whole[cut..]];
            let (out, scan) = run(true, &frames);
            assert_eq!(out, format!("{CHUNK}{DONE}"), "cut at {cut}");
            assert_eq!(
                cached_report(scan.seen.usage.as_ref()),
                CachedReport::Reported(32)
            );
            let (out, scan) = run(false, &frames);
            assert_eq!(out, whole, "cut at {cut}");
            assert_eq!(
                cached_report(scan.seen.usage.as_ref()),
                CachedReport::Reported(32)
            );
        }
    }

    #[test]
    fn any_three_frames_of_a_stream_pass_as_the_engine_sent_them() {
        let whole = format!("{CHUNK}{CHUNK}{USAGE}{CHUNK}{DONE}");
        let stripped = format!("{CHUNK}{CHUNK}{CHUNK}{DONE}");
        for a in 0..=whole.len() {
            for b in (a..=whole.len()).step_by(7) {
                let frames = [&whole[..a], &whole[a..b], &whole[b..]];
                let (out, scan) = run(false, &frames);
                assert_eq!(out, whole, "cuts at {a}, {b}");
                assert_eq!(
                    cached_report(scan.seen.usage.as_ref()),
                    CachedReport::Reported(32)
                );
                let (out, scan) = run(true, &frames);
                assert_eq!(out, stripped, "cuts at {a}, {b}");
                assert_eq!(
                    cached_report(scan.seen.usage.as_ref()),
                    CachedReport::Reported(32)
                );
            }
        }
    }

    #[test]
    fn usage_reports_keep_absent_apart_from_zero_and_from_no_usage() {
        let absent = USAGE.replace(",\"prompt_tokens_details\":{\"cached_tokens\":32}", "");
        let null = USAGE.replace("{\"cached_tokens\":32}", "null");
        let zero = USAGE.replace("32", "0");
        // (stream, report)
        let table: &[(String, CachedReport)] = &[
            (format!("{CHUNK}{USAGE}{DONE}"), CachedReport::Reported(32)),
            (format!("{CHUNK}{zero}{DONE}"), CachedReport::Reported(0)),
            (format!("{CHUNK}{absent}{DONE}"), CachedReport::Absent),
            (format!("{CHUNK}{null}{DONE}"), CachedReport::Absent),
            (format!("{CHUNK}{DONE}"), CachedReport::NoUsage),
        ];
        for (stream, want) in table {
            let (_, scan) = run(false, &[stream]);
            assert_eq!(cached_report(scan.seen.usage.as_ref()), *want, "{stream}");
        }
    }

    #[test]
    fn an_error_event_is_seen() {
        let error =
            "data: {\"error\":{\"message\":\"no\",\"type\":\"x\",\"param\":null,\"code\":\"refused\"}}\n\n";
        let (_, scan) = run(false, &[CHUNK, error, DONE]);
        assert!(scan.seen.error_event);
        let (_, scan) = run(false, &[CHUNK, DONE]);
        assert!(!scan.seen.error_event);
    }

    /// What a chunk said, read as the proxy read it before [`ChunkView`]: parsed whole into a
    /// [`Value`]. (error event, usage, choices present)
    fn read_as_value(payload: &str) -> Option<(bool, Option<Usage>, bool)> {
        let v = serde_json::from_str::<Value>(payload).ok()?;
        let usage = match v.get("usage") {
            Some(u) if u.is_object() => serde_json::from_value(u.clone()).ok(),
            _ => None,
        };
        let choices = v
            .get("choices")
            .and_then(Value::as_array)
            .is_some_and(|c| !c.is_empty());
        Some((v.get("error").is_some_and(|e| !e.is_null()), usage, choices))
    }

    fn read_as_view(payload: &str) -> Option<(bool, Option<Usage>, bool)> {
        let chunk = serde_json::from_str::<ChunkView>(payload).ok()?;
        Some((chunk.error, chunk.usage(), chunk.choices))
    }

    /// Chunks whose reading is easy to get wrong: repeated keys (the last counts), `null`s,
    /// `usage` and `choices` of other types or nested, and texts a `Value` parse refuses.
    const CHUNKS: &[&str] = &[
        r#"{"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}"#,
        r#"{"choices":[{"index":0}],"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5,"prompt_tokens_details":{"cached_tokens":2}}}"#,
        r#"{"choices":[1],"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}"#,
        r#"{"choices":[],"choices":[{}],"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}"#,
        r#"{"choices":{"a":1},"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}"#,
        r#"{"choices":null,"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}"#,
        r#"{"choices":"x","usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}"#,
        r#"{"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5},"usage":null}"#,
        r#"{"usage":null,"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}"#,
        r#"{"usage":3}"#,
        r#"{"usage":[1,2]}"#,
        r#"{"usage":{"prompt_tokens":"x"}}"#,
        r#"{"usage":{"prompt_tokens":4,"prompt_tokens":5,"completion_tokens":1,"total_tokens":5}}"#,
        r#"{"choices":[{"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}]}"#,
        r#"{"error":null}"#,
        r#"{"error":{"message":"no"}}"#,
        r#"{"error":false}"#,
        r#"{"error":{"message":"no"},"error":null}"#,
        r#"{"error":null,"error":0}"#,
        r#"{"x":{"error":1},"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}}"#,
        r#"{"\u0075sage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5},"choices":[]}"#,
        r#"{"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5},"x":1e999}"#,
        r#"{"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5},"x":"\ud800"}"#,
        r#"{"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5},"x":-0.5e-3,"y":[true,{"z":[]}]}"#,
        r#"{"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5}} x"#,
        r#"{"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5},}"#,
        r#"{"usage":{"prompt_tokens":4,"completion_tokens":1,"total_tokens":5},"x":01}"#,
        r#"{}"#,
    ];

    #[test]
    fn a_chunk_reads_as_its_parse_into_a_value_would() {
        for chunk in CHUNKS {
            assert_eq!(read_as_view(chunk), read_as_value(chunk), "{chunk}");
        }
        let deep = format!("{{\"usage\":{{}},\"x\":{}{}}}", "[".repeat(200), "]".repeat(200));
        assert_eq!(read_as_view(&deep), read_as_value(&deep), "past the depth limit");
        assert_eq!(read_as_view(&deep), None);
    }

    /// JSON values of any shape, with the keys a chunk reading looks at.
    fn json_value() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            (-1e300f64..1e300).prop_map(Value::from),
            "[a-z\\\"\u{e9}\u{1F600}]{0,4}".prop_map(Value::from),
        ];
        let key = prop_oneof![
            Just("usage".to_owned()),
            Just("choices".to_owned()),
            Just("error".to_owned()),
            Just("prompt_tokens".to_owned()),
            Just("completion_tokens".to_owned()),
            Just("total_tokens".to_owned()),
            Just("prompt_tokens_details".to_owned()),
            Just("cached_tokens".to_owned()),
            "[a-z]{1,3}",
        ];
        leaf.prop_recursive(4, 24, 5, move |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                proptest::collection::vec((key.clone(), inner), 0..5)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest::proptest! {
        /// Any object, written as JSON with its keys in any order and some repeated, reads the
        /// same through [`ChunkView`] as through a [`Value`].
        #[test]
        fn any_chunk_reads_as_its_parse_into_a_value_would(
            fields in proptest::collection::vec(
                (proptest::prop_oneof![
                    proptest::strategy::Just("usage".to_owned()),
                    proptest::strategy::Just("choices".to_owned()),
                    proptest::strategy::Just("error".to_owned()),
                    "[a-z]{1,3}",
                ], json_value()),
                0..6,
            )
        ) {
            let body: Vec<String> = fields
                .iter()
                .map(|(k, v)| format!("{}:{}", Value::from(k.as_str()), v))
                .collect();
            let chunk = format!("{{{}}}", body.join(","));
            proptest::prop_assert_eq!(read_as_view(&chunk), read_as_value(&chunk), "{}", chunk);
        }
    }

    #[test]
    fn done_is_seen_only_at_its_event_cut_anywhere() {
        let whole = format!("{CHUNK}{USAGE}{DONE}");
        for cut in 1..whole.len() {
            let (_, scan) = run(false, &[&whole[..cut], &whole[cut..]]);
            assert!(scan.seen.done, "cut at {cut}");
            let (_, scan) = run(false, &[&whole[..cut]]);
            assert!(!scan.seen.done, "a stream cut at {cut} is not done");
        }
        // SSE's space after the colon is optional; a token that reads "[DONE]" is not the end.
        assert!(run(true, &["data:[DONE]\n\n"]).1.seen.done);
        let text = "data: {\"choices\":[{\"index\":0,\"text\":\"[DONE]\"}]}\n\n";
        assert!(!run(false, &[CHUNK, text]).1.seen.done);
    }

    #[test]
    fn a_unary_body_is_read_for_its_usage() {
        let body = "{\"id\":\"c\",\"choices\":[],\"usage\":{\"prompt_tokens\":40,\"completion_tokens\":2,\"total_tokens\":42,\"prompt_tokens_details\":{\"cached_tokens\":16}}}";
        let mut scan = Scan::Unary(Vec::new());
        let (a, b) = body.split_at(30);
        assert_eq!(scan.feed(Bytes::from(a)), a);
        assert_eq!(scan.feed(Bytes::from(b)), b);
        assert_eq!(cached_report(scan.usage().as_ref()), CachedReport::Reported(16));
        assert_eq!(
            cached_report(Scan::Unary(b"{}".to_vec()).usage().as_ref()),
            CachedReport::NoUsage
        );
        // Only `usage` is read: what it is not, or a body that is not an object, is no usage.
        for body in [
            &b"{\"usage\":null}"[..],
            b"{\"usage\":3}",
            b"{\"usage\":{\"prompt_tokens\":\"x\"}}",
            b"[1]",
            b"not json",
        ] {
            assert_eq!(
                cached_report(Scan::Unary(body.to_vec()).usage().as_ref()),
                CachedReport::NoUsage
            );
        }
        let absent = b"{\"choices\":[{\"usage\":1}],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":1,\"total_tokens\":5}}";
        assert_eq!(
            cached_report(Scan::Unary(absent.to_vec()).usage().as_ref()),
            CachedReport::Absent
        );
    }
}
