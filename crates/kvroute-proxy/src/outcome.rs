//! How a request ended, in the words the metrics label it with: whether it streamed
//! ([`RequestKind`]), its outcome by cause ([`RequestOutcome`]) and what its usage said of its
//! cached prompt tokens ([`CachedReport`]). The request path decides these; [`crate::metrics`]
//! counts them.

/// Whether a request streams, as the metrics label it (`unary` until it is parsed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestKind {
    /// One JSON body.
    Unary,
    /// Server-sent events.
    Stream,
}

impl RequestKind {
    /// The `request_type` label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Unary => "unary",
            Self::Stream => "stream",
        }
    }
}

/// How a generation request ended, by cause: the `outcome` label of
/// `kvroute_requests_outcome_total`. Known only when the response has ended (or was given up).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestOutcome {
    /// The worker answered 2xx and its response reached its end.
    Ok,
    /// The client left before the response ended.
    ClientCancelled,
    /// The worker answered an error (non-2xx, an error event in a stream, a failed prefill
    /// hop) or could not be reached.
    UpstreamError,
    /// The worker's response broke off after it had begun (connection reset mid-stream).
    UpstreamReset,
    /// The worker did not answer in time, or went silent mid-stream.
    Timeout,
    /// The proxy turned the request away (no worker, queue full or timed out): a 503.
    Rejected,
    /// The request itself was refused (bad body, unknown model, too long): a 4xx.
    BadRequest,
}

impl RequestOutcome {
    /// Every outcome, in label order.
    pub const ALL: [Self; 7] = [
        Self::Ok,
        Self::ClientCancelled,
        Self::UpstreamError,
        Self::UpstreamReset,
        Self::Timeout,
        Self::Rejected,
        Self::BadRequest,
    ];

    /// The `outcome` label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::ClientCancelled => "client_cancelled",
            Self::UpstreamError => "upstream_error",
            Self::UpstreamReset => "upstream_reset",
            Self::Timeout => "timeout",
            Self::Rejected => "rejected",
            Self::BadRequest => "bad_request",
        }
    }

    /// The `status` label of `dynamo_frontend_requests_total`.
    pub(crate) fn status(self) -> &'static str {
        match self {
            Self::Ok => "success",
            Self::Rejected => "rejected",
            _ => "error",
        }
    }
}

/// What a completed response's usage said of its cached prompt tokens. vLLM fills
/// `prompt_tokens_details.cached_tokens` only when started with
/// `--enable-prompt-tokens-details`, and leaves it out when it is 0, so an absent field is
/// "0 or not reported", kept apart from a reported number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CachedReport {
    /// The engine reported this many cached prompt tokens.
    Reported(u64),
    /// The usage had no `cached_tokens` (0 cached, or the engine does not report it).
    Absent,
    /// The response carried no usage.
    NoUsage,
}

impl CachedReport {
    /// The `report` label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Reported(_) => "reported",
            Self::Absent => "absent",
            Self::NoUsage => "no_usage",
        }
    }

    /// Every report, in [`Self::slot`] order (the count of `Reported` aside).
    pub(crate) const ALL: [Self; 3] = [Self::Reported(0), Self::Absent, Self::NoUsage];

    /// Its place in [`Self::ALL`].
    pub(crate) fn slot(self) -> usize {
        match self {
            Self::Reported(_) => 0,
            Self::Absent => 1,
            Self::NoUsage => 2,
        }
    }
}
