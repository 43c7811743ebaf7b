//! How many batches per second one subscriber takes from one publisher over loopback TCP, with
//! every batch decoded: `cargo run --release -p kvroute-zmq --example zmq_throughput [batches]`.
//!
//! Each batch holds one `BlockStored` of 4 blocks of 16 tokens (a scheduler step's worth for a
//! small batch). The clock runs from the first measured publish to the last batch received.
//! The publisher goes as fast as it can, faster than the socket drains, so its PUB queue
//! overflows and the subscriber recovers the losses through replay, as it would in production;
//! the counters printed say how many.

use std::time::{Duration, Instant};

use kvroute_core::ids::{ExternalBlockHash, WorkerId};
use kvroute_wire::{BlockStored, WireEvent};
use kvroute_zmq::{EventPublisher, PublisherConfig, SubscriberConfig, SubscriberEvent, spawn_subscriber};

fn event(i: u64) -> WireEvent {
    WireEvent::BlockStored(BlockStored {
        block_hashes: (0..4).map(|b| ExternalBlockHash(i * 4 + b)).collect(),
        parent_block_hash: Some(ExternalBlockHash(i)),
        token_ids: (0..64).collect(),
        block_size: 16,
        lora_id: None,
        medium: Some("GPU".into()),
        lora_name: None,
        cache_salt: None,
        group_idx: None,
    })
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let batches: u64 = std::env::args()
        .nth(1)
        .map(|n| n.parse())
        .transpose()?
        .unwrap_or(200_000);
    let publisher = EventPublisher::start(PublisherConfig {
        replay_endpoint: Some("tcp://127.0.0.1:0".into()),
        ..PublisherConfig::new("tcp://127.0.0.1:0")
    })
    .await?;
    let mut config = SubscriberConfig::new(WorkerId(0), publisher.endpoint());
    config.replay_endpoint = publisher.replay_endpoint().map(str::to_owned);
    let (tx, mut rx) = tokio::sync::mpsc::channel(4096);
    let subscriber = spawn_subscriber(config, tx).await?;
    // Warm up until connected, then until every warm-up batch is in.
    let mut seen = None;
    while seen.is_none() {
        publisher.publish(Vec::new(), None, 0.0)?;
        if let Ok(Some(SubscriberEvent::Batch { batch, .. })) =
            tokio::time::timeout(Duration::from_millis(20), rx.recv()).await
        {
            seen = Some(batch.seq);
        }
    }
    let last_warmup = publisher.next_seq() - 1;
    while seen != Some(last_warmup) {
        if let Some(SubscriberEvent::Batch { batch, .. }) = rx.recv().await {
            seen = Some(batch.seq);
        }
    }
    let first = publisher.next_seq();
    let last = first + batches - 1;
    let start = Instant::now();
    let consumer = tokio::spawn(async move {
        let mut received = 0u64;
        while let Some(event) = rx.recv().await {
            if let SubscriberEvent::Batch { batch, .. } = event {
                received += 1;
                if batch.seq >= last {
                    break;
                }
            }
        }
        received
    });
    for i in 0..batches {
        publisher.publish(vec![event(i)], Some(0), 0.0)?;
        if i % 1024 == 0 {
            // Let the other tasks run: a publisher this fast would otherwise only fill queues.
            tokio::task::yield_now().await;
        }
    }
    // A PUB drops past its queue, and a dropped tail shows no gap until a later batch: send
    // empty ones until the consumer has seen the end.
    while !consumer.is_finished() {
        publisher.publish(Vec::new(), None, 0.0)?;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let received = consumer.await?;
    let elapsed = start.elapsed();
    let counters = subscriber.counters().snapshot();
    println!(
        "{received} batches in {:.3} s: {:.0} batches/s ({:.2} us each); gaps {} (recovered {}, lost {}), replayed {}",
        elapsed.as_secs_f64(),
        received as f64 / elapsed.as_secs_f64(),
        elapsed.as_secs_f64() * 1e6 / received as f64,
        counters.gaps_detected,
        counters.gaps_recovered,
        counters.gaps_lost,
        counters.replayed,
    );
    Ok(())
}
