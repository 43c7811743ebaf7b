//! Sockets: the HTTP/1.1 accept loop the proxy and the mock workers share, and the pooled
//! upstream client. TCP_NODELAY is set on both legs: without it a streamed response stalls on
//! Nagle's algorithm and delayed ACKs (about 44 ms per response on Linux).
//!
//! The accept loop bounds what a client may hold ([`ConnTimeouts`]: a connection must finish
//! its headers within the header timeout, from accept or from the first byte of a keep-alive
//! connection's next request, and may wait idle between requests for the idle timeout), backs
//! off when accepting fails for want of resources (descriptors exhausted: the failure repeats
//! at once, and retrying at once spins a core), and drains on request ([`Shutdown::drain`]).

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio::time::{Instant, Sleep};

/// The upstream client: pooled keep-alive connections, TCP_NODELAY, a connect timeout.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// How long an idle pooled connection to an engine is kept: under vLLM's 5 s keep-alive.
pub const POOL_IDLE: Duration = Duration::from_secs(4);

/// A pooled client with TCP_NODELAY and `connect_timeout`.
pub fn client(connect_timeout: Duration) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_keepalive(Some(Duration::from_secs(60)));
    Client::builder(TokioExecutor::new())
        // Under the engines' own keep-alive: vLLM's server (uvicorn) closes an idle connection
        // after 5 s, and a pooled connection reused just as the engine closes it fails its
        // request. Closing ours first leaves the engine nothing to close under us.
        .pool_idle_timeout(POOL_IDLE)
        .pool_max_idle_per_host(1024)
        .build(connector)
}

/// How long a client connection may take over what it owes the server.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnTimeouts {
    /// From accept, or from the first byte of a keep-alive connection's next request, until
    /// the request's headers are read. Past it the connection is closed. Default 10 s.
    pub header_read: Duration,
    /// How long a keep-alive connection with no request in flight waits for its next request
    /// before it is closed. Default 60 s.
    pub idle: Duration,
}

impl Default for ConnTimeouts {
    fn default() -> Self {
        Self {
            header_read: Duration::from_secs(10),
            idle: Duration::from_secs(60),
        }
    }
}

/// Where a server is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Serving,
    Draining,
    Stopped,
}

/// A stop switch for a server: [`Shutdown::drain`] stops accepting and lets each connection
/// finish the request it serves (then closes it); [`Shutdown::stop`] closes the listener and
/// every connection at once (in-flight responses end abruptly, as when a process dies).
#[derive(Clone, Debug)]
pub struct Shutdown(watch::Sender<Phase>);

impl Shutdown {
    /// A switch, not yet thrown.
    pub fn new() -> Self {
        Self(watch::channel(Phase::Serving).0)
    }

    /// Stops accepting and drains: connections finish what they serve, then close.
    pub fn drain(&self) {
        self.0.send_if_modified(|p| {
            let serving = *p == Phase::Serving;
            if serving {
                *p = Phase::Draining;
            }
            serving
        });
    }

    /// Throws the switch: everything closes at once.
    pub fn stop(&self) {
        self.0.send_replace(Phase::Stopped);
    }

    /// Whether it was thrown.
    pub fn is_stopped(&self) -> bool {
        *self.0.borrow() == Phase::Stopped
    }

    /// Resolves when the switch is thrown.
    pub async fn stopped(&self) {
        self.wait(|p| p == Phase::Stopped).await;
    }

    /// Resolves when the server is to stop accepting (drained or stopped).
    pub async fn leaving(&self) {
        self.wait(|p| p != Phase::Serving).await;
    }

    async fn wait(&self, f: impl Fn(Phase) -> bool) {
        let mut rx = self.0.subscribe();
        // An error means the sender is gone, which cannot happen while `self` lives.
        let _ = rx.wait_for(|&p| f(p)).await;
    }

    /// [`Self::leaving`] for a connection's `select!`, which polls it on every wake of the
    /// connection's task (each read, write and body chunk): polled again only once the switch
    /// has moved. Polling the watch's wait each time cost about 690 instructions a unary request
    /// and 2,900 a streamed one (BENCHMARKS.md, "Proxy: CPU per request in instructions").
    fn leaving_polled_on_change(&self) -> LeavingOnChange {
        LeavingOnChange {
            moved: self.0.subscribe(),
            wait: Box::pin(self.clone().leaving_owned()),
            polled: false,
        }
    }

    async fn leaving_owned(self) {
        self.leaving().await;
    }
}

