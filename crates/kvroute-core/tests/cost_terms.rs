//! The cost's fleet-load, stall and decode-transfer terms against what they are for: the fleet's
//! load only ever favours the worker that caches more of the prompt, and is 0 while a worker that
//! computes prompts has nothing booked; stalls only ever favour the worker with fewer booked
//! requests, and cost nothing for a prompt cached whole; a decode worker that caches more of the
//! prompt costs less, all else equal.

use std::sync::Arc;

use kvroute_core::ids::{DpRank, RequestId, SequenceHash, WorkerId, WorkerKey};
use kvroute_core::router::{
    Candidate, CostParams, Projection, Prompt, RequestView, RouteRequest, Router, RouterConfig, WorkerLoad,
    WorkerRole, WorkerSpec, cost,
};
use kvroute_core::time::Timestamp;
use proptest::prelude::*;

const BLOCK: u32 = 16;

fn candidate(role: WorkerRole, overlap_blocks: u32, load: WorkerLoad, decode: u64) -> Candidate {
    Candidate {
        spec: WorkerSpec::new(WorkerKey::new(WorkerId(1), DpRank(0)), role, 1000),
        overlap_blocks,
        tier_blocks: 0,
        load,
        projection: Projection {
            decode_blocks_full: decode,
            decode_blocks_staged: decode,
        },
        eviction_pressure: 0.0,
    }
}

fn load() -> impl Strategy<Value = WorkerLoad> {
    (0u32..50, 0u64..5000, 0u64..2000).prop_map(|(requests, prefill_tokens, decode_blocks)| WorkerLoad {
        requests,
        prefill_requests: requests.min(3),
        prefill_tokens,
        decode_blocks,
        staged_decode_blocks: decode_blocks,
        output_blocks: 0,
    })
}

fn view(chain: &Arc<[SequenceHash]>, fleet_load: f64) -> RequestView<'_> {
    RequestView {
        now: Timestamp(0),
        id: RequestId(0),
        prompt_tokens: chain.len() as u64 * u64::from(BLOCK),
        block_size: BLOCK,
        chain,
        fleet_load,
    }
}

