//! Wire events into a [`RunIndex`]: the router hashes the tokens itself and finds the blocks
//! with a prompt hashed the same way; other tiers, groups and block sizes are skipped and said
//! so; a simulated engine's events reach the index alike directly and through the wire.

mod common;

use std::collections::BTreeSet;
use std::fmt::Write;
use std::num::NonZeroU32;

use expect_test::expect;
use kvroute_core::events::{KvEvent, TierBlocks};
use kvroute_core::hash::{BlockHasher, HashSalt};
use kvroute_core::ids::{DpRank, ExternalBlockHash, LocalBlockHash, RequestId, WorkerId, WorkerKey};
use kvroute_core::index::{IndexConfig, RunIndex, Tier};
use kvroute_core::time::Timestamp;
use kvroute_engine::{
    CpuOffload, Engine, EngineConfig, EnginePrompt, EngineRequest, KvTransfer, TimingConfig,
};
use kvroute_wire::{Applied, ApplyConfig, BlockStored, EventBatch, EventEncoding, SkipReason, WireEvent};

const W: WorkerKey = WorkerKey::new(WorkerId(1), DpRank(0));

fn config(block_size: u32) -> ApplyConfig<'static> {
    ApplyConfig {
        block_size: NonZeroU32::new(block_size).expect("a block size above zero"),
        namespace: None,
        group_idx: 0,
    }
}

fn index() -> RunIndex {
    let mut index = RunIndex::new(IndexConfig::default());
    index.add_worker(W);
    index
}

fn locals(tokens: &[u32], lora_name: Option<&str>, namespace: Option<&str>) -> Vec<LocalBlockHash> {
    BlockHasher::new(4, &HashSalt { lora_name, namespace }).local_hashes(tokens)
}

/// Applies each event of `batch`, printing its report and `query`'s depth after it.
fn script(batch: &EventBatch, config: &ApplyConfig<'_>, query: &[LocalBlockHash]) -> (RunIndex, String) {
    let mut index = index();
    let mut out = String::new();
    for event in &batch.events {
        let report = event.apply_to(&mut index, W, config);
        index
            .check_invariants()
            .unwrap_or_else(|e| panic!("after {event:?}: {e}"));
        let depth = index.find_matches(query, false).depth(W);
        let held = index.block_count(W);
        out += &format!("{report:?} => depth {depth}, {held} held\n");
    }
    (index, out)
}

