//! A response body that hands the client, in one frame, the chunks that have already reached
//! the proxy, so that a streamed response costs one write per burst rather than one per chunk.
//!
//! Why: hyper's client hands a response body over one chunk at a time (its body channel holds
//! one), and the connection task that decodes the next chunk only runs once the current one is
//! taken. Passed straight on, every server-sent event is one poll of each side, one chunked
//! frame and one `write` to the client, even when the engine sent ten of them in one packet.
//!
//! How, without a timer: when a chunk has been taken and the upstream body has no next one
//! ready, the body yields (it wakes itself and returns pending: the upstream connection task,
//! woken by the take, runs first and hands over a chunk it already holds). A chunk that comes
//! in joins the held ones; after [`IDLE_POLLS`] polls in a row that bring nothing, what is held
//! goes out. hyper's server polls a body twice in one pass of its connection when the first
//! poll is pending, so three polls span one trip through the scheduler: a lone chunk waits that
//! one round (microseconds), and chunks already in the proxy go out together. A frame holds at
//! most [`MAX_HELD_CHUNKS`] chunks or [`MAX_HELD_BYTES`] bytes. The bytes the client gets are
//! the upstream's, in order, whatever the grouping.

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use hyper::body::{Body, Frame, SizeHint};

/// The most chunks joined into one frame.
pub const MAX_HELD_CHUNKS: usize = 64;
/// The most bytes joined into one frame (a frame is handed out once it reaches this).
pub const MAX_HELD_BYTES: usize = 64 << 10;
/// Polls in a row that bring no chunk before the held ones go out (see the module docs).
pub const IDLE_POLLS: u8 = 3;

/// What comes after the held bytes.
enum After<E> {
    /// The inner body goes on.
    More,
    /// A non-data frame (trailers), handed out next.
    Frame(Frame<Bytes>),
    /// An error: the body pauses one poll first (the server flushes the held bytes before the
    /// error closes the connection), then hands it out.
    Error { error: E, paused: bool },
    /// The inner body ended.
    End,
}

/// Chunks held for the next frame: the first as it came, later ones joined.
#[derive(Default)]
struct Held {
    first: Option<Bytes>,
    joined: Option<BytesMut>,
    chunks: usize,
}

impl Held {
    fn push(&mut self, data: Bytes) {
        self.chunks += 1;
        match (&mut self.joined, self.first.take()) {
            (Some(joined), _) => joined.extend_from_slice(&data),
            (None, None) => self.first = Some(data),
            (None, Some(first)) => {
                let mut joined = BytesMut::with_capacity((first.len() + data.len()) * 2);
                joined.extend_from_slice(&first);
                joined.extend_from_slice(&data);
                self.joined = Some(joined);
            }
        }
    }

    fn len(&self) -> usize {
        match (&self.first, &self.joined) {
            (Some(first), _) => first.len(),
            (None, Some(joined)) => joined.len(),
            (None, None) => 0,
        }
    }

    fn is_empty(&self) -> bool {
        self.chunks == 0
    }

    fn full(&self) -> bool {
        self.chunks >= MAX_HELD_CHUNKS || self.len() >= MAX_HELD_BYTES
    }

    fn take(&mut self) -> Bytes {
        self.chunks = 0;
        match (self.first.take(), self.joined.take()) {
            (Some(first), _) => first,
            (None, Some(joined)) => joined.freeze(),
            (None, None) => Bytes::new(),
        }
    }
}

/// `inner`, its data chunks that are ready together handed out as one frame (see the module
/// docs).
pub struct Coalesce<B: Body> {
    inner: B,
    held: Held,
    /// Polls in a row, since the last chunk came in, that brought none.
    idle_polls: u8,
    after: After<B::Error>,
}

impl<B: Body<Data = Bytes>> Coalesce<B> {
    /// Coalesces `inner`'s ready chunks.
    pub fn new(inner: B) -> Self {
        Self {
            inner,
            held: Held::default(),
            idle_polls: 0,
            after: After::More,
        }
    }

    /// The held chunks as one frame.
    fn hand_out(&mut self) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        self.idle_polls = 0;
        Poll::Ready(Some(Ok(Frame::data(self.held.take()))))
    }
}

