//! A slower tier (vLLM's CPU offloading): blocks an engine offloaded are kept per tier, placed
//! by the GPU blocks the index knows under the same hashes, and a prompt held only there is
//! routed to as a hit that costs its transfer: cheaper than a miss, dearer than a GPU hit.

use std::collections::{BTreeMap, BTreeSet};

use kvroute_core::hash::sequence_hashes_into;
use kvroute_core::ids::{
    DpRank, ExternalBlockHash, LocalBlockHash, RequestId, SequenceHash, WorkerId, WorkerKey,
};
use kvroute_core::index::{
    IndexConfig, IndexError, IndexLayout, OverlapScores, PrefixIndex, RunIndex, StoredBlock, Tier,
};
use kvroute_core::router::{
    IndexEvent, PolicyConfig, Prompt, RequestView, RouteOutcome, RouteRequest, Router, RouterConfig,
    WorkerRole, WorkerSpec, cost,
};
use kvroute_core::time::Timestamp;
use proptest::prelude::*;

const BLOCK: u32 = 16;
const T: Timestamp = Timestamp(0);

fn key(w: u64) -> WorkerKey {
    WorkerKey::new(WorkerId(w), DpRank(0))
}

/// The prompt's blocks 0..n as worker `w` names them (each worker its own external hashes).
fn blocks(w: u64, n: u64) -> Vec<StoredBlock> {
    (0..n)
        .map(|i| StoredBlock {
            local: LocalBlockHash(1000 + i),
            external: ExternalBlockHash(w * 10_000 + i),
        })
        .collect()
}

fn ext(w: u64, range: std::ops::Range<u64>) -> Vec<ExternalBlockHash> {
    range.map(|i| ExternalBlockHash(w * 10_000 + i)).collect()
}

fn locals(n: u64) -> Vec<LocalBlockHash> {
    (0..n).map(|i| LocalBlockHash(1000 + i)).collect()
}

fn chain(n: u64) -> Vec<SequenceHash> {
    let mut c = Vec::new();
    sequence_hashes_into(&locals(n), &mut c);
    c
}

/// What a worker holds: GPU-cached blocks `gpu`, and `cpu` offloaded ones (offloaded while on
/// the GPU, then evicted there where not in `gpu`), as the engine's events say it.
#[derive(Clone, Debug)]
struct Holding {
    gpu: u64,
    cpu: std::ops::Range<u64>,
}