#[test]
fn a_decoded_store_matches_the_prompt_hashed_by_the_router() {
    let batch = common::decoded("map_2026");
    let prompt: Vec<u32> = (0..18).chain([70_000, 4_000_000_000]).collect();
    let mut query = locals(&prompt, None, None);
    // The second store continues the chain under a LoRA adapter: its block hashes with that salt.
    query.extend(locals(
        &[9, 8, 7, 6],
        Some("adapter-with-a-rather-long-name-0123456789"),
        None,
    ));
    let (_, out) = script(&batch, &config(4), &query);
    expect![[r#"
        Ok(ApplyReport { applied: Stored { blocks: 5 }, skipped: None }) => depth 5, 5 held
        Ok(ApplyReport { applied: Stored { blocks: 1 }, skipped: None }) => depth 6, 6 held
        Ok(ApplyReport { applied: Removed { blocks: 1 }, skipped: None }) => depth 1, 5 held
        Ok(ApplyReport { applied: Nothing, skipped: Some(OtherGroup(1)) }) => depth 1, 5 held
        Ok(ApplyReport { applied: Cleared, skipped: None }) => depth 0, 0 held
    "#]]
    .assert_eq(&out);
}

/// Fixtures applied event by event, with the depth of their tokens hashed by the router:
/// * `removed_cpu`: a GPU store, then the offloading connector's CPU store (without tokens) of
///   the same blocks and a CPU removal of them; the GPU still holds them.
/// * `sglang_negative_hashes`: i64 hashes apply; a removal from the host tier is skipped.
/// * `legacy_2025`: events without medium or group are the GPU cache's.
#[test]
fn fixtures_applied_event_by_event() {
    let cases = [
        ("removed_cpu", 0..8),
        ("sglang_negative_hashes", 0..12),
        ("legacy_2025", 100..112),
    ];
    let mut out = String::new();
    for (name, tokens) in cases {
        let query = locals(&tokens.collect::<Vec<u32>>(), None, None);
        out += &format!("{name}\n{}", script(&common::decoded(name), &config(4), &query).1);
    }
    expect![[r#"
        removed_cpu
        Ok(ApplyReport { applied: Stored { blocks: 2 }, skipped: None }) => depth 2, 2 held
        Ok(ApplyReport { applied: TierStored { tier: Cpu, blocks: 2 }, skipped: None }) => depth 2, 2 held
        Ok(ApplyReport { applied: TierRemoved { tier: Cpu, blocks: 2 }, skipped: None }) => depth 2, 2 held
        sglang_negative_hashes
        Ok(ApplyReport { applied: Stored { blocks: 2 }, skipped: None }) => depth 2, 2 held
        Ok(ApplyReport { applied: Stored { blocks: 1 }, skipped: None }) => depth 3, 3 held
        Ok(ApplyReport { applied: Nothing, skipped: Some(OtherMedium("CPU_PINNED")) }) => depth 3, 3 held
        legacy_2025
        Ok(ApplyReport { applied: Stored { blocks: 2 }, skipped: None }) => depth 2, 2 held
        Ok(ApplyReport { applied: Stored { blocks: 1 }, skipped: None }) => depth 3, 3 held
        Ok(ApplyReport { applied: Removed { blocks: 1 }, skipped: None }) => depth 0, 2 held
        Ok(ApplyReport { applied: Cleared, skipped: None }) => depth 0, 0 held
    "#]]
    .assert_eq(&out);
}

fn store(hashes: &[u64], tokens: usize, block_size: u32) -> WireEvent {
    WireEvent::BlockStored(BlockStored {
        block_hashes: hashes.iter().copied().map(ExternalBlockHash).collect(),
        parent_block_hash: None,
        token_ids: (0..tokens as u32).collect(),
        block_size,
        lora_id: None,
        medium: Some("gpu".into()),
        lora_name: None,
        cache_salt: None,
        group_idx: None,
    })
}

#[test]
fn stores_whose_tokens_do_not_fill_their_blocks() {
    let cases = [
        ("3 blocks, tokens for 2 and a half", store(&[1, 2, 3], 10, 4)),
        ("2 blocks, no tokens (an offload event)", store(&[1, 2], 0, 4)),
        (
            "1 block, 6 tokens (a hybrid model's null blocks)",
            store(&[1], 6, 4),
        ),
        ("no blocks, no tokens", store(&[], 0, 4)),
        ("blocks of 16 tokens, router hashes 4", store(&[1], 16, 16)),
        (
            "an unknown event",
            WireEvent::Unknown {
                tag: "BlockPinned".into(),
            },
        ),
    ];
    let mut out = String::new();
    for (name, event) in cases {
        let mut index = index();
        let report = event.apply_to(&mut index, W, &config(4)).unwrap();
        let reason = report.skipped.as_ref().map(ToString::to_string);
        writeln!(
            out,
            "{name}: {:?}, held {}, {reason:?}",
            report.applied,
            index.block_count(W)
        )
        .unwrap();
    }
    expect![[r#"
        3 blocks, tokens for 2 and a half: Stored { blocks: 2 }, held 2, Some("1 blocks came without their tokens")
        2 blocks, no tokens (an offload event): Nothing, held 0, Some("2 blocks came without their tokens")
        1 block, 6 tokens (a hybrid model's null blocks): Nothing, held 0, Some("6 tokens do not split into 1 blocks")
        no blocks, no tokens: Nothing, held 0, None
        blocks of 16 tokens, router hashes 4: Nothing, held 0, Some("blocks of 16 tokens, but the router hashes blocks of 4")
        an unknown event: Nothing, held 0, Some("unknown event type \"BlockPinned\"")
    "#]]
    .assert_eq(&out);
}

#[test]
fn the_tracked_group_and_namespace_come_from_the_config() {
    // map_2026_extras stores blocks of group 2 under LoRA "lora-a".
    let batch = common::decoded("map_2026_extras");
    let tokens: Vec<u32> = (0..8).collect();
    let group_2 = ApplyConfig {
        group_idx: 2,
        namespace: Some("tenant"),
        ..config(4)
    };
    let (_, out) = script(&batch, &group_2, &locals(&tokens, Some("lora-a"), Some("tenant")));
    expect![[r#"
        Ok(ApplyReport { applied: Stored { blocks: 2 }, skipped: None }) => depth 2, 2 held
        Ok(ApplyReport { applied: Nothing, skipped: Some(UnknownEvent("BlockPinned")) }) => depth 2, 2 held
        Ok(ApplyReport { applied: Removed { blocks: 1 }, skipped: None }) => depth 1, 1 held
    "#]]
    .assert_eq(&out);
    // Hashed without the namespace, or without the LoRA name, the prompt finds nothing.
    let (index, _) = script(&batch, &group_2, &[]);
    assert_eq!(
        index
            .find_matches(&locals(&tokens, Some("lora-a"), None), false)
            .depth(W),
        0
    );
    assert_eq!(
        index
            .find_matches(&locals(&tokens, None, Some("tenant")), false)
            .depth(W),
        0
    );
    // Group 0 is not this event's.
    let report = batch.events[0]
        .apply_to(&mut self::index(), W, &config(4))
        .unwrap();
    assert_eq!(
        (report.applied, report.skipped),
        (Applied::Nothing, Some(SkipReason::OtherGroup(2)))
    );
}

#[test]
fn index_errors_come_through() {
    let mut orphan = store(&[2], 4, 4);
    if let WireEvent::BlockStored(stored) = &mut orphan {
        stored.parent_block_hash = Some(ExternalBlockHash(1));
    }
    let error = orphan.apply_to(&mut index(), W, &config(4)).unwrap_err();
    assert_eq!(
        error.to_string(),
        "worker 1/0 stored blocks under parent ExternalBlockHash(1), which it does not hold"
    );
}

/// A simulated engine's events, applied to one index directly and to another through the wire
/// (encoded, framed, decoded, converted), leave both holding what the engine caches; with a CPU
/// tier, its events as vLLM's offloading connector sends them (no tokens, no parent) too.
#[test]
fn engine_events_reach_the_index_alike_through_the_wire() {
    through_the_wire(None);
    through_the_wire(Some(CpuOffload::new(16, KvTransfer::default())));
}

fn through_the_wire(cpu_offload: Option<CpuOffload>) {
    let mut engine = Engine::new(EngineConfig {
        block_size: 4,
        num_blocks: 24,
        max_num_seqs: 4,
        max_num_batched_tokens: 32,
        max_model_len: 256,
        enable_chunked_prefill: true,
        enable_prefix_caching: true,
        external_hash_seed: 9,
        speedup: 1.0,
        timing: TimingConfig::Polynomial,
        step_jitter: None,
        cpu_offload,
    })
    .expect("the engine's own events");
    let prompts: Vec<(Vec<u32>, Option<&str>)> = (0..12u32)
        .map(|i| {
            let shared = (0..8 * (i % 3)).collect::<Vec<u32>>();
            let own = (0..4 + 5 * (i % 4)).map(|t| 1000 * (i + 1) + t);
            let lora = (i % 5 == 0).then_some("adapter");
            (shared.into_iter().chain(own).collect(), lora)
        })
        .collect();
    for (i, (tokens, lora)) in prompts.iter().enumerate() {
        let request = EngineRequest {
            id: RequestId(i as u64),
            prompt: EnginePrompt::Tokens(tokens.clone()),
            output_len: 3 + i as u32 % 4,
            lora_name: lora.map(str::to_owned),
            cache_namespace: None,
            kv_report: kvroute_engine::KvReportMode::Incremental,
        };
        engine
            .add_request(Timestamp::ZERO, request)
            .expect("the engine's own events");
    }
    let (mut direct, mut wired) = (index(), index());
    let mut seq = 0;
    let mut events = 0;
    while let Some(at) = engine.next_wakeup() {
        let Some(step) = engine.step(at) else { break };
        let encoding = if seq % 2 == 0 {
            EventEncoding::Map
        } else {
            EventEncoding::Positional
        };
        let batch = EventBatch {
            topic: "kv".into(),
            seq,
            ts: at.as_secs_f64(),
            events: step.events.iter().map(WireEvent::from).collect(),
            dp_rank: Some(0),
        };
        let received =
            EventBatch::decode_live(&batch.encode_live(encoding).expect("the engine's own events"))
                .expect("the engine's own events");
        assert_eq!(received, batch);
        for (event, wire) in step.events.iter().zip(&received.events) {
            direct
                .apply_event(W, event.as_index_event())
                .expect("the engine's own events");
            let report = wire
                .apply_to(&mut wired, W, &config(4))
                .expect("the engine's own events");
            assert_eq!(report.skipped, None);
            events += 1;
        }
        let cached: BTreeSet<ExternalBlockHash> = engine.cached_blocks().collect();
        assert_eq!(wired.held_blocks(W).collect::<BTreeSet<_>>(), cached);
        assert_eq!(direct.held_blocks(W).collect::<BTreeSet<_>>(), cached);
        let cpu = engine.cpu_blocks();
        for index in [&direct, &wired] {
            assert_eq!(index.tier_block_count(W, Tier::Cpu), cpu.len());
            assert!(cpu.iter().all(|&h| index.tier_holds(W, Tier::Cpu, h)));
        }
        for (tokens, lora) in &prompts {
            let query = locals(tokens, *lora, None);
            assert_eq!(
                wired.find_matches(&query, false),
                direct.find_matches(&query, false)
            );
        }
        seq += 1;
    }
    // The workload evicts: removals went through too, and with a tier its stores and removals.
    let stats = direct.stats();
    assert!(
        events > 20 && stats.blocks_removed > 0,
        "{events} events, {stats:?}"
    );
    if cpu_offload.is_some() {
        assert_eq!(wired.stats(), stats);
        assert!(
            stats.tier_blocks_stored > 0 && stats.tier_blocks_removed > 0,
            "{stats:?}"
        );
    }
}

/// A CPU-tier event goes out as vLLM's offloading connector sends it (its medium, the hashes,
/// no parent, no tokens, block size 0) and comes back as the same tier event; a removal alike.
#[test]
fn a_cpu_tier_event_is_sent_as_vllms_offloading_connector_sends_it() {
    let blocks = vec![ExternalBlockHash(5), ExternalBlockHash(6)];
    let tier = |b: &Vec<ExternalBlockHash>| TierBlocks {
        tier: Tier::Cpu,
        block_hashes: b.clone(),
    };
    let stored = KvEvent::TierStored(tier(&blocks));
    let wire = WireEvent::from(&stored);
    assert_eq!(
        wire,
        WireEvent::BlockStored(BlockStored {
            block_hashes: blocks.clone(),
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size: 0,
            lora_id: None,
            medium: Some("CPU".into()),
            lora_name: None,
            cache_salt: None,
            group_idx: None,
        })
    );
    let removed = KvEvent::TierRemoved(tier(&blocks));
    for event in [stored, removed] {
        let back = WireEvent::from(&event).to_kv_event(&config(4));
        assert_eq!((back.event, back.skipped), (Some(event), None));
    }
}

/// vLLM folds a request's `cache_salt` into its first block's extra keys alone: a store that
/// starts the sequence carries it (after the LoRA name), one that continues it does not. Through
/// both encodings, the stored chain is found by the prompt hashed as the router hashes a salted
/// request (`PromptHasher`), and by no other salt's or the unsalted prompt.
#[test]
fn a_salted_chain_is_found_by_its_salt_alone() {
    let tokens: Vec<u32> = (100..112).collect();
    let stored = |hashes: &[u64], parent: Option<u64>, range: std::ops::Range<usize>, salt: Option<&str>| {
        WireEvent::BlockStored(BlockStored {
            block_hashes: hashes.iter().copied().map(ExternalBlockHash).collect(),
            parent_block_hash: parent.map(ExternalBlockHash),
            token_ids: tokens[range].to_vec(),
            block_size: 4,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: Some("sql".into()),
            cache_salt: salt.map(str::to_owned),
            group_idx: None,
        })
    };
    let batch = EventBatch {
        topic: String::new(),
        seq: 0,
        ts: 0.0,
        events: vec![
            stored(&[1, 2], None, 0..8, Some("tenant")),
            stored(&[3], Some(2), 8..12, None),
        ],
        dp_rank: None,
    };
    let prompt = |lora_name, namespace| {
        kvroute_core::hash::PromptHasher::new(4, &HashSalt { lora_name, namespace }).local_hashes(&tokens)
    };
    for encoding in [EventEncoding::Map, EventEncoding::Positional] {
        let bytes = batch.encode_payload(encoding).unwrap();
        let decoded = EventBatch::decode_payload("", 0, &bytes).unwrap();
        assert_eq!(decoded.events, batch.events, "{encoding:?}");
        let (index, out) = script(&decoded, &config(4), &prompt(Some("sql"), Some("tenant")));
        expect![[r#"
            Ok(ApplyReport { applied: Stored { blocks: 2 }, skipped: None }) => depth 2, 2 held
            Ok(ApplyReport { applied: Stored { blocks: 1 }, skipped: None }) => depth 3, 3 held
        "#]]
        .assert_eq(&out);
        for (lora, salt) in [
            (Some("sql"), None),
            (Some("sql"), Some("other")),
            (None, Some("tenant")),
        ] {
            let depth = index.find_matches(&prompt(lora, salt), false).depth(W);
            assert_eq!(depth, 0, "{lora:?} {salt:?}");
        }
    }
}
