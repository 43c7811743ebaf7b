//! Router replicas over one fleet: one replica is the single-router run; several keep the
//! invariants and are deterministic with sync off, on, delayed and lossy; synced replicas route
//! like one router where unsynced ones lose what only a peer knew.

use std::time::Duration;

mod common;

use common::{count, run, shrink};
use kvroute_core::router::PolicyConfig;
use kvroute_sim::report::Value;
use kvroute_sim::synthetic::{ArrivalProcess, Lengths, SyntheticConfig, generate};
use kvroute_sim::{ReplicaSync, Replicas, RunResult, SimConfig, Spread, Workload};

fn config(policy: &str, replicas: usize, sync: ReplicaSync) -> SimConfig {
    let mut config = shrink(SimConfig::new(4));
    config.router.policy = PolicyConfig::from_name(policy).expect("a policy");
    config.replicas = Replicas {
        count: replicas,
        sync,
        spread: Spread::RoundRobin,
        ..Replicas::default()
    };
    config
}

/// Bursty multi-turn sessions over shared prefixes: what a replica knows matters.
fn workload() -> Workload {
    generate(
        &SyntheticConfig {
            requests: 160,
            rate_rps: 30.0,
            arrival: ArrivalProcess::Gamma { cv: 3.0 },
            isl: Lengths::Uniform { min: 32, max: 300 },
            osl: Lengths::Uniform { min: 1, max: 40 },
            prefix_groups: 6,
            shared_prefix_tokens: 160,
            turns_per_session: 3,
            think_time: Duration::from_millis(150),
            ..SyntheticConfig::default()
        },
        16,
    )
}

fn json(result: &RunResult) -> String {
    serde_json::to_string(&result.report).expect("serializable")
}

fn reuse(result: &RunResult) -> f64 {
    result.report.number("prefix_cache_reused_ratio").expect("reuse")
}

const ON: ReplicaSync = ReplicaSync::On {
    delay: Duration::ZERO,
    loss: 0.0,
};

#[test]
fn one_replica_with_sync_on_is_the_single_router_run() {
    let w = workload();
    let alone = run(config("kv", 1, ReplicaSync::Off), &w);
    let synced = run(config("kv", 1, ON), &w);
    let without_sync_keys = |r: &RunResult| -> Vec<(&'static str, Value)> {
        r.report
            .entries()
            .iter()
            .filter(|(k, _)| !k.starts_with("sync_"))
            .cloned()
            .collect()
    };
    assert_eq!(without_sync_keys(&alone), without_sync_keys(&synced));
    assert_eq!(alone.requests, synced.requests);
    assert_eq!(count(&alone, "router_replicas"), 1);
    assert!(alone.report.get("sync_events_published").is_none());
    assert!(count(&synced, "sync_events_published") > 0);
}

#[test]
fn replicas_keep_the_invariants_and_give_byte_identical_reports() {
    let w = workload();
    let modes = [
        ReplicaSync::Off,
        ON,
        ReplicaSync::On {
            delay: Duration::from_millis(5),
            loss: 0.0,
        },
        ReplicaSync::On {
            delay: Duration::from_millis(20),
            loss: 0.1,
        },
    ];
    let cases = [
        ("kv", 4, modes[0], Spread::RoundRobin),
        ("kv", 4, modes[1], Spread::Random),
        ("kv", 3, modes[2], Spread::RoundRobin),
        ("kv", 2, modes[3], Spread::Random),
        ("sglang-cache-aware", 4, modes[2], Spread::RoundRobin),
        ("sglang-cache-aware", 3, modes[3], Spread::RoundRobin),
    ];
    for (policy, replicas, sync, spread) in cases {
        let mut c = config(policy, replicas, sync);
        c.replicas.spread = spread;
        let what = format!("{policy}, {replicas} replicas, {sync:?}, {spread:?}");
        let a = run(c.clone(), &w);
        let b = run(c, &w);
        assert_eq!(json(&a), json(&b), "{what}");
        assert_eq!(count(&a, "completed_requests"), 160, "{what}");
        assert_eq!(count(&a, "router_replicas"), replicas as u64, "{what}");
        let lost = count(&a, "sync_events_lost");
        match sync {
            ReplicaSync::Off => assert_eq!(count(&a, "sync_events_published"), 0, "{what}"),
            ReplicaSync::On { loss, .. } => {
                assert!(count(&a, "sync_events_published") > 0, "{what}");
                assert_eq!(lost > 0, loss > 0.0, "{what}");
            }
        }
    }
}

#[test]
fn synced_replicas_keep_the_single_routers_cache_reuse_and_unsynced_ones_lose_it() {
    // The SGLang-like policy routes from its tree of routed prompts: without sync each replica's
    // tree holds a quarter of the history; with sync a peer's decision reaches the tree too.
    let w = workload();
    let one = reuse(&run(config("sglang-cache-aware", 1, ReplicaSync::Off), &w));
    let off = reuse(&run(config("sglang-cache-aware", 4, ReplicaSync::Off), &w));
    let on = reuse(&run(config("sglang-cache-aware", 4, ON), &w));
    eprintln!("reuse: one router {one:.4}, 4 replicas off {off:.4}, on {on:.4}");
    assert!(off < one - 0.05, "unsynced replicas lose reuse: {off} vs {one}");
    assert!((on - one).abs() <= 0.02, "synced replicas keep it: {on} vs {one}");
}

#[test]
fn a_late_replica_joins_and_a_dead_ones_bookings_are_released_by_every_peer() {
    let w = workload();
    let mut c = config(
        "kv",
        4,
        ReplicaSync::On {
            delay: Duration::from_millis(2),
            loss: 0.0,
        },
    );
    c.replicas.join_at = Some(Duration::from_millis(800));
    c.replicas.fail_at = Some(Duration::from_millis(1500));
    let a = run(c.clone(), &w);
    let b = run(c, &w);
    assert_eq!(json(&a), json(&b), "byte-identical");
    // Every request completes: the dead replica's run to their end on their engines.
    assert_eq!(count(&a, "completed_requests"), w.requests.len() as u64);
    // The three survivors, the late one included, each lose the dead one.
    assert_eq!(count(&a, "sync_peers_lost"), 3, "{}", json(&a));
    assert_eq!(count(&a, "sync_messages_lost"), 0);
}

#[test]
fn a_late_join_or_a_death_needs_replicas_to_spare() {
    let mut c = config("kv", 1, ON);
    c.replicas.fail_at = Some(Duration::from_secs(1));
    let Err(err) = kvroute_sim::Simulation::new(c) else {
        panic!("refused")
    };
    let err = err.to_string();
    assert!(err.contains("at least 2 replicas"), "{err}");
    let mut c = config("kv", 2, ON);
    c.replicas.join_at = Some(Duration::from_secs(2));
    c.replicas.fail_at = Some(Duration::from_secs(1));
    let Err(err) = kvroute_sim::Simulation::new(c) else {
        panic!("refused")
    };
    let err = err.to_string();
    assert!(err.contains("leaves none"), "{err}");
}
