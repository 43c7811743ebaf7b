//! The `kvroute_sync_*` metrics, registered in the host's Prometheus registry.

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// Replica sync's metrics.
#[derive(Clone, Debug)]
pub struct SyncMetrics {
    /// `kvroute_sync_connected`: 1 while connected to NATS.
    pub connected: IntGauge,
    /// `kvroute_sync_peers`: replicas heard within the peer timeout.
    pub peers: IntGauge,
    /// `kvroute_sync_messages_sent_total`, by kind (`events`, `heartbeat`, `snapshot`,
    /// `join`).
    pub messages_sent: IntCounterVec,
    /// `kvroute_sync_bytes_sent_total`: payload bytes published.
    pub bytes_sent: IntCounter,
    /// `kvroute_sync_events_sent_total`: changes published.
    pub events_sent: IntCounter,
    /// `kvroute_sync_messages_received_total`: peers' messages received.
    pub messages_received: IntCounter,
    /// `kvroute_sync_bytes_received_total`: their payload bytes.
    pub bytes_received: IntCounter,
    /// `kvroute_sync_events_dropped_total`, by cause: `queue_full` (the outgoing queue
    /// overflowed), `disconnected` (no NATS connection when the batch was due).
    pub events_dropped: IntCounterVec,
    /// `kvroute_sync_decode_errors_total`: messages that were not sync messages.
    pub decode_errors: IntCounter,
    /// `kvroute_sync_versions_refused_total`, by format (`json`, `binary`): messages of another
    /// format version (a replica of another version), refused.
    pub versions_refused: IntCounterVec,
    /// `kvroute_sync_peers_lost_total`: peers whose bookings were released after their
    /// heartbeats stopped.
    pub peers_lost: IntCounter,
    /// `kvroute_sync_resyncs_total`: joins and rejoins (snapshot exchanges).
    pub resyncs: IntCounter,
    /// `kvroute_sync_booking_age_seconds`: how old a peer's booking is when this replica has
    /// applied it, from the moment the peer's transport took it off its queue (wall clocks; on
    /// one host, or hosts with synced clocks).
    pub booking_age: Histogram,
}

impl SyncMetrics {
    /// Fresh metrics, registered in `registry` (errors only if already registered there).
    pub fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let counter = |name: &str, help: &str| -> Result<IntCounter, prometheus::Error> {
            let c = IntCounter::new(name, help)?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        let gauge = |name: &str, help: &str| -> Result<IntGauge, prometheus::Error> {
            let g = IntGauge::new(name, help)?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let vec = |name: &str, help: &str, label: &str| -> Result<IntCounterVec, prometheus::Error> {
            let c = IntCounterVec::new(Opts::new(name, help), &[label])?;
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        };
        Ok(Self {
            connected: gauge("kvroute_sync_connected", "1 while connected to NATS")?,
            peers: gauge(
                "kvroute_sync_peers",
                "Router replicas heard within the peer timeout",
            )?,
            messages_sent: vec(
                "kvroute_sync_messages_sent_total",
                "Sync messages published, by kind",
                "kind",
            )?,
            bytes_sent: counter("kvroute_sync_bytes_sent_total", "Sync payload bytes published")?,
            events_sent: counter("kvroute_sync_events_sent_total", "Sync events published")?,
            messages_received: counter(
                "kvroute_sync_messages_received_total",
                "Peers' sync messages received",
            )?,
            bytes_received: counter(
                "kvroute_sync_bytes_received_total",
                "Peers' sync payload bytes received",
            )?,
            events_dropped: vec(
                "kvroute_sync_events_dropped_total",
                "Sync events not published, by cause",
                "cause",
            )?,
            decode_errors: counter(
                "kvroute_sync_decode_errors_total",
                "Messages on the sync subjects that were not sync messages",
            )?,
            versions_refused: vec(
                "kvroute_sync_versions_refused_total",
                "Sync messages of another format version (a replica of another version), refused, by format",
                "format",
            )?,
            peers_lost: counter(
                "kvroute_sync_peers_lost_total",
                "Peers whose bookings were released after their heartbeats stopped",
            )?,
            resyncs: counter(
                "kvroute_sync_resyncs_total",
                "Snapshot exchanges with the peers (joins and rejoins)",
            )?,
            booking_age: {
                // 50 µs to about 6 s, 25 % apart.
                let buckets = prometheus::exponential_buckets(50e-6, 1.25, 54)?;
                let h = Histogram::with_opts(
                    HistogramOpts::new(
                        "kvroute_sync_booking_age_seconds",
                        "Age of a peer's booking when applied here, from its sender's queue",
                    )
                    .buckets(buckets),
                )?;
                registry.register(Box::new(h.clone()))?;
                h
            },
        })
    }
}