fn feed(apply: &mut dyn FnMut(WorkerKey, IndexEvent<'_>) -> Result<(), IndexError>, w: u64, h: Holding) {
    let all = h.gpu.max(h.cpu.end);
    if all == 0 {
        return;
    }
    apply(
        key(w),
        IndexEvent::Stored {
            parent: None,
            blocks: &blocks(w, all),
        },
    )
    .expect("the test's own input");
    apply(
        key(w),
        IndexEvent::TierStored {
            tier: Tier::Cpu,
            blocks: &ext(w, h.cpu.clone()),
        },
    )
    .expect("the test's own input");
    apply(
        key(w),
        IndexEvent::Removed {
            blocks: &ext(w, h.gpu..all),
        },
    )
    .expect("the test's own input");
}

/// (GPU blocks, CPU blocks, expected GPU depth, expected CPU-only blocks past it) of a prompt
/// of 8 blocks.
const CASES: &[(u64, std::ops::Range<u64>, u32, u32)] = &[
    (0, 0..8, 0, 8), // all on CPU only
    (3, 0..8, 3, 5), // a GPU prefix, the rest on CPU
    (3, 3..6, 3, 3), // the CPU run starts where the GPU's ends
    (3, 4..8, 3, 0), // a gap after the GPU's prefix: no CPU hit
    (8, 0..8, 8, 0), // all on the GPU
    (0, 0..0, 0, 0), // nothing
    (2, 0..2, 2, 0), // the CPU holds only what the GPU does
];

/// Each worker's GPU depths for `locals`.
fn find<L: IndexLayout>(index: &L, locals: &[LocalBlockHash]) -> OverlapScores {
    let mut scores = OverlapScores::default();
    index.find_matches_into(locals, false, &mut scores);
    scores
}

#[test]
fn the_index_gives_each_worker_its_gpu_depth_and_the_cpu_run_past_it() {
    gpu_depth_and_cpu_run::<PrefixIndex>();
    gpu_depth_and_cpu_run::<RunIndex>();
}

fn gpu_depth_and_cpu_run<L: IndexLayout>() {
    for (i, (gpu, cpu, want_gpu, want_cpu)) in CASES.iter().cloned().enumerate() {
        let mut index = L::with_config(IndexConfig::default());
        index.add_worker(key(1));
        feed(&mut |w, e| index.apply_event(w, e), 1, Holding { gpu, cpu });
        index.check_invariants().expect("invariants hold");
        let scores = find(&index, &locals(8));
        assert_eq!(scores.depth(key(1)), want_gpu, "case {i}");
        let mut runs = Vec::new();
        index.tier_runs_into(Tier::Cpu, &chain(8), |w| scores.depth(w), &mut runs);
        let run = runs.iter().find(|(w, _)| *w == key(1)).map_or(0, |&(_, r)| r);
        assert_eq!(run, want_cpu, "case {i}");
    }
}

#[test]
fn a_tier_store_of_a_block_the_gpu_never_held_is_refused_by_name_and_a_clear_empties_every_tier() {
    refused_by_name_and_cleared::<PrefixIndex>();
    refused_by_name_and_cleared::<RunIndex>();
}

fn refused_by_name_and_cleared<L: IndexLayout>() {
    let mut index = L::with_config(IndexConfig::default());
    index.add_worker(key(1));
    feed(
        &mut |w, e| index.apply_event(w, e),
        1,
        Holding { gpu: 4, cpu: 0..4 },
    );
    let unknown = ExternalBlockHash(77);
    let err = index
        .apply_event(
            key(1),
            IndexEvent::TierStored {
                tier: Tier::Cpu,
                blocks: &[ExternalBlockHash(10_000), unknown],
            },
        )
        .expect_err("refused");
    assert!(matches!(
        err,
        IndexError::UnplacedTierBlock { external, unplaced: 1, .. } if external == unknown
    ));
    assert_eq!(index.tier_block_count(key(1), Tier::Cpu), 4);
    assert_eq!(index.stats().tier_unplaced, 1);
    index
        .apply_event(key(1), IndexEvent::Cleared)
        .expect("the test's own input");
    assert_eq!(index.tier_block_count(key(1), Tier::Cpu), 0);
    assert!(!index.has_tier_blocks());
    index.check_invariants().expect("invariants hold");
}

fn router(policy: &str) -> Router {
    let config = RouterConfig {
        policy: policy.parse::<PolicyConfig>().expect("the test's own input"),
        block_size: BLOCK,
        ..RouterConfig::default()
    };
    let mut r = Router::new(config).expect("the test's own input");
    for w in 0..3 {
        r.handle_worker_added(T, WorkerSpec::new(key(w), WorkerRole::Aggregated, 4096))
            .expect("the test's own input");
    }
    r
}

fn route(r: &mut Router, id: u64, n: u64) -> WorkerKey {
    let locals = locals(n);
    let prompt = Prompt::Blocks {
        locals: &locals,
        prompt_tokens: n * u64::from(BLOCK),
    };
    match r
        .handle_request(T, &RouteRequest::new(RequestId(id), prompt))
        .expect("the test's own input")
    {
        RouteOutcome::Routed(d) => {
            r.handle_finished(T, RequestId(id)).expect("the test's own input");
            d.worker
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn blocks_offloaded_to_cpu_are_routed_to_as_a_hit_cheaper_than_a_miss_and_dearer_than_a_gpu_hit() {
    // Worker 0 holds nothing, worker 1 the prompt on its CPU only, worker 2 on its GPU.
    let holdings = [
        Holding { gpu: 0, cpu: 0..0 },
        Holding { gpu: 0, cpu: 0..8 },
        Holding { gpu: 8, cpu: 0..0 },
    ];
    for policy in ["kv", "dynamo", "kv:tier=0.1"] {
        let mut r = router(policy);
        for (w, h) in holdings.iter().cloned().enumerate() {
            feed(
                &mut |k, e| {
                    r.handle_kv_event(T, k, e)
                        .map_err(|_| IndexError::UnknownWorker(k))
                },
                w as u64,
                h,
            );
        }
        let locals = locals(8);
        let prompt = Prompt::Blocks {
            locals: &locals,
            prompt_tokens: 8 * u64::from(BLOCK),
        };
        let candidates = r.candidates(T, &RouteRequest::new(RequestId(0), prompt)).unwrap();
        let c: std::sync::Arc<[SequenceHash]> = chain(8).into();
        let view = RequestView {
            now: T,
            id: RequestId(0),
            prompt_tokens: 8 * u64::from(BLOCK),
            block_size: BLOCK,
            chain: &c,
            fleet_load: r.fleet_load(),
        };
        let (PolicyConfig::Kv(p) | PolicyConfig::Dynamo(p)) = r.config().policy else {
            panic!("a cost policy")
        };
        let costs: Vec<f64> = candidates.iter().map(|x| cost(&p.cost, &view, x)).collect();
        let tiers: Vec<(u32, u32)> = candidates
            .iter()
            .map(|x| (x.overlap_blocks, x.tier_blocks))
            .collect();
        assert_eq!(tiers, [(0, 0), (0, 8), (8, 0)], "{policy}");
        assert!(costs[2] < costs[1] && costs[1] < costs[0], "{policy}: {costs:?}");
        // The GPU hit wins; without it, the CPU hit does, every time.
        assert_eq!(route(&mut r, 1, 8), key(2), "{policy}");
        r.handle_worker_removed(T, key(2)).unwrap();
        for id in 2..20 {
            assert_eq!(route(&mut r, id, 8), key(1), "{policy}");
        }
    }
}

#[test]
fn a_tier_blind_router_sees_a_cpu_only_prefix_as_a_miss() {
    let mut picked = BTreeSet::new();
    for seed in 0..16 {
        let config = RouterConfig {
            policy: "kv:tier=1".parse::<PolicyConfig>().unwrap(),
            block_size: BLOCK,
            seed,
            ..RouterConfig::default()
        };
        let mut r = Router::new(config).unwrap();
        for w in 0..2 {
            r.handle_worker_added(T, WorkerSpec::new(key(w), WorkerRole::Aggregated, 4096))
                .unwrap();
        }
        feed(
            &mut |k, e| {
                r.handle_kv_event(T, k, e)
                    .map_err(|_| IndexError::UnknownWorker(k))
            },
            1,
            Holding { gpu: 0, cpu: 0..8 },
        );
        picked.insert(route(&mut r, 1, 8));
    }
    assert_eq!(
        picked,
        BTreeSet::from([key(0), key(1)]),
        "a tie, broken at random"
    );
}

/// Index operations on a few workers and a short prompt's blocks.
#[derive(Clone, Debug)]
enum Op {
    /// Worker stores blocks 0..n on the GPU.
    Gpu(u64, u64),
    /// Worker drops GPU block i.
    GpuRemove(u64, u64),
    /// Worker offloads blocks of the range (those not on its GPU are refused).
    Cpu(u64, u64, u64),
    /// Worker drops CPU block i.
    CpuRemove(u64, u64),
    Clear(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u64..3, 1u64..7).prop_map(|(w, n)| Op::Gpu(w, n)),
        (0u64..3, 0u64..6).prop_map(|(w, i)| Op::GpuRemove(w, i)),
        (0u64..3, 0u64..6, 0u64..4).prop_map(|(w, a, n)| Op::Cpu(w, a, a + n)),
        (0u64..3, 0u64..6).prop_map(|(w, i)| Op::CpuRemove(w, i)),
        (0u64..3).prop_map(Op::Clear),
    ]
}

proptest! {
    /// The tier's runs against a reference: per worker, the set of GPU blocks and the set of
    /// CPU blocks (a CPU store counts only for blocks then on the GPU).
    #[test]
    fn tier_runs_agree_with_a_reference(ops in prop::collection::vec(op(), 1..40)) {
        tier_runs_against_the_reference::<PrefixIndex>(&ops)?;
        tier_runs_against_the_reference::<RunIndex>(&ops)?;
    }
}

fn tier_runs_against_the_reference<L: IndexLayout>(ops: &[Op]) -> Result<(), TestCaseError> {
    let mut index = L::with_config(IndexConfig::default());
    let mut gpu: BTreeMap<u64, BTreeSet<u64>> = BTreeMap::new();
    let mut cpu: BTreeMap<u64, BTreeSet<u64>> = BTreeMap::new();
    for w in 0..3 {
        index.add_worker(key(w));
    }
    for op in ops {
        match *op {
            Op::Gpu(w, n) => {
                let mut held = gpu.entry(w).or_default().clone();
                // A store continues from the root over blocks it may already hold.
                let _ = index.apply_event(
                    key(w),
                    IndexEvent::Stored {
                        parent: None,
                        blocks: &blocks(w, n),
                    },
                );
                held.extend(0..n);
                gpu.insert(w, held);
            }
            Op::GpuRemove(w, i) => {
                index
                    .apply_event(
                        key(w),
                        IndexEvent::Removed {
                            blocks: &ext(w, i..i + 1),
                        },
                    )
                    .expect("the test's own input");
                gpu.entry(w).or_default().remove(&i);
            }
            Op::Cpu(w, a, b) => {
                let _ = index.apply_event(
                    key(w),
                    IndexEvent::TierStored {
                        tier: Tier::Cpu,
                        blocks: &ext(w, a..b),
                    },
                );
                let on_gpu = gpu.entry(w).or_default().clone();
                cpu.entry(w)
                    .or_default()
                    .extend((a..b).filter(|i| on_gpu.contains(i)));
            }
            Op::CpuRemove(w, i) => {
                index
                    .apply_event(
                        key(w),
                        IndexEvent::TierRemoved {
                            tier: Tier::Cpu,
                            blocks: &ext(w, i..i + 1),
                        },
                    )
                    .expect("the test's own input");
                cpu.entry(w).or_default().remove(&i);
            }
            Op::Clear(w) => {
                index
                    .apply_event(key(w), IndexEvent::Cleared)
                    .expect("the test's own input");
                gpu.remove(&w);
                cpu.remove(&w);
            }
        }
        index.check_invariants().map_err(TestCaseError::fail)?;
        let scores = find(&index, &locals(6));
        let mut runs = Vec::new();
        index.tier_runs_into(Tier::Cpu, &chain(6), |w| scores.depth(w), &mut runs);
        for w in 0..3 {
            let g = gpu.get(&w).cloned().unwrap_or_default();
            let c = cpu.get(&w).cloned().unwrap_or_default();
            let depth = (0..6).take_while(|i| g.contains(i)).count() as u64;
            let run = (depth..6).take_while(|i| c.contains(i)).count() as u32;
            prop_assert_eq!(scores.depth(key(w)), depth as u32);
            let got = runs.iter().find(|(k, _)| *k == key(w)).map_or(0, |&(_, r)| r);
            prop_assert_eq!(got, run, "worker {} after {:?}", w, op);
            prop_assert_eq!(index.tier_block_count(key(w), Tier::Cpu), c.len());
        }
    }
    Ok(())
}
