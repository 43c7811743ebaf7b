//! The worker's response on its way back to the client: passed through unchanged while it
//! reports its chunks (the first is prefill done and the time to first token; the gaps between
//! streamed ones are inter-token latencies) and its end, error, idle timeout or the client
//! leaving, each of which frees the request.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Frame, Incoming, SizeHint};
use tokio::time::Sleep;

use crate::driver::RequestGuard;

/// The worker's response body, passed through unchanged while it reports to the request's guard.
pub struct Observed {
    inner: Incoming,
    guard: Option<RequestGuard>,
    streaming: bool,
    idle: Pin<Box<Sleep>>,
    timeout: Duration,
}

impl Observed {
    /// Observes `inner` for `guard`; a streamed body silent for `timeout` fails.
    pub fn new(inner: Incoming, guard: RequestGuard, streaming: bool, timeout: Duration) -> Self {
        Self {
            inner,
            guard: Some(guard),
            streaming,
            idle: Box::pin(tokio::time::sleep(timeout)),
            timeout,
        }
    }
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
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                if frame.is_data()
                    && let Some(guard) = &mut this.guard
                {
                    guard.chunk(this.streaming);
                    if this.streaming {
                        let deadline = tokio::time::Instant::now() + this.timeout;
                        this.idle.as_mut().reset(deadline);
                    }
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.guard.take();
                Poll::Ready(Some(Err(e.into())))
            }
            Poll::Ready(None) => {
                if let Some(guard) = this.guard.take() {
                    guard.finish();
                }
                Poll::Ready(None)
            }
            Poll::Pending => {
                if this.guard.is_some() && this.idle.as_mut().poll(cx).is_ready() {
                    this.guard.take();
                    return Poll::Ready(Some(Err(StreamError::Timeout)));
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.guard.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
