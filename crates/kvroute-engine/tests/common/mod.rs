//! The harness the engine's integration tests share: an engine, a router index fed with the
//! engine's events, and checks after every step.

#![allow(dead_code)] // Each test file uses a different part of the harness.

use std::collections::BTreeSet;

use kvroute_core::ids::{DpRank, ExternalBlockHash, RequestId, WorkerId, WorkerKey};
use kvroute_core::index::{IndexConfig, RunIndex, Tier};
use kvroute_core::time::Timestamp;
use kvroute_engine::{
    DecodeStretch, Engine, EngineConfig, EnginePrompt, EngineRequest, RequestError, StepOutput, TimingConfig,
};

/// A small engine: blocks of 4 tokens, 64 blocks, 8 sequences, 32 tokens per pass.
pub fn config() -> EngineConfig {
    EngineConfig {
        block_size: 4,
        num_blocks: 64,
        max_num_seqs: 8,
        max_num_batched_tokens: 32,
        max_model_len: 256,
        enable_chunked_prefill: true,
        enable_prefix_caching: true,
        external_hash_seed: 42,
        speedup: 1.0,
        timing: TimingConfig::Polynomial,
        step_jitter: None,
        cpu_offload: None,
    }
}

/// [`config`] changed by `change`.
pub fn with(change: impl FnOnce(&mut EngineConfig)) -> EngineConfig {
    let mut config = config();
    change(&mut config);
    config
}

/// A request for `tokens` that generates `output_len` tokens.
pub fn request(id: u64, tokens: impl IntoIterator<Item = u32>, output_len: u32) -> EngineRequest {
    EngineRequest {
        id: RequestId(id),
        prompt: EnginePrompt::Tokens(tokens.into_iter().collect()),
        output_len,
        lora_name: None,
        cache_namespace: None,
        kv_report: kvroute_engine::KvReportMode::Incremental,
    }
}

/// The router's view of the engine's cache, as a set.
pub fn held(index: &RunIndex, worker: WorkerKey) -> BTreeSet<ExternalBlockHash> {
    index.held_blocks(worker).collect()
}

/// An engine driven at its own wakeups, whose events feed a router index, with the engine's
/// invariants and the router's agreement checked after every step.
pub struct Harness {
    pub engine: Engine,
    pub index: RunIndex,
    pub worker: WorkerKey,
    /// The time of the last step or arrival.
    pub now: Timestamp,
    /// Every step's output, in order.
    pub log: Vec<StepOutput>,
    /// The running requests and the pure passes planned before the last step, if any.
    promised: Option<(Vec<RequestId>, u32)>,
    /// Passes a plan promised pure, checked.
    pub pure_passes: u64,
}

impl Harness {
    pub fn new(config: EngineConfig) -> Self {
        let worker = WorkerKey::new(WorkerId(1), DpRank(0));
        let mut index = RunIndex::new(IndexConfig::default());
        index.add_worker(worker);
        Self {
            engine: Engine::new(config).expect("valid config"),
            index,
            worker,
            now: Timestamp::ZERO,
            log: Vec::new(),
            promised: None,
            pure_passes: 0,
        }
    }

    /// Adds `request` at the current time.
    pub fn add(&mut self, request: EngineRequest) -> Result<(), RequestError> {
        self.engine.add_request(self.now, request)
    }

    /// Runs one step at the engine's wakeup, checks everything and returns its output; `None`
    /// when the engine is idle.
    pub fn step(&mut self) -> Option<StepOutput> {
        let at = self.engine.next_wakeup()?;
        assert!(at >= self.now, "time went back from {:?} to {at:?}", self.now);
        let running = self.engine.running_requests().to_vec();
        // The pure passes a stretch plans: those before its first grow (a block allocated or
        // completed) and before a last pass that finishes requests, none when none is planned.
        let mut stretch = DecodeStretch::default();
        let planned = self.engine.plan_decode_stretch(&mut stretch);
        let pure = planned - u32::from(stretch.finishing() > 0);
        let horizon = stretch.next_grow().map_or(pure, |g| (g - 1).min(pure));
        // After a promised pure pass the promise shrinks by one, unless the engine was touched
        // since (the same requests run and nothing waits).
        if let Some((before, promised)) = self.promised.take()
            && before == running
            && self.engine.num_waiting() == 0
            && self.engine.num_importing() == 0
        {
            assert_eq!(
                horizon,
                promised - 1,
                "the pure-decode horizon shrinks by one a pass"
            );
        }
        let out = self
            .engine
            .step(at)
            .expect("an engine with work runs at its wakeup");
        assert!(out.end > out.start, "a step takes time");
        if horizon > 0 {
            // A pass the horizon promised pure: one token for each running request, nothing else.
            assert!(
                out.events.is_empty()
                    && out.first_token.is_empty()
                    && out.finished.is_empty()
                    && out.preempted.is_empty()
                    && out.prefix_hits.is_empty(),
                "a pass promised pure did more: {out:?}"
            );
            let emitted: Vec<RequestId> = out.emitted.iter().map(|e| e.request).collect();
            assert_eq!(emitted, running, "a pure pass emits for every running request");
            assert!(out.emitted.iter().all(|e| e.tokens == 1));
            self.promised = Some((running, horizon));
            self.pure_passes += 1;
        }
        self.now = out.end;
        self.check(&out);
        self.log.push(out.clone());
        Some(out)
    }

    /// Steps until the engine is idle; returns the outputs of those steps.
    pub fn run(&mut self) -> Vec<StepOutput> {
        let mut outs = Vec::new();
        while let Some(out) = self.step() {
            outs.push(out);
            assert!(outs.len() < 100_000, "the engine does not finish");
        }
        outs
    }

    /// The engine's invariants, and the router's index against the engine's cache after
    /// applying the step's events.
    pub fn check(&mut self, out: &StepOutput) {
        if let Err(e) = self.engine.check_invariants() {
            panic!("engine invariant broken: {e}");
        }
        for event in &out.events {
            self.index
                .apply_event(self.worker, event.as_index_event())
                .unwrap_or_else(|e| panic!("{event:?}: {e}"));
        }
        if let Err(e) = self.index.check_invariants() {
            panic!("index invariant broken: {e}");
        }
        let engine: BTreeSet<_> = self.engine.cached_blocks().collect();
        assert_eq!(
            held(&self.index, self.worker),
            engine,
            "router and engine disagree"
        );
        // The CPU tier: the index holds there exactly what the engine does.
        let cpu = self.engine.cpu_blocks();
        assert_eq!(
            self.index.tier_block_count(self.worker, Tier::Cpu),
            cpu.len(),
            "router and engine disagree on the CPU tier"
        );
        if let Some(h) = cpu
            .iter()
            .find(|&&h| !self.index.tier_holds(self.worker, Tier::Cpu, h))
        {
            panic!("the engine's CPU tier holds {h:?}, the router's index does not");
        }
    }
}
