//! Bind or connect: which side of a ZMQ link listens.
//!
//! vLLM's publisher decides from its endpoint string alone: it binds when the endpoint contains
//! `*` or `::` or starts with `ipc://` or `inproc://`, and connects otherwise (so an engine given
//! a concrete address connects out to a router that binds there, llm-d's "centralized" mode).
//! [`publisher_mode`] is that rule, byte for byte.
//!
//! A subscriber meets the publisher from the other side, so its default is the rule's mirror
//! image for the endpoint *it* is given ([`subscriber_mode`]): it binds only when the address is
//! a wildcard (`tcp://*:5557`, `tcp://0.0.0.0:5557`, `tcp://[::]:5557`), which can only be
//! listened on, and connects to everything else, including `ipc://` paths, because vLLM binds
//! those. Either side's config may override the default.

use serde::{Deserialize, Serialize};

use crate::error::ZmqError;

/// Which side of a link a socket takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SocketMode {
    /// Listen on the endpoint; the peer connects.
    Bind,
    /// Connect to the endpoint, where the peer listens.
    Connect,
}

/// vLLM's rule for its PUB socket: bind if `endpoint` contains `*` or `::` or starts with
/// `ipc://` or `inproc://`, connect otherwise.
pub fn publisher_mode(endpoint: &str) -> SocketMode {
    let binds = endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://");
    if binds {
        SocketMode::Bind
    } else {
        SocketMode::Connect
    }
}

/// The subscriber's default: bind when `endpoint` is a TCP wildcard address (`*`, `0.0.0.0`,
/// `::` or `[::]` as the host), connect otherwise (a concrete host, or an `ipc://` path that the
/// engine binds).
pub fn subscriber_mode(endpoint: &str) -> SocketMode {
    let wildcard = endpoint
        .strip_prefix("tcp://")
        .and_then(|rest| rest.rsplit_once(':'))
        .is_some_and(|(host, _port)| matches!(host, "*" | "0.0.0.0" | "[::]" | "::" | "[*]"));
    if wildcard {
        SocketMode::Bind
    } else {
        SocketMode::Connect
    }
}

/// The endpoint of data-parallel rank `rank` of an engine configured with `endpoint`, by vLLM's
/// rule: each rank publishes on its own endpoint, the TCP port plus the rank, or for `inproc://`
/// the name with `_dp{rank}` appended; rank 0 keeps the endpoint as it is. The same rule gives
/// the replay endpoints. Errors for a port that would pass 65535 and for `ipc://` endpoints of
/// ranks past 0 (no offset rule is known for them).
pub fn rank_endpoint(endpoint: &str, rank: u32) -> Result<String, ZmqError> {
    if rank == 0 {
        return Ok(endpoint.to_owned());
    }
    if endpoint.starts_with("inproc://") {
        return Ok(format!("{endpoint}_dp{rank}"));
    }
    let bad = |why: &str| ZmqError::Config(format!("endpoint {endpoint:?} for rank {rank}: {why}"));
    let (base, port) = endpoint
        .strip_prefix("tcp://")
        .and_then(|_| endpoint.rsplit_once(':'))
        .ok_or_else(|| bad("only tcp:// and inproc:// endpoints have a rank offset"))?;
    let port: u16 = port.parse().map_err(|_| bad("the port is not a number"))?;
    let port = u16::try_from(u32::from(port) + rank).map_err(|_| bad("the port passes 65535"))?;
    Ok(format!("{base}:{port}"))
}

/// Takes `socket`'s side of the link at `endpoint` (as [`normalize`] gives it). In bind mode it
/// binds now and returns the address bound (port 0 resolved) and nothing to connect to; in
/// connect mode it returns the endpoint twice, as the address and as what the socket's task
/// connects to in the background (so that a peer that is not up yet does not hold the caller).
pub(crate) async fn bind_or_defer(
    socket: &mut impl zeromq::Socket,
    mode: SocketMode,
    endpoint: String,
) -> Result<(String, Option<String>), ZmqError> {
    match mode {
        SocketMode::Bind => {
            let bound = socket
                .bind(&endpoint)
                .await
                .map_err(|e| ZmqError::socket(format!("binding {endpoint}"), e))?;
            Ok((bound.to_string(), None))
        }
        SocketMode::Connect => Ok((endpoint.clone(), Some(endpoint))),
    }
}

/// The endpoint as the `zeromq` crate takes it: a `*` host becomes `0.0.0.0` (libzmq's spelling
/// of "every interface", which the crate would try to resolve as a host name).
pub(crate) fn normalize(endpoint: &str) -> String {
    match endpoint.strip_prefix("tcp://*:") {
        Some(port) => format!("tcp://0.0.0.0:{port}"),
        None => match endpoint.strip_prefix("tcp://[*]:") {
            Some(port) => format!("tcp://[::]:{port}"),
            None => endpoint.to_owned(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_follow_the_endpoint() {
        use SocketMode::{Bind, Connect};
        // (endpoint, publisher (vLLM's rule), subscriber)
        let cases = [
            ("tcp://*:5557", Bind, Bind),
            ("tcp://0.0.0.0:5557", Connect, Bind),
            ("tcp://[::]:5557", Bind, Bind),
            ("tcp://[::1]:5557", Bind, Connect),
            ("tcp://127.0.0.1:5557", Connect, Connect),
            ("tcp://router.local:5557", Connect, Connect),
            ("ipc:///tmp/kv.sock", Bind, Connect),
            ("inproc://kv", Bind, Connect),
        ];
        for (endpoint, publisher, subscriber) in cases {
            assert_eq!(publisher_mode(endpoint), publisher, "publisher {endpoint}");
            assert_eq!(subscriber_mode(endpoint), subscriber, "subscriber {endpoint}");
        }
    }

    #[test]
    fn each_rank_has_its_own_endpoint() {
        let cases = [
            ("tcp://*:5557", 0, Some("tcp://*:5557")),
            ("tcp://*:5557", 3, Some("tcp://*:5560")),
            ("tcp://[::1]:5557", 1, Some("tcp://[::1]:5558")),
            ("tcp://10.0.0.1:65535", 1, None),
            ("inproc://kv", 0, Some("inproc://kv")),
            ("inproc://kv", 2, Some("inproc://kv_dp2")),
            ("ipc:///tmp/kv", 0, Some("ipc:///tmp/kv")),
            ("ipc:///tmp/kv", 1, None),
            ("tcp://host:port", 1, None),
        ];
        for (endpoint, rank, expected) in cases {
            assert_eq!(
                rank_endpoint(endpoint, rank).ok().as_deref(),
                expected,
                "{endpoint} rank {rank}"
            );
        }
    }

    #[test]
    fn wildcards_are_spelled_for_the_zeromq_crate() {
        assert_eq!(normalize("tcp://*:5557"), "tcp://0.0.0.0:5557");
        assert_eq!(normalize("tcp://[*]:5557"), "tcp://[::]:5557");
        assert_eq!(normalize("tcp://127.0.0.1:1"), "tcp://127.0.0.1:1");
        assert_eq!(normalize("ipc:///tmp/x"), "ipc:///tmp/x");
    }
}
