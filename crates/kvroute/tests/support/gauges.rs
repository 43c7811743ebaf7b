//! The load gauges against the truth, read from the proxy's Prometheus exposition (what an
//! operator sees): per worker, the requests, active decode blocks and prefill tokens the router
//! books, and the router's active requests. Shared by the test files that break things (`#[path]`
//! included), so "the gauges returned to the truth" is one check everywhere.

#![allow(dead_code)]

use std::collections::BTreeMap;

/// One worker's booked load, as its gauges say (summed over its ranks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Booked {
    /// `kvroute_worker_active_requests`.
    pub requests: u64,
    /// `dynamo_frontend_worker_active_decode_blocks`.
    pub decode_blocks: u64,
    /// `dynamo_frontend_worker_active_prefill_tokens`.
    pub prefill_tokens: u64,
}

/// The value of a label `name` in a sample line's label set, if it has one.
fn label<'a>(line: &'a str, name: &str) -> Option<&'a str> {
    let labels = line.split_once('{')?.1.split_once('}')?.0;
    labels.split(',').find_map(|kv| {
        let (k, v) = kv.split_once('=')?;
        (k.trim() == name).then(|| v.trim().trim_matches('"'))
    })
}

/// Each worker's booked load (by `worker_id`) and the router's active requests, from a
/// Prometheus text exposition.
pub fn booked(text: &str) -> (BTreeMap<u64, Booked>, u64) {
    let mut workers: BTreeMap<u64, Booked> = BTreeMap::new();
    let mut active = 0;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some(name) = line.split([' ', '{']).next() else {
            continue;
        };
        let Some(value) = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else {
            continue;
        };
        let value = value as u64;
        if name == "kvroute_router_active_requests" {
            active = value;
            continue;
        }
        let Some(id) = label(line, "worker_id").and_then(|w| w.parse().ok()) else {
            continue;
        };
        let slot: fn(&mut Booked) -> &mut u64 = match name {
            "kvroute_worker_active_requests" => |b| &mut b.requests,
            "dynamo_frontend_worker_active_decode_blocks" => |b| &mut b.decode_blocks,
            "dynamo_frontend_worker_active_prefill_tokens" => |b| &mut b.prefill_tokens,
            _ => continue,
        };
        *slot(workers.entry(id).or_default()) += value;
    }
    (workers, active)
}

/// Why the gauges of `text` are not the truth of `in_flight` (worker id → requests still in
/// flight there), or `None` if they are: each worker books exactly its requests in flight, a
/// worker with none books no blocks and no prefill tokens, and the router's active requests
/// are their sum. A worker absent from `in_flight` has none.
pub fn mismatch(text: &str, in_flight: &[(u64, u64)]) -> Option<String> {
    let (workers, active) = booked(text);
    let want = |id: u64| {
        in_flight
            .iter()
            .filter(|&&(w, _)| w == id)
            .map(|&(_, n)| n)
            .sum::<u64>()
    };
    let total: u64 = in_flight.iter().map(|&(_, n)| n).sum();
    let mut wrong = Vec::new();
    if active != total {
        wrong.push(format!("router active requests {active}, want {total}"));
    }
    for (&id, b) in &workers {
        let n = want(id);
        if b.requests != n || (n == 0 && (b.decode_blocks, b.prefill_tokens) != (0, 0)) {
            wrong.push(format!("worker {id} books {b:?}, want {n} requests"));
        }
    }
    for &(id, n) in in_flight {
        if n > 0 && !workers.contains_key(&id) {
            wrong.push(format!("worker {id} has no series, want {n} requests"));
        }
    }
    (!wrong.is_empty()).then(|| wrong.join("; "))
}

/// [`mismatch`] of the idle truth: nothing in flight anywhere.
pub fn idle_mismatch(text: &str) -> Option<String> {
    mismatch(text, &[])
}

#[test]
fn the_truth_is_read_from_an_exposition() {
    let text = "# HELP x\n\
        kvroute_router_active_requests 1\n\
        kvroute_worker_active_requests{dp_rank=\"0\",worker_id=\"0\",worker_type=\"agg\"} 1\n\
        dynamo_frontend_worker_active_decode_blocks{dp_rank=\"0\",worker_id=\"0\",worker_type=\"agg\"} 3\n\
        kvroute_worker_active_requests{dp_rank=\"0\",worker_id=\"1\",worker_type=\"agg\"} 0\n\
        dynamo_frontend_worker_active_prefill_tokens{dp_rank=\"0\",worker_id=\"1\",worker_type=\"agg\"} 0\n";
    assert_eq!(mismatch(text, &[(0, 1)]), None);
    assert!(mismatch(text, &[(1, 1)]).is_some());
    assert!(idle_mismatch(text).is_some());
    let leaked = text.replace(
        "active_prefill_tokens{dp_rank=\"0\",worker_id=\"1\",worker_type=\"agg\"} 0",
        "active_prefill_tokens{dp_rank=\"0\",worker_id=\"1\",worker_type=\"agg\"} 5",
    );
    assert!(mismatch(&leaked, &[(0, 1)]).unwrap().contains("worker 1"));
}
