//! Sockets: the HTTP/1.1 accept loop the proxy and the mock workers share, and the pooled
//! upstream client. TCP_NODELAY is set on both legs: without it a streamed response stalls on
//! Nagle's algorithm and delayed ACKs (about 44 ms per response on Linux).

use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

/// The upstream client: pooled keep-alive connections, TCP_NODELAY, a connect timeout.
pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// A pooled client with TCP_NODELAY and `connect_timeout`.
pub fn client(connect_timeout: Duration) -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    connector.set_keepalive(Some(Duration::from_secs(60)));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(1024)
        .build(connector)
}

/// A stop switch for a server: [`Shutdown::stop`] closes the listener and every connection at
/// once (in-flight responses end abruptly, as when a process dies).
#[derive(Clone, Debug)]
pub struct Shutdown(watch::Sender<bool>);

impl Shutdown {
    /// A switch, not yet thrown.
    pub fn new() -> Self {
        Self(watch::channel(false).0)
    }

    /// Throws the switch.
    pub fn stop(&self) {
        self.0.send_replace(true);
    }

    /// Whether it was thrown.
    pub fn is_stopped(&self) -> bool {
        *self.0.borrow()
    }

    /// Resolves when the switch is thrown.
    pub async fn stopped(&self) {
        let mut rx = self.0.subscribe();
        // An error means the sender is gone, which cannot happen while `self` lives.
        let _ = rx.wait_for(|&s| s).await;
    }
}

impl Default for Shutdown {
    fn default() -> Self {
        Self::new()
    }
}

/// Serves `app` on `listener` over HTTP/1.1 (keep-alive, TCP_NODELAY) until `shutdown`; then
/// closes the listener and aborts every connection.
pub async fn serve(listener: TcpListener, app: axum::Router, shutdown: Shutdown) {
    let mut connections = JoinSet::new();
    let service = hyper_util::service::TowerToHyperService::new(app);
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((stream, _)) = accepted else { continue };
                let _ = stream.set_nodelay(true);
                let service = service.clone();
                connections.spawn(async move {
                    let _ = hyper::server::conn::http1::Builder::new()
                        .keep_alive(true)
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
            () = shutdown.stopped() => break,
        }
    }
    drop(listener);
    connections.abort_all();
    while connections.join_next().await.is_some() {}
}

/// Binds `addr` (port 0 picks a free port) and returns the listener and its address.
pub async fn bind(addr: SocketAddr) -> std::io::Result<(TcpListener, SocketAddr)> {
    let listener = TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    Ok((listener, local))
}