impl<B> Body for Coalesce<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        let this = self.get_mut();
        match std::mem::replace(&mut this.after, After::More) {
            After::More => {}
            After::Frame(frame) => return Poll::Ready(Some(Ok(frame))),
            After::Error { error, paused: true } => return Poll::Ready(Some(Err(error))),
            After::Error { error, paused: false } => {
                this.after = After::Error { error, paused: true };
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            After::End => {
                this.after = After::End;
                return Poll::Ready(None);
            }
        }
        loop {
            let next = match Pin::new(&mut this.inner).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => {
                        if !data.is_empty() {
                            this.held.push(data);
                            this.idle_polls = 0;
                            if this.held.full() {
                                return this.hand_out();
                            }
                        }
                        continue;
                    }
                    Err(frame) => After::Frame(frame),
                },
                Poll::Ready(Some(Err(error))) => After::Error { error, paused: false },
                Poll::Ready(None) => After::End,
                Poll::Pending => {
                    if this.held.is_empty() {
                        return Poll::Pending;
                    }
                    this.idle_polls += 1;
                    if this.idle_polls < IDLE_POLLS {
                        // Let the upstream connection hand over what it already holds.
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    return this.hand_out();
                }
            };
            if this.held.is_empty() {
                // Nothing held: the frame, error or end goes out now.
                return match next {
                    After::Frame(frame) => Poll::Ready(Some(Ok(frame))),
                    After::Error { error, .. } => Poll::Ready(Some(Err(error))),
                    After::End => {
                        this.after = After::End;
                        Poll::Ready(None)
                    }
                    After::More => continue,
                };
            }
            this.after = next;
            return this.hand_out();
        }
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_empty()
            && match self.after {
                After::End => true,
                After::More => self.inner.is_end_stream(),
                After::Frame(_) | After::Error { .. } => false,
            }
    }

    fn size_hint(&self) -> SizeHint {
        let held = self.held.len() as u64;
        match self.after {
            After::More => {
                let inner = self.inner.size_hint();
                let mut hint = SizeHint::new();
                hint.set_lower(inner.lower() + held);
                if let Some(upper) = inner.upper() {
                    hint.set_upper(upper + held);
                }
                hint
            }
            After::End | After::Frame(_) | After::Error { .. } => SizeHint::with_exact(held),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    use super::*;

    /// One step of a scripted body: a chunk, a pending poll, an error, or trailers.
    #[derive(Clone, Debug)]
    enum Step {
        Chunk(&'static str),
        Pending,
        Error,
        Trailers,
    }

    /// A body that answers its polls from a script, then ends.
    struct Scripted(VecDeque<Step>);

    impl Body for Scripted {
        type Data = Bytes;
        type Error = &'static str;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, &'static str>>> {
            match self.0.pop_front() {
                None => Poll::Ready(None),
                Some(Step::Chunk(s)) => Poll::Ready(Some(Ok(Frame::data(Bytes::from_static(s.as_bytes()))))),
                Some(Step::Pending) => {
                    // Ready again at once: as the upstream connection, woken, would be.
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
                Some(Step::Error) => Poll::Ready(Some(Err("broke"))),
                Some(Step::Trailers) => Poll::Ready(Some(Ok(Frame::trailers(Default::default())))),
            }
        }

        fn is_end_stream(&self) -> bool {
            self.0.is_empty()
        }
    }

    struct Counter(AtomicUsize);
    impl Wake for Counter {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// What the client sees, poll by poll: `d:<bytes>` a data frame, `t` trailers, `e` an
    /// error, `.` pending, `$` the end.
    fn polls(script: &[Step]) -> Vec<String> {
        let mut body = Coalesce::new(Scripted(script.iter().cloned().collect()));
        let waker = Arc::new(Counter(AtomicUsize::new(0))).into();
        let mut cx = Context::from_waker(&waker);
        let mut seen = Vec::new();
        for _ in 0..100 {
            let polled = Pin::new(&mut body).poll_frame(&mut cx);
            seen.push(match polled {
                Poll::Pending => ".".to_owned(),
                Poll::Ready(None) => "$".to_owned(),
                Poll::Ready(Some(Err(_))) => "e".to_owned(),
                Poll::Ready(Some(Ok(f))) if f.is_trailers() => "t".to_owned(),
                Poll::Ready(Some(Ok(f))) => {
                    format!(
                        "d:{}",
                        String::from_utf8(f.into_data().unwrap().to_vec()).unwrap()
                    )
                }
            });
            if matches!(seen.last().map(String::as_str), Some("$" | "e")) {
                break;
            }
        }
        seen
    }

    #[test]
    fn ready_chunks_go_out_together_and_a_lone_chunk_after_three_idle_polls() {
        use Step::*;
        // (script, what the client sees)
        let table: &[(&[Step], &[&str])] = &[
            // Chunks ready back to back: one frame, and the end known with it.
            (&[Chunk("a"), Chunk("b"), Chunk("c")], &["d:abc", "$"]),
            // A chunk, then the next arrives within the yield: joined.
            (&[Chunk("a"), Pending, Chunk("b")], &[".", "d:ab", "$"]),
            (
                &[Chunk("a"), Pending, Pending, Chunk("b")],
                &[".", ".", "d:ab", "$"],
            ),
            // A chunk and nothing more for three polls: it goes out, never held longer.
            (
                &[Chunk("a"), Pending, Pending, Pending, Chunk("b")],
                &[".", ".", "d:a", "d:b", "$"],
            ),
            // Nothing held: pending passes through.
            (&[Pending, Chunk("a")], &[".", "d:a", "$"]),
            // An error after held bytes: the bytes, a pause (the server flushes), the error.
            (&[Chunk("a"), Chunk("b"), Error], &["d:ab", ".", "e"]),
            (&[Error], &["e"]),
            // Trailers keep their place after the data.
            (&[Chunk("a"), Trailers], &["d:a", "t", "$"]),
            // Empty chunks vanish.
            (&[Chunk(""), Chunk("a"), Chunk("")], &["d:a", "$"]),
            (&[], &["$"]),
        ];
        for (script, want) in table {
            assert_eq!(polls(script), *want, "script {script:?}");
        }
    }

    #[test]
    fn a_frame_holds_at_most_max_held_chunks() {
        let script = vec![Step::Chunk("x"); MAX_HELD_CHUNKS + 1];
        let got = polls(&script);
        assert_eq!(
            got,
            [
                format!("d:{}", "x".repeat(MAX_HELD_CHUNKS)),
                "d:x".to_owned(),
                "$".to_owned()
            ]
        );
    }
}
