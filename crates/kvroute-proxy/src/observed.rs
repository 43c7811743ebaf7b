//! The worker's response on its way back to the client: passed through while it reports its
//! chunks (the first is prefill done and the time to first token; the gaps between streamed
//! ones are inter-token latencies) and its end, error, idle timeout or the client leaving, each
//! of which frees the request and is counted once as the request's [`RequestOutcome`].
//!
//! On its way it reads the engine's usage (the last `usage` of a stream, the body's of a unary
//! answer) for the cached prompt tokens the engine reports, counted per worker beside the
//! tokens the router predicted ([`CachedReport`]). A stream whose usage chunk the proxy asked
//! for itself ([`Shape::Stream`] with `strip_usage`) has that chunk taken out, so the client
//! gets what it asked for.

use std::pin::Pin;
use std::sync::LazyLock;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue, StatusCode};
use bytes::Bytes;
use hyper::body::{Frame, Incoming, SizeHint};
use kvroute_http::openai::Endpoint;
use kvroute_http::openai::types::Usage;
use memchr::memmem::Finder;
use serde_json::Value;
use tokio::time::Sleep;

use crate::driver::RequestGuard;
use crate::metrics::{CachedReport, RequestKind, RequestOutcome};

/// How the response is read for its usage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// One JSON body, read whole (up to [`MAX_SCANNED`]) for its `usage`.
    Unary,
    /// Server-sent events, scanned event by event for the last `usage`.
    Stream {
        /// The proxy added `stream_options.include_usage` itself: the usage-only chunk is
        /// taken out of what the client gets.
        strip_usage: bool,
    },
}

/// What a request's observed body reports under: its endpoint, its shape, and whether the
/// response names the chosen worker in debug headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Report {
    /// The endpoint (its path is the metrics' label).
    pub endpoint: Endpoint,
    /// How the body is read.
    pub shape: Shape,
    /// Add `x-kvroute-worker`, `x-kvroute-dp-rank` and `x-kvroute-predicted-cached-tokens`.
    pub debug_headers: bool,
}

impl Report {
    /// The metrics' `request_type`.
    pub fn kind(&self) -> RequestKind {
        match self.shape {
            Shape::Unary => RequestKind::Unary,
            Shape::Stream { .. } => RequestKind::Stream,
        }
    }

    fn streaming(&self) -> bool {
        matches!(self.shape, Shape::Stream { .. })
    }
}

/// The debug headers' names.
pub const WORKER_HEADER: &str = "x-kvroute-worker";
/// The chosen worker's data-parallel rank.
pub const DP_RANK_HEADER: &str = "x-kvroute-dp-rank";
/// The prompt tokens the router predicted cached on the chosen worker.
pub const PREDICTED_HEADER: &str = "x-kvroute-predicted-cached-tokens";

/// Adds the debug headers naming `guard`'s worker and prediction to `headers`, if `report`
/// asks for them.
pub fn debug_headers(report: &Report, guard: &RequestGuard, headers: &mut HeaderMap) {
    if !report.debug_headers {
        return;
    }
    let Some((key, predicted)) = guard.routed() else {
        return;
    };
    headers.insert(WORKER_HEADER, HeaderValue::from(key.worker.0));
    headers.insert(DP_RANK_HEADER, HeaderValue::from(key.dp_rank.0));
    headers.insert(PREDICTED_HEADER, HeaderValue::from(predicted));
}

/// The most bytes of a unary body, or of one server-sent event, read for its usage; past it
/// the body passes through unread and its usage counts as not seen.
pub const MAX_SCANNED: usize = 8 << 20;

/// The worker's response body, passed through while it reports to the request's guard and
/// the metrics.
pub struct Observed {
    inner: Incoming,
    guard: Option<RequestGuard>,
    report: Report,
    status: StatusCode,
    scan: Scan,
    /// Bytes still to hand out before the end (what a stripped stream held back).
    tail: Option<Bytes>,
    /// What becomes of the worker's body once the request is counted.
    rest: Rest,
    idle: Pin<Box<Sleep>>,
    timeout: Duration,
    /// The worker's failure, handed out one poll after it was seen: the server then flushes
    /// what it already has (the head, the chunks before it) before it closes the connection,
    /// so that the client sees the stream break off rather than no answer at all.
    failed: Option<StreamError>,
}