/// [`Shutdown::leaving_polled_on_change`]'s future. Its wait, once polled, stays registered
/// with the switch, which wakes the task when it moves; until then a poll only compares the
/// switch's version with the one `moved` saw. (The task's waker is the one the wait was last
/// polled with: a Tokio task's wakers all wake that task.)
struct LeavingOnChange {
    moved: watch::Receiver<Phase>,
    wait: Pin<Box<dyn Future<Output = ()> + Send>>,
    polled: bool,
}

impl Future for LeavingOnChange {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        // An error (the switch gone) lets the wait see it.
        if this.polled && !this.moved.has_changed().unwrap_or(true) {
            return Poll::Pending;
        }
        this.polled = true;
        this.moved.mark_unchanged();
        this.wait.as_mut().poll(cx)
    }
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

/// Pauses after accept errors that are not one connection's (descriptors or memory
/// exhausted): 10 ms, doubling to 1 s, back to 10 ms after an accept succeeds.
#[derive(Debug)]
struct AcceptBackoff(Duration);

impl AcceptBackoff {
    const FIRST: Duration = Duration::from_millis(10);
    const MOST: Duration = Duration::from_secs(1);

    fn next(&mut self) -> Duration {
        let pause = self.0;
        self.0 = (self.0 * 2).min(Self::MOST);
        pause
    }

    fn reset(&mut self) {
        self.0 = Self::FIRST;
    }
}

/// Whether an accept error concerns only the connection being accepted (retry at once).
fn one_connections_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionRefused
    )
}

/// Serves `app` on `listener` with the default [`ConnTimeouts`]; see [`serve_with`].
pub async fn serve(listener: TcpListener, app: axum::Router, shutdown: Shutdown) {
    serve_with(listener, app, shutdown, ConnTimeouts::default()).await;
}

/// Serves `app` on `listener` over HTTP/1.1 (keep-alive, TCP_NODELAY) with `timeouts` until
/// `shutdown`: on [`Shutdown::drain`] it stops accepting and returns once every connection has
/// finished its request in flight; on [`Shutdown::stop`] it aborts every connection at once.
pub async fn serve_with(
    listener: TcpListener,
    app: axum::Router,
    shutdown: Shutdown,
    timeouts: ConnTimeouts,
) {
    let mut connections = JoinSet::new();
    let service = TowerToHyperService::new(app);
    let mut backoff = AcceptBackoff(AcceptBackoff::FIRST);
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => {
                    backoff.reset();
                    connections.spawn(connection(stream, service.clone(), shutdown.clone(), timeouts));
                }
                Err(e) if one_connections_error(&e) => {}
                Err(e) => {
                    let pause = backoff.next();
                    tracing::warn!(error = %e, pause_ms = pause.as_millis() as u64, "accept failed; pausing");
                    tokio::select! {
                        () = tokio::time::sleep(pause) => {}
                        () = shutdown.leaving() => break,
                    }
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            () = shutdown.leaving() => break,
        }
    }
    drop(listener);
    // Draining: each connection was told (it watches the switch) and finishes its request.
    loop {
        tokio::select! {
            next = connections.join_next() => if next.is_none() { break },
            () = shutdown.stopped() => {
                connections.abort_all();
                while connections.join_next().await.is_some() {}
                break;
            }
        }
    }
}

/// One client connection: served until it closes, times out, or the server drains (then it
/// finishes the request in flight and closes).
async fn connection(
    stream: TcpStream,
    service: TowerToHyperService<axum::Router>,
    shutdown: Shutdown,
    timeouts: ConnTimeouts,
) {
    let _ = stream.set_nodelay(true);
    let clock = Arc::new(ConnClock(Mutex::new((
        ConnPhase::Reading {
            since: Instant::now(),
        },
        None,
    ))));
    let io = TimedIo {
        io: stream,
        clock: Arc::clone(&clock),
        timeouts,
        sleep: Box::pin(tokio::time::sleep(timeouts.header_read)),
        armed: None,
    };
    let svc = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        let busy = BusyGuard::begin(&clock);
        let call = hyper::service::Service::call(&service, request);
        async move {
            let response = call.await?;
            // The connection is busy until the response body is done with (sent or dropped).
            Ok::<_, Infallible>(response.map(|body| {
                Body::new(body.map_frame(move |frame| {
                    let _busy = &busy;
                    frame
                }))
            }))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .keep_alive(true)
        .serve_connection(TokioIo::new(io), svc);
    tokio::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => return,
        () = shutdown.leaving_polled_on_change() => conn.as_mut().graceful_shutdown(),
    }
    let _ = conn.await;
}

