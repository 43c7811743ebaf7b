//! Simulated engine speed: steps and tokens per CPU-second for a saturated engine.
//!
//! The engine runs 256 sequences at once (vLLM's default `max_num_seqs`), blocks of 16 tokens,
//! 8192 tokens per pass, prefix caching and chunked prefill on. Every prompt is 1024 tokens, a
//! 512-token prefix shared by all followed by 512 of its own; outputs are 128 to 1023 tokens.
//! Whenever requests finish, as many new ones arrive, so 256 always run and passes mix decode
//! with the newcomers' prefill, as in a saturated server. The cache holds every running
//! sequence at its longest, so nothing is preempted, and freed blocks are evicted as new ones
//! are needed.
//!
//! `cargo bench -p kvroute-engine` runs criterion over single steps (elements = requests in the
//! pass), then prints one summary line per timing model: steps, computed tokens and output
//! tokens per CPU-second over a fixed run.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput};
use kvroute_core::ids::RequestId;
use kvroute_core::time::Timestamp;
use kvroute_engine::timing::{RooflineConfig, RooflineEfficiency};
use kvroute_engine::{
    Engine, EngineConfig, EnginePrompt, EngineRequest, GpuSpec, ModelSpec, StepOutput, TimingConfig,
};

const RUNNING: u32 = 256;
const PROMPT: u32 = 1024;
const SHARED: u32 = 512;

fn config(timing: TimingConfig) -> EngineConfig {
    EngineConfig {
        block_size: 16,
        // 256 sequences of up to 1024 + 1023 tokens: 128 blocks each.
        num_blocks: RUNNING * 128 + 1024,
        max_num_seqs: RUNNING,
        max_num_batched_tokens: 8192,
        max_model_len: 4096,
        enable_chunked_prefill: true,
        enable_prefix_caching: true,
        external_hash_seed: 1,
        speedup: 1.0,
        timing,
        step_jitter: None,
        cpu_offload: None,
    }
}

fn roofline() -> TimingConfig {
    TimingConfig::Roofline(RooflineConfig {
        model: ModelSpec::builtin("llama-3.1-8b").expect("built in"),
        gpu: GpuSpec::builtin("h100-sxm").expect("built in"),
        tensor_parallel: 1,
        efficiency: RooflineEfficiency::TYPICAL,
    })
}

/// An engine kept at 256 running sequences.
struct Saturated {
    engine: Engine,
    next_id: u64,
    now: Timestamp,
}

impl Saturated {
    /// An engine with 256 requests, stepped until all of them have started decoding.
    fn new(timing: TimingConfig) -> Self {
        let mut s = Self {
            engine: Engine::new(config(timing)).expect("valid config"),
            next_id: 0,
            now: Timestamp::ZERO,
        };
        for _ in 0..RUNNING {
            s.arrive();
        }
        while s.engine.num_waiting() > 0 || s.engine.num_running() < RUNNING as usize {
            s.step();
        }
        s
    }

    fn arrive(&mut self) {
        let id = self.next_id;
        self.next_id += 1;
        let own = (0..PROMPT - SHARED).map(|t| 1_000_000 + (id as u32).wrapping_mul(PROMPT) + t);
        let request = EngineRequest {
            id: RequestId(id),
            prompt: EnginePrompt::Tokens((0..SHARED).chain(own).collect()),
            output_len: 128 + (id.wrapping_mul(7919) % 896) as u32,
            lora_name: None,
            cache_namespace: None,
            kv_report: kvroute_engine::KvReportMode::Incremental,
        };
        self.engine.add_request(self.now, request).expect("fits");
    }

    /// One step; every finished request is replaced by a new one.
    fn step(&mut self) -> StepOutput {
        let at = self.engine.next_wakeup().expect("saturated");
        let out = self.engine.step(at).expect("ready at its wakeup");
        self.now = out.end;
        for _ in 0..out.finished.len() {
            self.arrive();
        }
        out
    }
}

fn steps(c: &mut Criterion) {
    let mut group = c.benchmark_group("saturated_256");
    group.throughput(Throughput::Elements(u64::from(RUNNING)));
    group.measurement_time(Duration::from_secs(10));
    for (name, timing) in [("polynomial", TimingConfig::Polynomial), ("roofline", roofline())] {
        let mut s = Saturated::new(timing);
        group.bench_function(name, |b| b.iter(|| black_box(s.step())));
    }
    group.finish();
}

/// CPU time of this thread, from the kernel's scheduler statistics, where it has them.
fn thread_cpu_time() -> Option<Duration> {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
    let ns: u64 = text.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(ns))
}

/// Steps, computed tokens and output tokens per CPU-second over a fixed run. A benchmark measures
/// the wall clock; the engine under it never reads one.
#[allow(clippy::disallowed_methods)]
fn summary(name: &str, timing: TimingConfig) {
    const STEPS: u32 = 20_000;
    let mut s = Saturated::new(timing);
    let (cpu0, wall0) = (thread_cpu_time(), Instant::now());
    let (mut computed, mut emitted, mut finished) = (0u64, 0u64, 0u64);
    let sim0 = s.now;
    for _ in 0..STEPS {
        let out = s.step();
        computed += out.metrics.pass.tokens();
        emitted += out.emitted.iter().map(|e| u64::from(e.tokens)).sum::<u64>();
        finished += out.finished.len() as u64;
    }
    let wall = wall0.elapsed();
    let cpu = match (cpu0, thread_cpu_time()) {
        (Some(a), Some(b)) => b - a,
        _ => wall,
    };
    let per = |x: f64| x / cpu.as_secs_f64();
    println!(
        "summary {name}: {STEPS} steps, {computed} tokens computed, {emitted} output tokens, \
         {finished} requests finished, {:.3} s CPU ({:.3} s wall), {:.0} steps/s, \
         {:.0} computed tokens/s, {:.0} output tokens/s, simulated {:.1} s",
        cpu.as_secs_f64(),
        wall.as_secs_f64(),
        per(f64::from(STEPS)),
        per(computed as f64),
        per(emitted as f64),
        s.now.saturating_since(sim0).as_secs_f64(),
    );
}

fn main() {
    let mut criterion = Criterion::default().configure_from_args();
    steps(&mut criterion);
    criterion.final_summary();
    summary("polynomial", TimingConfig::Polynomial);
    summary("roofline", roofline());
}
