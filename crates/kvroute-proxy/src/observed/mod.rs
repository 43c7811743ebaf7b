//! The worker's response on its way back to the client: passed through while it reports its
//! chunks (the first is prefill done and the time to first token; the gaps between streamed
//! ones are inter-token latencies) and its end, error, idle timeout or the client leaving, each
//! of which frees the request and is counted once as the request's [`RequestOutcome`].
//!
//! On its way it reads the engine's usage (the last `usage` of a stream, the body's of a unary
//! answer) for the cached prompt tokens the engine reports, counted per worker beside the
//! tokens the router predicted ([`crate::outcome::CachedReport`]). A stream whose usage chunk the proxy asked
//! for itself ([`Shape::Stream`] with `strip_usage`) has that chunk taken out, so the client
//! gets what it asked for.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::http::{HeaderMap, HeaderValue, StatusCode};
use bytes::Bytes;
use hyper::body::{Frame, Incoming, SizeHint};
use kvroute_http::openai::Endpoint;
use tokio::time::Sleep;

use crate::driver::RequestGuard;
use crate::outcome::{RequestKind, RequestOutcome};

mod scan;
mod skim;

pub use scan::cached_report;
use scan::{Scan, SseScan};

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
        let metrics = &guard.driver().metrics;
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
            let usage = ok.then(|| self.scan.usage()).flatten();
            if let (true, Some((key, _))) = (ok, guard.routed()) {
                let report = scan::cached_report(usage.as_ref());
                guard.driver().metrics.record_cached_report(key, report);
            }
            guard.finish(usage.as_ref(), self.scan.streamed());
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
        if self.scan.shortens() {
            // A stripped stream may be shorter than the worker's.
            SizeHint::default()
        } else {
            self.inner.size_hint()
        }
    }
}
