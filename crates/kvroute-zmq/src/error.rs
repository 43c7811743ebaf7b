//! The crate's one error type.

/// Why a subscriber or publisher could not start, or a batch could not be published. Problems
/// with what arrives on a socket are never errors: they are events
/// ([`SubscriberEvent::Error`](crate::SubscriberEvent::Error)) and counters.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ZmqError {
    /// The configuration is invalid; the message names the field.
    #[error("invalid config: {0}")]
    Config(String),
    /// The ZMQ socket refused (a bad endpoint, an address in use, a failed connect).
    #[error("{what}: {source}")]
    Socket {
        /// What was being done, with the endpoint.
        what: String,
        /// The socket library's error.
        #[source]
        source: zeromq::ZmqError,
    },
    /// The batch cannot be encoded (an array longer than msgpack allows).
    #[error("encoding a batch: {0}")]
    Encode(#[from] kvroute_wire::EncodeError),
    /// The background task is gone (the runtime shut down).
    #[error("the publisher's task has stopped")]
    Stopped,
}

impl ZmqError {
    /// A socket error while doing `what`.
    pub(crate) fn socket(what: impl Into<String>, source: zeromq::ZmqError) -> Self {
        Self::Socket {
            what: what.into(),
            source,
        }
    }
}
