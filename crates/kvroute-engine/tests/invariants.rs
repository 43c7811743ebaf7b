//! Random workloads: arrivals with shared prefixes, steps and cache resets, on random small
//! engines. After every step the harness checks the engine's invariants (reference counts,
//! in use + free = total, queues) and that the router's index, fed with the engine's events,
//! holds exactly the engine's cached blocks, on the GPU and on the CPU tier when it has one. At the end every accepted request must have
//! finished once, with its whole output, and the same run must give the same outputs again. A pass
//! the engine's pure-decode horizon promised does nothing but one token per running request.

mod common;

use std::collections::BTreeMap;

use common::{Harness, config, request};
use kvroute_core::ids::RequestId;
use kvroute_engine::{
    CpuOffload, EngineConfig, EngineRequest, FinishReason, KvTransfer, RequestError, StepOutput,
};
use proptest::prelude::*;

/// One thing that happens to the engine.
#[derive(Clone, Debug)]
enum Op {
    /// A request: `prefix` tokens of shared prefix `group`, then `suffix` tokens of its own.
    Add {
        group: u32,
        prefix: u32,
        suffix: u32,
        output: u32,
        lora: bool,
    },
    /// One step at the engine's wakeup.
    Step,
    /// A prefix-cache reset, when nothing runs.
    Reset,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3u32, 0..40u32, 0..12u32, 0..24u32, proptest::bool::weighted(0.2)).prop_map(
            |(group, prefix, suffix, output, lora)| Op::Add { group, prefix, suffix, output, lora }
        ),
        6 => Just(Op::Step),
        1 => Just(Op::Reset),
    ]
}

fn engine_config() -> impl Strategy<Value = EngineConfig> {
    (
        prop::sample::select(vec![1u32, 2, 4, 8]),
        4..48u32,
        1..6u32,
        4..48u32,
        any::<bool>(),
        any::<bool>(),
        prop::option::of(1..64u32),
    )
        .prop_map(
            |(block_size, num_blocks, max_num_seqs, budget, chunked, caching, cpu)| EngineConfig {
                block_size,
                num_blocks,
                max_num_seqs,
                max_num_batched_tokens: budget,
                // Without chunked prefill a whole sequence must fit in one pass.
                max_model_len: if chunked { 64 } else { budget },
                enable_chunked_prefill: chunked,
                enable_prefix_caching: caching,
                cpu_offload: cpu.map(|n| CpuOffload::new(n, KvTransfer::default())),
                ..config()
            },
        )
}

/// Request `id` of an [`Op::Add`].
fn make_request(id: u64, group: u32, prefix: u32, suffix: u32, output: u32, lora: bool) -> EngineRequest {
    let shared = (0..prefix).map(move |t| group * 10_000 + t);
    let own = (0..suffix).map(move |t| 1_000_000 + id as u32 * 100 + t);
    EngineRequest {
        lora_name: lora.then(|| "lora".to_owned()),
        ..request(id, shared.chain(own), output)
    }
}

/// What a run produced: every step, and the outputs each accepted request should produce.
struct Run {
    log: Vec<StepOutput>,
    expected: BTreeMap<RequestId, u32>,
    /// Passes the pure-decode horizon promised, checked by the harness.
    pure_passes: u64,
}

/// Applies `ops`, then steps until idle; the harness checks every step.
fn run(config: &EngineConfig, ops: &[Op]) -> Run {
    let mut h = Harness::new(config.clone());
    let mut expected = BTreeMap::new();
    for (i, op) in ops.iter().enumerate() {
        match *op {
            Op::Add {
                group,
                prefix,
                suffix,
                output,
                lora,
            } => {
                let id = i as u64;
                let req = make_request(id, group, prefix, suffix, output, lora);
                let prompt_len = req.prompt.len();
                match h.add(req) {
                    Ok(()) => {
                        expected.insert(RequestId(id), output.min(config.max_model_len - prompt_len));
                    }
                    Err(RequestError::EmptyPrompt(_)) => assert_eq!(prompt_len, 0),
                    Err(RequestError::PromptTooLong { .. }) => assert!(prompt_len >= config.max_model_len),
                    Err(RequestError::ExceedsCache { blocks_needed, .. }) => {
                        assert!(blocks_needed > u64::from(config.num_blocks));
                    }
                    Err(e) => panic!("unexpected rejection {e}"),
                }
            }
            Op::Step => {
                h.step();
            }
            Op::Reset => match h.engine.reset_prefix_cache() {
                Ok(event) => {
                    assert_eq!(event.is_some(), config.enable_prefix_caching);
                    if let Some(event) = event {
                        h.index
                            .apply_event(h.worker, event.as_index_event())
                            .expect("a clear applies");
                    }
                    assert_eq!(
                        (h.engine.cached_blocks().count(), h.index.block_count(h.worker)),
                        (0, 0)
                    );
                    assert!(h.engine.cpu_blocks().is_empty() && !h.index.has_tier_blocks());
                }
                Err(_) => assert!(h.engine.num_running() > 0),
            },
        }
    }
    h.run();
    Run {
        log: h.log,
        expected,
        pure_passes: h.pure_passes,
    }
}

