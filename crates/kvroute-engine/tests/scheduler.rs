//! Scheduling, prefix caching, eviction and KV events, one behaviour per test. Every step goes
//! through the harness, which checks the engine's invariants and the router's agreement.

mod common;

use std::time::Duration;

use common::{Harness, config, request, with};
use kvroute_core::events::KvEvent;
use kvroute_core::hash::{BlockHasher, HashSalt};
use kvroute_core::ids::{ExternalBlockHash, RequestId};
use kvroute_core::time::{Timestamp, duration_from_secs_f64};
use kvroute_engine::{
    EnginePrompt, EngineRequest, FinishReason, RequestError, StepOutput, external_hash,
    synthetic_output_token,
};

fn ids(ids: &[u64]) -> Vec<RequestId> {
    ids.iter().map(|&i| RequestId(i)).collect()
}

/// Every `BlocksStored` of `outs`, in order.
fn stored(outs: &[StepOutput]) -> Vec<kvroute_core::events::BlocksStored> {
    outs.iter()
        .flat_map(|o| &o.events)
        .filter_map(|e| match e {
            KvEvent::Stored(s) => Some(s.clone()),
            _ => None,
        })
        .collect()
}

/// Every removed hash of `outs`, in order.
fn removed(outs: &[StepOutput]) -> Vec<ExternalBlockHash> {
    outs.iter()
        .flat_map(|o| &o.events)
        .filter_map(|e| match e {
            KvEvent::Removed(r) => Some(r.block_hashes.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

/// The engine's external hashes of the full blocks of `tokens` (unsalted, seed 42).
fn externals(tokens: &[u32]) -> Vec<ExternalBlockHash> {
    let locals = BlockHasher::new(4, &HashSalt::NONE).local_hashes(tokens);
    let mut out: Vec<ExternalBlockHash> = Vec::new();
    for local in locals {
        out.push(external_hash(42, out.last().copied(), local));
    }
    out
}

#[test]
fn the_newest_running_request_is_preempted_requeued_at_the_front_and_recomputed() {
    // 6 blocks of 4 tokens. A and B take 2 blocks each for their prompts, then grow a block
    // every 4 tokens; the third growth cannot be served, and B, the newest, is preempted.
    let mut h = Harness::new(with(|c| c.num_blocks = 6));
    h.add(request(1, 0..8, 10)).unwrap();
    h.add(request(2, 100..108, 10)).unwrap();
    h.add(request(3, 200..204, 1)).unwrap();
    let outs = h.run();
    let preempting = outs
        .iter()
        .position(|o| !o.preempted.is_empty())
        .expect("a preemption");
    let step = &outs[preempting];
    // B and C arrived after A; C (1 block) was admitted third, so it would go first, but it
    // finished in its first step. B is the newest running request.
    assert_eq!(step.preempted, ids(&[2]));
    assert_eq!(step.metrics.preemptions, 1);
    assert_eq!(step.metrics.admitted, 0, "no admission in a step that preempted");
    assert_eq!((step.metrics.running, step.metrics.waiting), (1, 1));
    assert_eq!(
        step.emitted.iter().map(|e| e.request).collect::<Vec<_>>(),
        ids(&[1])
    );
    // B comes back with its prompt recomputed (or hit), and both finish with all their tokens,
    // each first token reported once.
    for id in [1, 2] {
        let tokens: u32 = outs
            .iter()
            .flat_map(|o| &o.emitted)
            .filter(|e| e.request.0 == id)
            .map(|e| e.tokens)
            .sum();
        assert_eq!(tokens, 10, "request {id}");
        let firsts = outs
            .iter()
            .flat_map(|o| &o.first_token)
            .filter(|r| r.0 == id)
            .count();
        assert_eq!(firsts, 1, "request {id}");
    }
    let readmitted = outs[preempting + 1..]
        .iter()
        .position(|o| o.metrics.admitted > 0)
        .expect("B readmitted");
    let back = &outs[preempting + 1 + readmitted];
    assert!(back.metrics.pass.prefill_seqs == 1 && back.metrics.pass.prefill_tokens > 0);
    // A finished before B came back.
    assert!(
        outs[..=preempting + 1 + readmitted]
            .iter()
            .any(|o| o.finished.iter().any(|f| f.request.0 == 1))
    );
}

#[test]
fn preemption_takes_the_newest_first_and_requeues_in_order() {
    // Three requests that fit only one at a time once they decode long enough.
    let mut h = Harness::new(with(|c| c.num_blocks = 8));
    for id in 1..=3 {
        h.add(request(id, (0..8).map(|t| t + 100 * id as u32), 20))
            .unwrap();
    }
    let outs = h.run();
    let order: Vec<RequestId> = outs.iter().flat_map(|o| o.preempted.clone()).collect();
    assert_eq!(
        order.first(),
        Some(&RequestId(3)),
        "the newest goes first: {order:?}"
    );
    assert!(
        !order.contains(&RequestId(1)),
        "the oldest is never preempted: {order:?}"
    );
    let finished: Vec<u64> = outs
        .iter()
        .flat_map(|o| &o.finished)
        .map(|f| f.request.0)
        .collect();
    assert_eq!(finished, vec![1, 2, 3]);
}

#[test]
fn chunked_prefill_splits_prompts_at_the_budget_and_stores_blocks_as_they_fill() {
    // Budget 6 tokens, blocks of 4: a 14-token prompt runs as chunks of 6, 6 and 2. Blocks are
    // stored when full: block 0 after the first chunk, blocks 1 and 2 after the second.
    let mut h = Harness::new(with(|c| c.max_num_batched_tokens = 6));
    let prompt: Vec<u32> = (0..14).collect();
    h.add(request(1, prompt.clone(), 2)).unwrap();
    let outs = h.run();
    let chunks: Vec<(u64, u64)> = outs
        .iter()
        .map(|o| {
            (
                o.metrics.pass.prefill_tokens,
                o.metrics.pass.prefill_context_tokens,
            )
        })
        .collect();
    assert_eq!(chunks, vec![(6, 0), (6, 6), (2, 12), (0, 0)]);
    assert_eq!(outs[2].first_token, ids(&[1]));
    assert!(outs[..2].iter().all(|o| o.emitted.is_empty()));
    assert_eq!(outs[3].metrics.pass.decode_seqs, 1);
    let ext = externals(&prompt);
    let by_step: Vec<Vec<(Option<ExternalBlockHash>, Vec<ExternalBlockHash>)>> = outs[..3]
        .iter()
        .map(|o| {
            stored(std::slice::from_ref(o))
                .into_iter()
                .map(|s| (s.parent_block_hash, s.block_hashes()))
                .collect()
        })
        .collect();
    assert_eq!(
        by_step,
        vec![
            vec![(None, vec![ext[0]])],
            vec![(Some(ext[0]), vec![ext[1], ext[2]])],
            vec![]
        ]
    );
    // Attention pairs of the second chunk: 6 new tokens after 6 of context, 6·6 + 6·7/2.
    assert_eq!(outs[1].metrics.pass.prefill_attention_pairs, 36 + 21);
}

#[test]
fn running_requests_are_served_before_waiting_ones_within_the_budget() {
    let mut h = Harness::new(with(|c| c.max_num_batched_tokens = 8));
    h.add(request(1, 0..4, 5)).unwrap();
    let first = h.step().unwrap();
    assert_eq!(first.first_token, ids(&[1]));
    h.add(request(2, 100..120, 1)).unwrap();
    let second = h.step().unwrap();
    // A decodes one token; B gets the other 7.
    assert_eq!(second.metrics.pass.decode_seqs, 1);
    assert_eq!(second.metrics.pass.decode_context_tokens, 5);
    assert_eq!(
        (
            second.metrics.pass.prefill_seqs,
            second.metrics.pass.prefill_tokens
        ),
        (1, 7)
    );
}

#[test]
fn without_chunked_prefill_a_prompt_runs_whole_and_the_queue_waits_for_the_budget() {
    let config = with(|c| {
        c.enable_chunked_prefill = false;
        c.max_num_batched_tokens = 16;
        c.max_model_len = 16;
    });
    let mut h = Harness::new(config);
    h.add(request(1, 0..12, 2)).unwrap();
    h.add(request(2, 100..110, 2)).unwrap();
    let first = h.step().unwrap();
    // A takes 12 of 16 tokens; B's 10 do not fit in the 4 left, so B waits (no chunking).
    assert_eq!(first.metrics.pass.prefill_tokens, 12);
    assert_eq!(first.metrics.waiting, 1);
    let second = h.step().unwrap();
    assert_eq!(second.metrics.pass.decode_seqs, 1);
    assert_eq!(second.metrics.pass.prefill_tokens, 10);
}

#[test]
fn a_fully_cached_prompt_still_computes_its_last_token() {
    let mut h = Harness::new(config());
    let prompt: Vec<u32> = (0..8).collect();
    h.add(request(1, prompt.clone(), 1)).unwrap();
    h.run();
    // Both blocks are cached; the same prompt takes at most 7 tokens from the cache, so only
    // block 0 is hit and block 1 (4 tokens) is recomputed, without a new stored event.
    h.add(request(2, prompt.clone(), 1)).unwrap();
    let out = h.step().unwrap();
    assert_eq!(out.metrics.prefix_cache_hit_tokens, 4);
    assert_eq!(out.metrics.prefix_cache_query_tokens, 8);
    assert_eq!(
        (
            out.metrics.pass.prefill_tokens,
            out.metrics.pass.prefill_context_tokens
        ),
        (4, 4)
    );
    assert!(out.events.is_empty(), "{:?}", out.events);
    assert_eq!(out.finished.len(), 1);
    // One token more and both blocks are hit: a single token is computed.
    h.add(request(3, (0..9).collect::<Vec<_>>(), 1)).unwrap();
    let out = h.step().unwrap();
    assert_eq!(out.metrics.prefix_cache_hit_tokens, 8);
    assert_eq!(out.metrics.pass.prefill_tokens, 1);
}

#[test]
fn a_request_with_no_output_is_prefilled_cached_and_finished_without_a_token() {
    let mut h = Harness::new(with(|c| c.max_num_batched_tokens = 4));
    h.add(request(1, 0..8, 0)).unwrap();
    let outs = h.run();
    assert_eq!(outs.len(), 2);
    assert!(
        outs.iter()
            .all(|o| o.emitted.is_empty() && o.first_token.is_empty())
    );
    assert_eq!(outs[1].finished.len(), 1);
    assert_eq!(outs[1].finished[0].output_tokens, 0);
    assert_eq!(h.engine.cached_blocks().count(), 2);
}

#[test]
fn prompts_reaching_max_model_len_are_rejected_and_outputs_are_cut_at_it() {
    let mut h = Harness::new(with(|c| c.max_model_len = 16));
    assert_eq!(
        h.add(request(1, 0..16, 1)),
        Err(RequestError::PromptTooLong {
            id: RequestId(1),
            prompt_len: 16,
            max_model_len: 16
        })
    );
    h.add(request(2, 0..12, 10)).unwrap();
    let outs = h.run();
    let finished = outs.iter().flat_map(|o| &o.finished).next().unwrap();
    assert_eq!(
        (finished.output_tokens, finished.reason),
        (4, FinishReason::Length)
    );
    assert!(h.engine.next_wakeup().is_none());
}

#[test]
fn requests_that_cannot_fit_the_whole_cache_and_malformed_ones_are_rejected() {
    let mut h = Harness::new(with(|c| c.num_blocks = 4));
    // 10 + 8 − 1 = 17 tokens of KV at the longest: 5 blocks of 4.
    assert_eq!(
        h.add(request(1, 0..10, 8)),
        Err(RequestError::ExceedsCache {
            id: RequestId(1),
            blocks_needed: 5,
            total_blocks: 4
        })
    );
    // 16 tokens fit exactly.
    h.add(request(2, 0..10, 7)).unwrap();
    assert_eq!(
        h.add(request(2, 0..3, 1)),
        Err(RequestError::DuplicateId(RequestId(2)))
    );
    assert_eq!(
        h.add(request(3, [], 1)),
        Err(RequestError::EmptyPrompt(RequestId(3)))
    );
    let blocks = EngineRequest {
        prompt: EnginePrompt::Blocks {
            hashes: Vec::new(),
            len: 4,
        },
        ..request(4, [], 1)
    };
    assert!(matches!(
        h.add(blocks),
        Err(RequestError::BlockCountMismatch {
            blocks: 0,
            len: 4,
            ..
        })
    ));
    let outs = h.run();
    assert_eq!(outs.iter().flat_map(|o| &o.emitted).count(), 7);
}

#[test]
fn eviction_takes_the_least_recently_freed_block_and_a_requests_tail_before_its_prefix() {
    // Four blocks. A's three full prompt blocks are cached, then freed tail first behind the
    // never-used block 3.
    let mut h = Harness::new(with(|c| c.num_blocks = 4));
    let a: Vec<u32> = (0..12).collect();
    h.add(request(1, a.clone(), 1)).unwrap();
    h.run();
    let ext = externals(&a);
    // B needs two blocks: the unused one, then A's last block, which is evicted.
    h.add(request(2, 100..108, 1)).unwrap();
    let out = h.step().unwrap();
    assert_eq!(removed(std::slice::from_ref(&out)), vec![ext[2]]);
    // A's prefix is still there: a request for A's prompt hits its first two blocks.
    h.add(request(3, a.clone(), 1)).unwrap();
    let out = h.step().unwrap();
    assert_eq!(out.metrics.prefix_cache_hit_tokens, 8);
    // The block it recomputes evicts the least recently freed one: B's tail.
    assert_eq!(
        removed(std::slice::from_ref(&out)),
        vec![externals(&(100..108).collect::<Vec<_>>())[1]]
    );
}

#[test]
fn stored_events_carry_vllm_fields_and_hashes_the_router_cannot_mistake_for_its_own() {
    let mut h = Harness::new(config());
    let prompt: Vec<u32> = (10..19).collect(); // two full blocks and one token
    let req = EngineRequest {
        lora_name: Some("adapter".into()),
        ..request(1, prompt.clone(), 1)
    };
    h.add(req).unwrap();
    let outs = h.run();
    let events = stored(&outs);
    assert_eq!(events.len(), 1);
    let s = &events[0];
    let salt = HashSalt {
        lora_name: Some("adapter"),
        namespace: None,
    };
    let hasher = BlockHasher::new(4, &salt);
    let locals = hasher.local_hashes(&prompt);
    assert_eq!(s.parent_block_hash, None);
    assert_eq!(s.local_hashes(), locals);
    assert_eq!(s.token_ids, prompt[..8]);
    assert_eq!(s.block_size, 4);
    assert_eq!(s.lora_name.as_deref(), Some("adapter"));
    let chain = [external_hash(42, None, locals[0])];
    assert_eq!(
        s.block_hashes(),
        vec![chain[0], external_hash(42, Some(chain[0]), locals[1])]
    );
    // Not the router's sequence hashes, not under another seed either.
    let seqs = hasher.sequence_hashes(&locals);
    assert!(s.block_hashes().iter().zip(&seqs).all(|(e, q)| e.0 != q.0));
    assert_ne!(external_hash(43, None, locals[0]), chain[0]);
}

#[test]
fn generated_tokens_fill_blocks_that_are_cached_like_prompt_blocks() {
    let mut h = Harness::new(config());
    let prompt: Vec<u32> = (0..4).collect();
    h.add(request(7, prompt.clone(), 6)).unwrap();
    let outs = h.run();
    let events = stored(&outs);
    // Block 1 holds output tokens 0..4; its KV is complete once output token 3 is fed back.
    assert_eq!(events.len(), 2);
    let outputs: Vec<u32> = (0..4).map(|i| synthetic_output_token(RequestId(7), i)).collect();
    let tokens: Vec<u32> = prompt.iter().copied().chain(outputs.iter().copied()).collect();
    let ext = externals(&tokens);
    assert_eq!(events[1].parent_block_hash, Some(ext[0]));
    assert_eq!(events[1].block_hashes(), vec![ext[1]]);
    assert_eq!(events[1].token_ids, outputs);
    // A follow-up turn built from the output hits both blocks.
    h.add(request(8, tokens.iter().copied().chain([99]), 1)).unwrap();
    assert_eq!(h.step().unwrap().metrics.prefix_cache_hit_tokens, 8);
}

#[test]
fn prompts_given_as_block_hashes_share_the_cache_with_token_prompts() {
    let mut h = Harness::new(config());
    let tokens: Vec<u32> = (0..10).collect();
    let hashes = BlockHasher::new(4, &HashSalt::NONE).local_hashes(&tokens);
    let by_hash = EngineRequest {
        prompt: EnginePrompt::Blocks {
            hashes: hashes.clone(),
            len: 10,
        },
        ..request(1, [], 1)
    };
    h.add(by_hash).unwrap();
    let outs = h.run();
    let events = stored(&outs);
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].local_hashes(), hashes);
    assert!(
        events[0].token_ids.is_empty(),
        "no token ids for a block-hash prompt"
    );
    assert_eq!(events[0].block_hashes(), externals(&tokens));
    h.add(request(2, tokens, 1)).unwrap();
    assert_eq!(h.step().unwrap().metrics.prefix_cache_hit_tokens, 8);
}

#[test]
fn a_recomputed_block_that_is_already_cached_is_shared_not_copied() {
    // A and B share a 16-token prompt and are admitted in the same pass. A computes and caches
    // four blocks; B hits three and recomputes the last, then holds A's cached copy instead of
    // its own, so the pass ends with four blocks in use and each block stored once.
    let mut h = Harness::new(config());
    let prompt: Vec<u32> = (0..16).collect();
    h.add(request(1, prompt.clone(), 2)).unwrap();
    h.add(request(2, prompt.clone(), 2)).unwrap();
    let out = h.step().unwrap();
    assert_eq!(
        (
            out.metrics.pass.prefill_tokens,
            out.metrics.prefix_cache_hit_tokens
        ),
        (20, 12)
    );
    assert_eq!(out.metrics.active_blocks, 4);
    h.run();
    let hashes: Vec<ExternalBlockHash> = stored(&h.log)
        .into_iter()
        .flat_map(|s| s.block_hashes())
        .collect();
    assert_eq!(hashes, externals(&prompt));
}

#[test]
fn reset_clears_the_cache_when_no_request_runs() {
    let mut h = Harness::new(config());
    h.add(request(1, 0..8, 3)).unwrap();
    h.step().unwrap();
    assert!(h.engine.reset_prefix_cache().is_err());
    h.run();
    let event = h.engine.reset_prefix_cache().unwrap().expect("caching is on");
    assert_eq!(event, KvEvent::AllCleared);
    h.index.apply_event(h.worker, event.as_index_event()).unwrap();
    assert_eq!(h.engine.cached_blocks().count(), 0);
    assert_eq!(h.index.block_count(h.worker), 0);
    h.engine.check_invariants().unwrap();
}

#[test]
fn without_prefix_caching_nothing_is_hit_or_announced() {
    let mut h = Harness::new(with(|c| c.enable_prefix_caching = false));
    h.add(request(1, 0..8, 3)).unwrap();
    h.run();
    h.add(request(2, 0..8, 3)).unwrap();
    let outs = h.run();
    assert_eq!(outs[0].metrics.prefix_cache_hit_tokens, 0);
    assert!(h.log.iter().all(|o| o.events.is_empty()));
    assert_eq!(h.engine.reset_prefix_cache(), Ok(None));
}

#[test]
fn next_wakeup_follows_the_pass_in_flight() {
    let mut h = Harness::new(config());
    assert_eq!(h.engine.next_wakeup(), None);
    assert!(h.engine.step(Timestamp::ZERO).is_none());
    let t0 = Timestamp::from_millis(5);
    h.engine.add_request(t0, request(1, 0..8, 2)).unwrap();
    assert_eq!(h.engine.next_wakeup(), Some(t0));
    let out = h.engine.step(t0).unwrap();
    assert_eq!(out.start, t0);
    // Polynomial prefill of 8 tokens: 4.209989e-7·64 + 1.518344e-2·8 + 16.50142 ms.
    let expected = 4.209989e-7 * 64.0 + 1.518344e-2 * 8.0 + 16.50142;
    assert_eq!(out.metrics.duration, duration_from_secs_f64(expected / 1e3));
    assert_eq!(out.end, t0 + out.metrics.duration);
    assert_eq!(h.engine.next_wakeup(), Some(out.end));
    // Called early, the engine is busy and does nothing.
    assert!(h.engine.step(out.end - Duration::from_nanos(1)).is_none());
    let next = h.engine.step(out.end).unwrap();
    assert_eq!(next.finished.len(), 1);
    assert_eq!(h.engine.next_wakeup(), None);
}

#[test]
fn the_speedup_factor_divides_step_times() {
    let run = |speedup: f64| {
        let mut h = Harness::new(kvroute_engine::EngineConfig { speedup, ..config() });
        h.add(request(1, 0..8, 2)).unwrap();
        h.run()
            .iter()
            .map(|o| o.metrics.duration.as_nanos())
            .collect::<Vec<_>>()
    };
    let (slow, fast) = (run(1.0), run(4.0));
    assert!(
        slow.iter().zip(&fast).all(|(s, f)| s.abs_diff(4 * f) <= 4),
        "{slow:?} {fast:?}"
    );
}

/// vLLM 0.32's `kv_cache_report_mode = "full"`: when a request's prefix is looked up and hits,
/// the hit is announced again, one `Stored` of every hit block from the root with its tokens,
/// before what the request then caches; an index that lost its view learns the hit back, and
/// one that holds it is unchanged (the harness applies every event and checks agreement).
#[test]
fn a_full_report_request_reannounces_its_hit_from_the_root_before_its_new_blocks() {
    let mut h = Harness::new(config());
    // 3 full blocks of 4 tokens and one token more: all 3 blocks are cached.
    let prompt: Vec<u32> = (100..113).collect();
    h.add(request(1, prompt.clone(), 1)).unwrap();
    h.run();
    let hashes = externals(&prompt);
    // Incremental (the default): a hit is not announced again.
    h.add(request(2, prompt.clone(), 1)).unwrap();
    assert!(stored(&h.run()).is_empty());
    // Full, with 5 tokens more (a fourth block to cache): the 3 hit blocks from the root,
    // then the new block under the last of them, in the same step.
    let longer: Vec<u32> = (100..118).collect();
    let full = EngineRequest {
        kv_report: kvroute_engine::KvReportMode::Full,
        ..request(3, longer.clone(), 1)
    };
    h.add(full).unwrap();
    let out = h.step().unwrap();
    assert_eq!(out.prefix_hits, vec![(RequestId(3), 12)]);
    let events = stored(std::slice::from_ref(&out));
    assert_eq!(events.len(), 2, "{events:?}");
    assert_eq!(events[0].parent_block_hash, None);
    assert_eq!(
        events[0].blocks.iter().map(|b| b.external).collect::<Vec<_>>(),
        hashes[..3]
    );
    assert_eq!(events[0].token_ids, prompt[..12]);
    assert_eq!(events[0].block_size, 4);
    let longer_hashes = externals(&longer);
    assert_eq!(events[1].parent_block_hash, Some(hashes[2]));
    assert_eq!(
        events[1].blocks.iter().map(|b| b.external).collect::<Vec<_>>(),
        longer_hashes[3..4]
    );
    h.run();
    // Full without a hit announces nothing more than what it caches.
    let fresh = EngineRequest {
        kv_report: kvroute_engine::KvReportMode::Full,
        ..request(4, 500..509, 1)
    };
    h.add(fresh).unwrap();
    let events = stored(&h.run());
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].blocks.len(), 2);

    // A view that lost everything learns the hit back from one full-report request.
    h.index.clear_worker(h.worker).unwrap();
    let again = EngineRequest {
        kv_report: kvroute_engine::KvReportMode::Full,
        ..request(5, prompt.clone(), 1)
    };
    h.engine.add_request(h.now, again).unwrap();
    let at = h.engine.next_wakeup().unwrap();
    let out = h.engine.step(at).unwrap();
    h.now = out.end;
    for event in &out.events {
        h.index.apply_event(h.worker, event.as_index_event()).unwrap();
    }
    let learned: std::collections::BTreeSet<_> = hashes[..3].iter().copied().collect();
    assert_eq!(common::held(&h.index, h.worker), learned);
}