/// What a connection is doing, for its timeouts.
#[derive(Clone, Copy, Debug)]
enum ConnPhase {
    /// Reading a request's headers, since accept or its first byte.
    Reading { since: Instant },
    /// Serving this many requests (their responses not yet done with).
    Busy(usize),
    /// Waiting for the next request since its last response.
    Idle { since: Instant },
}

/// A connection's phase, and the waker of a read left waiting without a deadline (woken when
/// the connection turns idle: its deadline then starts).
#[derive(Debug)]
struct ConnClock(Mutex<(ConnPhase, Option<Waker>)>);

impl ConnClock {
    fn lock(&self) -> std::sync::MutexGuard<'_, (ConnPhase, Option<Waker>)> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes arrived: an idle connection is reading its next request's headers.
    fn on_bytes(&self) {
        let mut clock = self.lock();
        if let ConnPhase::Idle { .. } = clock.0 {
            clock.0 = ConnPhase::Reading {
                since: Instant::now(),
            };
        }
    }

    /// The deadline of a read that waits now; without one, `waker` is kept to be woken when
    /// a deadline starts.
    fn deadline(&self, timeouts: ConnTimeouts, waker: &Waker) -> Option<Instant> {
        let mut clock = self.lock();
        match clock.0 {
            ConnPhase::Reading { since } => Some(since + timeouts.header_read),
            ConnPhase::Busy(_) => {
                clock.1 = Some(waker.clone());
                None
            }
            ConnPhase::Idle { since } => Some(since + timeouts.idle),
        }
    }
}

/// A request in flight on a connection (its headers read, its response not yet done with).
#[derive(Debug)]
struct BusyGuard(Arc<ConnClock>);

impl BusyGuard {
    fn begin(clock: &Arc<ConnClock>) -> Self {
        let mut c = clock.lock();
        c.0 = match c.0 {
            ConnPhase::Busy(n) => ConnPhase::Busy(n + 1),
            _ => ConnPhase::Busy(1),
        };
        drop(c);
        Self(Arc::clone(clock))
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        let mut c = self.0.lock();
        c.0 = match c.0 {
            ConnPhase::Busy(n) if n > 1 => ConnPhase::Busy(n - 1),
            _ => ConnPhase::Idle {
                since: Instant::now(),
            },
        };
        let waiting = match c.0 {
            ConnPhase::Idle { .. } => c.1.take(),
            _ => None,
        };
        drop(c);
        if let Some(waker) = waiting {
            waker.wake();
        }
    }
}

/// A client socket whose reads fail with `TimedOut` once its connection's deadline passes
/// (header read or idle; none while a request is in flight), which closes the connection.
struct TimedIo {
    io: TcpStream,
    clock: Arc<ConnClock>,
    timeouts: ConnTimeouts,
    sleep: Pin<Box<Sleep>>,
    armed: Option<Instant>,
}

impl AsyncRead for TimedIo {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    this.clock.on_bytes();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending => {
                let Some(deadline) = this.clock.deadline(this.timeouts, cx.waker()) else {
                    return Poll::Pending;
                };
                if this.armed != Some(deadline) {
                    this.sleep.as_mut().reset(deadline);
                    this.armed = Some(deadline);
                }
                match this.sleep.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the client took too long (header read or idle timeout)",
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
            other => other,
        }
    }
}

impl AsyncWrite for TimedIo {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// Binds `addr` (port 0 picks a free port) and returns the listener and its address.
pub async fn bind(addr: std::net::SocketAddr) -> std::io::Result<(TcpListener, std::net::SocketAddr)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    Ok((listener, local))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use kvroute_testkit::PATIENCE;

    async fn server(timeouts: ConnTimeouts) -> (std::net::SocketAddr, Shutdown) {
        let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let (listener, addr) = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let shutdown = Shutdown::new();
        tokio::spawn(serve_with(listener, app, shutdown.clone(), timeouts));
        (addr, shutdown)
    }