proptest! {
    /// Of two workers, the one caching more of the prompt only gains on the other as the
    /// fleet's load grows; at load 0 the term is absent.
    #[test]
    fn fleet_load_only_favours_the_deeper_cache(
        blocks in 1u32..64,
        (deep, shallow) in (0u32..64, 0u32..64).prop_map(|(a, b)| (a.max(b), a.min(b))),
        (load_a, load_b) in (load(), load()),
        (decode_a, decode_b) in (0u64..2000, 0u64..2000),
        (low, high) in (0.0f64..=1.0, 0.0f64..=1.0).prop_map(|(a, b)| (a.min(b), a.max(b))),
    ) {
        let chain: Arc<[SequenceHash]> = (0..u64::from(blocks)).map(SequenceHash).collect();
        let params = CostParams::KV;
        let a = candidate(WorkerRole::Aggregated, deep.min(blocks), load_a, decode_a);
        let b = candidate(WorkerRole::Aggregated, shallow.min(blocks), load_b, decode_b);
        let gap = |fleet_load| {
            let v = view(&chain, fleet_load);
            cost(&params, &v, &a) - cost(&params, &v, &b)
        };
        prop_assert!(gap(high) <= gap(low) + 1e-6 * gap(low).abs().max(1.0));
        let blind = CostParams { fleet_weight: 0.0, ..params };
        let v = view(&chain, 0.0);
        prop_assert_eq!(cost(&params, &v, &a), cost(&blind, &v, &a));
    }

    /// A decode worker caching more of the prompt costs less, all else equal, by the transfer
    /// of the blocks it holds; at `transfer_block_cost = 0` (Dynamo's) it is cache-blind.
    #[test]
    fn decode_workers_count_the_blocks_they_lack(
        blocks in 1u32..64,
        (deep, shallow) in (0u32..64, 0u32..64).prop_map(|(a, b)| (a.max(b), a.min(b))),
        load in load(),
        decode in 0u64..2000,
    ) {
        let chain: Arc<[SequenceHash]> = (0..u64::from(blocks)).map(SequenceHash).collect();
        let v = view(&chain, 0.0);
        let (deep, shallow) = (deep.min(blocks), shallow.min(blocks));
        let params = CostParams::KV;
        let a = candidate(WorkerRole::Decode, deep, load, decode);
        let b = candidate(WorkerRole::Decode, shallow, load, decode);
        let saved = params.prefill_load_scale * params.transfer_block_cost * f64::from(deep - shallow);
        prop_assert!((cost(&params, &v, &b) - cost(&params, &v, &a) - saved).abs() < 1e-6);
        let blind = CostParams { transfer_block_cost: 0.0, ..params };
        prop_assert_eq!(cost(&blind, &v, &a), cost(&blind, &v, &b));
    }

    /// Of two workers caching the same share of the prompt, the one with more booked requests
    /// only loses ground to the other as the stall weight grows; a prompt the worker caches
    /// whole stalls nobody there, and at weight 0 the term is absent.
    #[test]
    fn stalls_only_favour_the_worker_with_fewer_requests(
        blocks in 1u32..64,
        overlap in 0u32..64,
        (load_a, load_b) in (load(), load()),
        (decode_a, decode_b) in (0u64..2000, 0u64..2000),
        (low, high) in (0.0f64..4.0, 0.0f64..4.0).prop_map(|(a, b)| (a.min(b), a.max(b))),
    ) {
        let chain: Arc<[SequenceHash]> = (0..u64::from(blocks)).map(SequenceHash).collect();
        let v = view(&chain, 0.0);
        let (busy, calm) = if load_a.requests >= load_b.requests { (load_a, load_b) } else { (load_b, load_a) };
        let overlap = overlap.min(blocks);
        let a = candidate(WorkerRole::Aggregated, overlap, busy, decode_a);
        let b = candidate(WorkerRole::Aggregated, overlap, calm, decode_b);
        let gap = |stall_weight| {
            let params = CostParams { stall_weight, ..CostParams::KV };
            cost(&params, &v, &a) - cost(&params, &v, &b)
        };
        prop_assert!(gap(high) >= gap(low) - 1e-6 * gap(low).abs().max(1.0));
        let blind = CostParams { stall_weight: 0.0, ..CostParams::KV };
        let cached = candidate(WorkerRole::Aggregated, blocks, busy, decode_a);
        prop_assert_eq!(cost(&CostParams::KV, &v, &cached), cost(&blind, &v, &cached));
        let idle = candidate(WorkerRole::Aggregated, overlap, WorkerLoad::default(), decode_a);
        prop_assert_eq!(cost(&CostParams::KV, &v, &idle), cost(&blind, &v, &idle));
    }

    /// The fleet's load is a fraction, 0 while some worker in routing has nothing booked (a
    /// draining one, idle or not, does not count).
    #[test]
    fn fleet_load_is_zero_while_a_worker_is_idle(
        workers in 1u64..5,
        drain_first in any::<bool>(),
        prompts in prop::collection::vec(1usize..40, 0..30),
    ) {
        let mut router = Router::new(RouterConfig { block_size: BLOCK, ..RouterConfig::default() }).unwrap();
        for w in 0..workers {
            let spec = WorkerSpec::new(WorkerKey::new(WorkerId(w), DpRank(0)), WorkerRole::Aggregated, 64);
            router.handle_worker_added(Timestamp(0), spec).unwrap();
        }
        // The first worker added, first of its idle set, drained before any request.
        let drained = (drain_first && workers > 1).then_some(0);
        if let Some(w) = drained {
            router.handle_worker_draining(Timestamp(0), WorkerKey::new(WorkerId(w), DpRank(0))).unwrap();
        }
        for (i, len) in prompts.into_iter().enumerate() {
            let tokens: Vec<u32> = (0..len as u32 * BLOCK).map(|t| t + 7 * i as u32).collect();
            let request = RouteRequest::new(RequestId(i as u64), Prompt::Tokens(&tokens));
            router.handle_request(Timestamp(i as u64), &request).unwrap();
            let load = router.fleet_load();
            prop_assert!((0.0..=1.0).contains(&load), "{load}");
            let idle = (0..workers).filter(|&w| Some(w) != drained).any(|w| {
                router.worker_load(WorkerKey::new(WorkerId(w), DpRank(0))).is_some_and(|l| l.requests == 0)
            });
            if idle {
                prop_assert_eq!(load, 0.0);
            } else {
                prop_assert!(load > 0.0, "every worker loaded, fleet load {load}");
            }
        }
    }
}