impl Observed {
    /// Observes `inner`, a response of `status`, for `guard`; a streamed body silent for
    /// `timeout` fails.
    pub fn new(
        inner: Incoming,
        guard: RequestGuard,
        report: Report,
        status: StatusCode,
        timeout: Duration,
    ) -> Self {
        let scan = match report.shape {
            _ if !status.is_success() => Scan::Off,
            Shape::Unary => Scan::Unary(Vec::new()),
            Shape::Stream { strip_usage } => Scan::Stream(SseScan::new(strip_usage)),
        };
        Self {
            inner,
            guard: Some(guard),
            report,
            status,
            scan,
            tail: None,
            rest: Rest::End,
            idle: Box::pin(tokio::time::sleep(timeout)),
            timeout,
            failed: None,
        }
    }

    /// Ends the request with `outcome`, counted once; its load is freed (cancelled, unless
    /// [`Self::completed`] finishes it).
    fn end(&mut self, outcome: RequestOutcome) -> Option<RequestGuard> {
        let guard = self.guard.take()?;
        let metrics = &guard.shared().metrics;
        metrics.record_outcome(self.report.endpoint, self.report.kind(), outcome);
        Some(guard)
    }

    /// The body reached its end: `ok` if the worker answered 2xx without an error event (its
    /// usage is counted then), `upstream_error` otherwise; the request is finished.
    fn completed(&mut self) {
        let ok = self.status.is_success() && !self.scan.error_event();
        let outcome = if ok {
            RequestOutcome::Ok
        } else {
            RequestOutcome::UpstreamError
        };
        if let Some(guard) = self.end(outcome) {
            if let (true, Some((key, _))) = (ok, guard.routed()) {
                let report = self.scan.cached_report();
                guard.shared().metrics.record_cached_report(key, report);
            }
            guard.finish();
        }
    }
}

impl Drop for Observed {
    fn drop(&mut self) {
        // Not ended: the client left (the guard, dropped, cancels the request).
        self.end(RequestOutcome::ClientCancelled);
    }
}

/// What is left of the worker's body once its request is counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rest {
    /// Nothing: the client's body ends (after what was held back).
    End,
    /// The stream passed `data: [DONE]`: the answer is whole and counted, and what the worker
    /// still sends (its body's end) passes on; if it breaks off or goes silent instead, the
    /// client's body just ends.
    PassOn,
}

/// The error a client sees when the worker's response breaks off.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The worker's connection failed.
    #[error("the worker's response failed: {0}")]
    Upstream(#[from] hyper::Error),
    /// The worker went silent.
    #[error("the worker went silent for longer than the request timeout")]
    Timeout,
}