    /// Reads until the server closes the connection; what it sent.
    async fn until_closed(stream: &mut TcpStream) -> String {
        let mut all = Vec::new();
        let read = tokio::time::timeout(PATIENCE, async {
            let mut buf = [0u8; 4096];
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => all.extend_from_slice(&buf[..n]),
                }
            }
        })
        .await;
        assert!(read.is_ok(), "the server never closed the connection");
        String::from_utf8_lossy(&all).into_owned()
    }

    const SHORT: Duration = Duration::from_millis(200);
    const LONG: Duration = Duration::from_secs(3600);

    #[tokio::test]
    async fn a_client_that_never_finishes_its_headers_is_cut_off() {
        let (addr, _s) = server(ConnTimeouts {
            header_read: SHORT,
            idle: LONG,
        })
        .await;
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n").await.unwrap();
        assert_eq!(until_closed(&mut stream).await, "");
        // Nothing sent at all: the same.
        let mut silent = TcpStream::connect(addr).await.unwrap();
        assert_eq!(until_closed(&mut silent).await, "");
    }

    /// A server whose connections no timeout closes: only its switch does.
    async fn untimed_server() -> (std::net::SocketAddr, Shutdown) {
        server(ConnTimeouts {
            header_read: LONG,
            idle: LONG,
        })
        .await
    }

    #[tokio::test]
    async fn kept_alive_connections_close_when_the_server_drains_or_stops() {
        for stop in [false, true] {
            let (addr, shutdown) = untimed_server().await;
            let mut conns = Vec::new();
            for _ in 0..3 {
                let mut stream = TcpStream::connect(addr).await.unwrap();
                // Two requests each: the connection's task is woken, and its select polled,
                // many times before the switch moves.
                for _ in 0..2 {
                    stream
                        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                        .await
                        .unwrap();
                    let mut buf = [0u8; 4096];
                    let n = stream.read(&mut buf).await.unwrap();
                    assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
                }
                conns.push(stream);
            }
            if stop {
                shutdown.stop();
            } else {
                shutdown.drain();
            }
            for stream in &mut conns {
                assert_eq!(until_closed(stream).await, "", "stop: {stop}");
            }
        }
    }

    #[tokio::test]
    async fn a_connection_opened_as_the_server_drains_is_not_kept() {
        let (addr, shutdown) = untimed_server().await;
        let mut stream = TcpStream::connect(addr).await.unwrap();
        shutdown.drain();
        assert_eq!(until_closed(&mut stream).await, "");
    }

    #[tokio::test]
    async fn an_idle_keep_alive_connection_is_closed_after_its_answer() {
        let (addr, _s) = server(ConnTimeouts {
            header_read: LONG,
            idle: SHORT,
        })
        .await;
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let seen = until_closed(&mut stream).await;
        assert!(seen.starts_with("HTTP/1.1 200"), "{seen}");
        assert!(seen.ends_with("ok"), "answered in full before closing: {seen}");
    }

    // Paused time: the clock moves only when every task waits, so the 50 ms deadlines cannot
    // expire while the server is still reading the request on a loaded machine; the sleep below
    // moves it past both of them, several times over, with the request held.
    #[tokio::test(start_paused = true)]
    async fn a_request_in_flight_is_not_cut_by_either_timeout() {
        // The handler answers only after both timeouts have passed several times over.
        let (release, wait) = tokio::sync::oneshot::channel::<()>();
        let (arrived, arrived_rx) = tokio::sync::oneshot::channel::<()>();
        let wait = Arc::new(Mutex::new(Some((wait, arrived))));
        let app = axum::Router::new().route(
            "/",
            axum::routing::get(move || {
                let wait = wait.lock().unwrap().take().map(|(wait, arrived)| {
                    let _ = arrived.send(());
                    wait
                });
                async move {
                    if let Some(wait) = wait {
                        let _ = wait.await;
                    }
                    "late"
                }
            }),
        );
        let (listener, addr) = bind("127.0.0.1:0".parse().unwrap()).await.unwrap();
        let timeouts = ConnTimeouts {
            header_read: Duration::from_millis(50),
            idle: Duration::from_millis(50),
        };
        tokio::spawn(serve_with(listener, app, Shutdown::new(), timeouts));
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        // The handler holds the request (its arrival is the signal); then the clock passes both
        // deadlines, and only then does it answer.
        arrived_rx.await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        release.send(()).unwrap();
        let seen = until_closed(&mut stream).await;
        assert!(
            seen.starts_with("HTTP/1.1 200") && seen.ends_with("late"),
            "{seen:?}"
        );
    }

    #[test]
    fn accept_back_off_doubles_to_a_second_and_resets() {
        let mut b = AcceptBackoff(AcceptBackoff::FIRST);
        let pauses: Vec<u64> = (0..9).map(|_| b.next().as_millis() as u64).collect();
        assert_eq!(pauses, [10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
        b.reset();
        assert_eq!(b.next(), AcceptBackoff::FIRST);
        let emfile = io::Error::from_raw_os_error(24);
        assert!(!one_connections_error(&emfile), "descriptors exhausted backs off");
        assert!(one_connections_error(&io::Error::from(
            io::ErrorKind::ConnectionAborted
        )));
    }

    #[test]
    fn the_default_header_timeout_is_well_under_a_minute() {
        assert!(ConnTimeouts::default().header_read <= Duration::from_secs(10));
    }
}