/// Every accepted request finished exactly once, having produced exactly its output, with one
/// first token if it produced any; time only moved forward.
fn check_conservation(run: &Run) {
    let mut tokens: BTreeMap<RequestId, u32> = BTreeMap::new();
    let mut firsts: BTreeMap<RequestId, u32> = BTreeMap::new();
    let mut finished: BTreeMap<RequestId, u32> = BTreeMap::new();
    for (i, out) in run.log.iter().enumerate() {
        if i > 0 {
            assert!(
                out.start >= run.log[i - 1].end,
                "step {i} starts before the last ended"
            );
        }
        for e in &out.emitted {
            *tokens.entry(e.request).or_default() += e.tokens;
        }
        for &r in &out.first_token {
            *firsts.entry(r).or_default() += 1;
        }
        for f in &out.finished {
            assert_eq!(f.output_tokens, tokens.get(&f.request).copied().unwrap_or(0));
            assert!(
                finished.insert(f.request, f.output_tokens).is_none(),
                "{:?} finished twice",
                f.request
            );
            if f.reason == FinishReason::Length {
                assert!(f.output_tokens > 0);
            }
        }
    }
    assert_eq!(finished, run.expected);
    for (id, &out) in &run.expected {
        assert_eq!(firsts.get(id).copied().unwrap_or(0), u32::from(out > 0), "{id:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn invariants_and_router_agreement_hold_after_every_step(
        config in engine_config(),
        ops in prop::collection::vec(op(), 1..60),
    ) {
        let first = run(&config, &ops);
        check_conservation(&first);
        // Determinism: the same inputs give the same outputs and events, step for step.
        let second = run(&config, &ops);
        prop_assert_eq!(first.log, second.log);
    }
}

#[test]
fn a_long_contended_run_keeps_every_invariant() {
    contended_run(None);
}

#[test]
fn a_long_contended_run_with_a_cpu_tier_keeps_every_invariant_and_loads_from_it() {
    let run = contended_run(Some(CpuOffload::new(120, KvTransfer::default())));
    let tier = |stored: bool| {
        run.log
            .iter()
            .flat_map(|o| &o.events)
            .filter(|e| match e {
                kvroute_core::events::KvEvent::TierStored(_) => stored,
                kvroute_core::events::KvEvent::TierRemoved(_) => !stored,
                _ => false,
            })
            .count()
    };
    assert!(tier(true) > 0 && tier(false) > 0, "offloads and CPU evictions");
    // Some admissions found more than the GPU's hits: blocks loaded from the CPU tier.
    let hits: u64 = run.log.iter().map(|o| o.metrics.prefix_cache_hit_tokens).sum();
    let reported: u64 = run
        .log
        .iter()
        .flat_map(|o| &o.prefix_hits)
        .map(|&(_, t)| u64::from(t))
        .sum();
    assert!(reported > hits, "cached tokens {reported}, GPU hits {hits}");
}

fn contended_run(cpu_offload: Option<CpuOffload>) -> Run {
    // Many requests sharing a few prefixes on a cache that holds a few of them: constant
    // eviction, preemption and prefix reuse.
    let config = EngineConfig {
        num_blocks: 40,
        max_num_seqs: 6,
        max_num_batched_tokens: 24,
        cpu_offload,
        ..config()
    };
    let ops: Vec<Op> = (0..400u32)
        .map(|i| match i % 3 {
            0 => Op::Add {
                group: i % 5,
                prefix: 8 + i % 29,
                suffix: i % 7,
                output: 1 + i % 17,
                lora: i % 11 == 0,
            },
            _ => Op::Step,
        })
        .collect();
    let run = run(&config, &ops);
    check_conservation(&run);
    let preemptions: u32 = run.log.iter().map(|o| o.metrics.preemptions).sum();
    let hits: u64 = run.log.iter().map(|o| o.metrics.prefix_cache_hit_tokens).sum();
    let removed = run
        .log
        .iter()
        .flat_map(|o| &o.events)
        .filter(|e| matches!(e, kvroute_core::events::KvEvent::Removed(_)))
        .count();
    assert!(
        preemptions > 0 && hits > 0 && removed > 0 && run.pure_passes > 0,
        "{preemptions} {hits} {removed} {}",
        run.pure_passes
    );
    run
}