impl hyper::body::Body for Observed {
    type Data = Bytes;
    type Error = StreamError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, StreamError>>> {
        let this = self.get_mut();
        if let Some(e) = this.failed.take() {
            return Poll::Ready(Some(Err(e)));
        }
        loop {
            if this.guard.is_none() && this.rest == Rest::End {
                // Ended: what was held back, then the end.
                return Poll::Ready(this.tail.take().map(|b| Ok(Frame::data(b))));
            }
            match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let frame = match frame.into_data() {
                        Ok(data) => {
                            let streaming = this.report.streaming();
                            if let Some(guard) = &mut this.guard {
                                guard.chunk(streaming);
                            }
                            if streaming {
                                let deadline = tokio::time::Instant::now() + this.timeout;
                                this.idle.as_mut().reset(deadline);
                            }
                            let mut out = this.scan.feed(data);
                            if this.inner.is_end_stream() {
                                // The last bytes (a sized body): end now, so that the request
                                // is counted before the client has all of it.
                                if let Some(tail) = this.scan.finish().filter(|b| !b.is_empty()) {
                                    out = [out, tail].concat().into();
                                }
                                this.completed();
                                this.rest = Rest::End;
                            } else if this.guard.is_some() && this.scan.done() {
                                // `[DONE]`: the answer is whole. Counted now, before the client
                                // reads it (clients stop there and may close at once).
                                this.completed();
                                this.rest = Rest::PassOn;
                            }
                            if out.is_empty() {
                                continue;
                            }
                            Frame::data(out)
                        }
                        Err(other) => other,
                    };
                    return Poll::Ready(Some(Ok(frame)));
                }
                Poll::Ready(Some(Err(_))) if this.rest == Rest::PassOn => this.rest = Rest::End,
                Poll::Ready(Some(Err(e))) => {
                    this.end(RequestOutcome::UpstreamReset);
                    this.failed = Some(e.into());
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                Poll::Ready(None) => {
                    this.tail = this.scan.finish().filter(|b| !b.is_empty());
                    this.completed();
                    this.rest = Rest::End;
                }
                Poll::Pending => {
                    if this.idle.as_mut().poll(cx).is_ready() {
                        if this.rest == Rest::PassOn {
                            this.rest = Rest::End;
                            continue;
                        }
                        this.end(RequestOutcome::Timeout);
                        return Poll::Ready(Some(Err(StreamError::Timeout)));
                    }
                    return Poll::Pending;
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.guard.is_none() && self.tail.is_none() && self.failed.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        match self.scan {
            // A stripped stream may be shorter than the worker's.
            Scan::Stream(SseScan {
                strip_usage: true, ..
            }) => SizeHint::default(),
            _ => self.inner.size_hint(),
        }
    }
}

/// What is read of a body for its usage.
enum Scan {
    /// Nothing (an error answer, or a body too large to read).
    Off,
    /// A unary body, gathered whole.
    Unary(Vec<u8>),
    /// A stream, event by event.
    Stream(SseScan),
}

impl Scan {
    /// Takes a frame's bytes; returns what goes to the client.
    fn feed(&mut self, data: Bytes) -> Bytes {
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
    fn finish(&mut self) -> Option<Bytes> {
        match self {
            Self::Stream(sse) => sse.finish(),
            Self::Off | Self::Unary(_) => None,
        }
    }

    /// Whether a stream passed its `data: [DONE]`.
    fn done(&self) -> bool {
        matches!(self, Self::Stream(sse) if sse.seen.done)
    }

    /// Whether a stream carried an error event.
    fn error_event(&self) -> bool {
        matches!(self, Self::Stream(sse) if sse.seen.error_event)
    }

    /// What the body said of its cached tokens.
    fn cached_report(&self) -> CachedReport {
        let usage = match self {
            Self::Off => None,
            Self::Unary(buf) => serde_json::from_slice::<UsageOnly>(buf)
                .ok()
                .and_then(|u| u.usage),
            Self::Stream(sse) => sse.seen.usage.clone(),
        };
        cached_report(usage.as_ref())
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
struct SseScan {
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
    fn new(strip_usage: bool) -> Self {
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

/// What [`Seen::inspect`] reads of a chunk (a JSON object): what a parse into a [`Value`] would
/// show of its `error`, `usage` and `choices` (the last of a repeated key counting), the same
/// texts accepted, but only `usage` built: the rest is read through and dropped.
#[derive(Default)]
struct ChunkView {
    /// `error` is there and not null.
    error: bool,
    /// `usage`, whatever it is.
    usage: Option<Value>,
    /// `choices` is a list of at least one.
    choices: bool,
}

impl ChunkView {
    /// The usage, if `usage` is an object that reads as one.
    fn usage(&self) -> Option<Usage> {
        match &self.usage {
            Some(u) if u.is_object() => serde_json::from_value(u.clone()).ok(),
            _ => None,
        }
    }
}

impl<'de> serde::Deserialize<'de> for ChunkView {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = ChunkView;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<ChunkView, A::Error> {
                let mut chunk = ChunkView::default();
                while let Some(key) = map.next_key::<ChunkKey>()? {
                    match key {
                        ChunkKey::Error => chunk.error = !map.next_value::<Skim>()?.null,
                        ChunkKey::Usage => chunk.usage = Some(map.next_value()?),
                        ChunkKey::Choices => chunk.choices = map.next_value::<Skim>()?.nonempty_list,
                        ChunkKey::Other => {
                            map.next_value::<Skim>()?;
                        }
                    }
                }
                Ok(chunk)
            }
        }
        d.deserialize_map(Fields)
    }
}

/// A key of a chunk, as far as [`ChunkView`] tells them apart.
enum ChunkKey {
    Error,
    Usage,
    Choices,
    Other,
}

impl<'de> serde::Deserialize<'de> for ChunkKey {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Key;
        impl serde::de::Visitor<'_> for Key {
            type Value = ChunkKey;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a key")
            }
            fn visit_str<E: serde::de::Error>(self, key: &str) -> Result<ChunkKey, E> {
                Ok(match key {
                    "error" => ChunkKey::Error,
                    "usage" => ChunkKey::Usage,
                    "choices" => ChunkKey::Choices,
                    _ => ChunkKey::Other,
                })
            }
        }
        d.deserialize_str(Key)
    }
}

/// Any JSON value, read as a [`Value`] parse reads it (numbers in range, strings' escapes
/// valid, the same depth limit) but not built: whether it was `null`, and whether it was a
/// list of at least one.
#[derive(Clone, Copy, Default)]
struct Skim {
    null: bool,
    nonempty_list: bool,
}

impl<'de> serde::Deserialize<'de> for Skim {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(SkimVisitor)
    }
}

struct SkimVisitor;

impl<'de> serde::de::Visitor<'de> for SkimVisitor {
    type Value = Skim;
    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }
    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Skim, E> {
        Ok(Skim::default())
    }
    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Skim, E> {
        Ok(Skim::default())
    }
    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Skim, E> {
        Ok(Skim::default())
    }
    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Skim, E> {
        Ok(Skim::default())
    }
    fn visit_str<E: serde::de::Error>(self, _: &str) -> Result<Skim, E> {
        Ok(Skim::default())
    }
    fn visit_unit<E: serde::de::Error>(self) -> Result<Skim, E> {
        Ok(Skim {
            null: true,
            nonempty_list: false,
        })
    }
    fn visit_none<E: serde::de::Error>(self) -> Result<Skim, E> {
        self.visit_unit()
    }
    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Skim, D::Error> {
        d.deserialize_any(self)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Skim, A::Error> {
        let mut len = 0usize;
        while seq.next_element::<Skim>()?.is_some() {
            len += 1;
        }
        Ok(Skim {
            null: false,
            nonempty_list: len > 0,
        })
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Skim, A::Error> {
        while map.next_key::<Skim>()?.is_some() {
            map.next_value::<Skim>()?;
        }
        Ok(Skim::default())
    }
}

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
        assert_eq!(scan.cached_report(), CachedReport::Reported(16));
        assert_eq!(Scan::Unary(b"{}".to_vec()).cached_report(), CachedReport::NoUsage);
        // Only `usage` is read: what it is not, or a body that is not an object, is no usage.
        for body in [
            &b"{\"usage\":null}"[..],
            b"{\"usage\":3}",
            b"{\"usage\":{\"prompt_tokens\":\"x\"}}",
            b"[1]",
            b"not json",
        ] {
            assert_eq!(Scan::Unary(body.to_vec()).cached_report(), CachedReport::NoUsage);
        }
        let absent = b"{\"choices\":[{\"usage\":1}],\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":1,\"total_tokens\":5}}";
        assert_eq!(Scan::Unary(absent.to_vec()).cached_report(), CachedReport::Absent);
    }
}
