//! The timing models: hand-checked roofline step times, monotonicity, and configuration text.

use kvroute_engine::timing::{Roofline, RooflineConfig, RooflineEfficiency};
use kvroute_engine::{
    ConfigError, EngineConfig, ForwardPass, GpuSpec, ModelSpec, SpecError, TimingConfig, TimingModel,
};
use proptest::prelude::*;

/// Round figures so the arithmetic below can be checked by hand: half of peak compute, 80% of
/// memory and interconnect bandwidth, no step overhead.
const EFFICIENCY: RooflineEfficiency = RooflineEfficiency {
    prefill_compute: 0.5,
    decode_compute: 0.5,
    memory: 0.8,
    interconnect: 0.8,
    step_overhead_secs: 0.0,
};

fn roofline(model: &str, gpu: &str, tensor_parallel: u32) -> Roofline {
    Roofline::new(RooflineConfig {
        model: ModelSpec::builtin(model).expect("built in"),
        gpu: GpuSpec::builtin(gpu).expect("built in"),
        tensor_parallel,
        efficiency: EFFICIENCY,
    })
    .expect("valid")
}

fn decode(seqs: u32, context_tokens: u64) -> ForwardPass {
    ForwardPass {
        decode_seqs: seqs,
        decode_context_tokens: context_tokens,
        ..ForwardPass::default()
    }
}

/// One prefill chunk of `new` tokens after `context` cached tokens.
fn prefill(new: u64, context: u64) -> ForwardPass {
    ForwardPass {
        prefill_seqs: 1,
        prefill_tokens: new,
        prefill_context_tokens: context,
        prefill_attention_pairs: new * context + new * (new + 1) / 2,
        ..ForwardPass::default()
    }
}

fn assert_close(got: f64, want: f64) {
    assert!((got - want).abs() <= want * 1e-9, "got {got}, want {want}");
}

// Llama-3.1-8B (32 layers, hidden 4096, 32 heads, 8 KV heads, head dim 128, intermediate 14336,
// vocabulary 128256, BF16) on an H100 SXM (989e12 FLOP/s, 3.35e12 B/s), TP 1:
//
//   attention weights per layer = 4096·4096 (Q) + 2·4096·1024 (K, V) + 4096·4096 (O) = 41,943,040
//   MLP weights per layer       = 3·4096·14336                                      = 176,160,768
//   linear FLOPs per token      = 2·32·(41,943,040 + 176,160,768)                   = 13,958,643,712
//   LM-head FLOPs per sequence  = 2·4096·128256                                     = 1,050,673,152
//   attention FLOPs per pair    = 4·32 heads·128·32 layers                          = 524,288
//   weight bytes                = 2·(32·(41,943,040 + 176,160,768) + 4096·128256)   = 15,009,316,864
//   KV bytes per token          = 32 layers·2·8 heads·128·2 bytes                   = 131,072
//   achieved compute            = 0.5·989e12 = 4.945e14 FLOP/s
//   achieved bandwidth          = 0.8·3.35e12 = 2.68e12 B/s

#[test]
fn llama_8b_decode_of_one_sequence_is_bound_by_reading_the_weights() {
    // One sequence with 1023 tokens of context reads 1024 tokens of KV.
    //   bytes = 15,009,316,864 + 1024·131,072 = 15,143,534,592 → / 2.68e12 = 5.6506 ms
    //   FLOPs = 13,958,643,712 + 1,050,673,152 + 1024·524,288 = 15,546,187,776 → / 4.945e14 = 0.031 ms
    let r = roofline("llama-3.1-8b", "h100-sxm", 1);
    assert_close(r.pass_secs(&decode(1, 1024)), 15_143_534_592.0 / 2.68e12);
}

#[test]
fn llama_8b_decode_of_64_sequences_adds_their_kv_reads() {
    // 64 sequences of 1024 KV tokens each: 65,536 KV tokens.
    //   bytes = 15,009,316,864 + 65,536·131,072 = 23,599,251,456 → / 2.68e12 = 8.8057 ms
    //   FLOPs = 64·15,009,316,864 + 65,536·524,288 = 994,956,017,664 → / 4.945e14 = 2.0120 ms
    let r = roofline("llama-3.1-8b", "h100-sxm", 1);
    assert_close(r.pass_secs(&decode(64, 65_536)), 23_599_251_456.0 / 2.68e12);
}

#[test]
fn llama_8b_prefill_of_2048_tokens_is_bound_by_compute() {
    // 2048 new tokens, no context: 2048·2049/2 = 2,098,176 attention pairs.
    //   FLOPs = 2048·13,958,643,712 + 2,098,176·524,288 + 1,050,673,152 = 29,688,401,494,016
    //           → / 4.945e14 = 60.037 ms
    //   bytes = 15,009,316,864 + 2048·131,072 = 15,277,752,320 → / 2.68e12 = 5.70 ms
    let r = roofline("llama-3.1-8b", "h100-sxm", 1);
    assert_close(r.pass_secs(&prefill(2048, 0)), 29_688_401_494_016.0 / 4.945e14);
    // With a decoding sequence riding along, the weights are not read twice: decode adds only its
    // KV reads, 1024·131,072 = 134,217,728 bytes → / 2.68e12 = 0.0501 ms.
    let mixed = ForwardPass {
        decode_seqs: 1,
        decode_context_tokens: 1024,
        ..prefill(2048, 0)
    };
    assert_close(
        r.pass_secs(&mixed),
        29_688_401_494_016.0 / 4.945e14 + 134_217_728.0 / 2.68e12,
    );
}

#[test]
fn llama_8b_on_two_gpus_halves_the_reads_and_pays_an_all_reduce() {
    // TP 2: weights 7,504,658,432 bytes per GPU; 4 KV heads per GPU, 65,536 KV bytes per token.
    //   bytes = 7,504,658,432 + 1024·65,536 = 7,571,767,296 → / 2.68e12 = 2.8253 ms
    //   all-reduce: 2·32 layers·4096·2 bytes = 524,288 bytes per token, ring factor 2(2−1)/2 = 1,
    //   at 0.8·900e9 = 7.2e11 B/s → 0.000728 ms
    let r = roofline("llama-3.1-8b", "h100-sxm", 2);
    assert_close(
        r.pass_secs(&decode(1, 1024)),
        7_571_767_296.0 / 2.68e12 + 524_288.0 / 7.2e11,
    );
}

#[test]
fn mixtral_reads_only_the_experts_its_tokens_use() {
    // One token uses 2 of 8 experts: 8·(1 − (1 − 2/8)^1) = 2. Many tokens use all 8.
    let r = roofline("mixtral-8x7b", "h100-sxm", 1);
    let expert = 2.0 * 32.0 * 3.0 * 4096.0 * 14336.0;
    let shared = r.weight_bytes(0);
    assert_close(r.weight_bytes(1), shared + 2.0 * expert);
    assert!((r.weight_bytes(10_000) - (shared + 8.0 * expert)).abs() < 1.0);
    // Mixtral decodes one sequence faster than it would read every expert.
    assert!(r.pass_secs(&decode(1, 1)) < (shared + 8.0 * expert) / 2.68e12);
}

#[test]
fn decode_grows_with_batch_and_with_kv_tokens_and_prefill_with_context() {
    for model in ModelSpec::builtin_names() {
        for gpu in GpuSpec::builtin_names() {
            let r = roofline(model, gpu, 1);
            let t = |p: &ForwardPass| r.pass_secs(p);
            assert!(t(&decode(2, 2048)) > t(&decode(1, 1024)), "{model} on {gpu}");
            assert!(t(&decode(8, 80_000)) > t(&decode(8, 8_000)), "{model} on {gpu}");
            assert!(t(&prefill(512, 8192)) > t(&prefill(512, 0)), "{model} on {gpu}");
            assert!(t(&prefill(4096, 0)) > t(&prefill(512, 0)), "{model} on {gpu}");
        }
    }
}

/// A pass built from random chunks, and the same pass with more work.
fn pass_and_more() -> impl Strategy<Value = (ForwardPass, ForwardPass)> {
    let chunks = prop::collection::vec((1..4096u64, 0..32_768u64), 0..4);
    let decodes = prop::collection::vec(1..32_768u64, 0..64);
    let extra = prop_oneof![
        (1..4096u64, 0..32_768u64).prop_map(|(n, c)| (Some((n, c)), None)),
        (1..32_768u64).prop_map(|c| (None, Some(c))),
    ];
    (chunks, decodes, extra).prop_filter_map("a pass computes something", |(chunks, decodes, extra)| {
        let build = |chunks: &[(u64, u64)], decodes: &[u64]| {
            let mut p = ForwardPass::default();
            for &(n, c) in chunks {
                p.prefill_seqs += 1;
                p.prefill_tokens += n;
                p.prefill_context_tokens += c;
                p.prefill_attention_pairs += n * c + n * (n + 1) / 2;
            }
            p.decode_seqs = decodes.len() as u32;
            p.decode_context_tokens = decodes.iter().sum();
            p
        };
        let base = build(&chunks, &decodes);
        let (mut more_chunks, mut more_decodes) = (chunks.clone(), decodes.clone());
        more_chunks.extend(extra.0);
        more_decodes.extend(extra.1);
        (base.tokens() > 0).then(|| (base, build(&more_chunks, &more_decodes)))
    })
}

proptest! {
    #[test]
    fn roofline_never_gets_faster_with_more_work(
        (base, more) in pass_and_more(),
        model in prop::sample::select(ModelSpec::builtin_names().collect::<Vec<_>>()),
        gpu in prop::sample::select(GpuSpec::builtin_names().collect::<Vec<_>>()),
        tp in prop::sample::select(vec![1u32, 2, 4, 8]),
    ) {
        let r = Roofline::new(RooflineConfig {
            model: ModelSpec::builtin(model).unwrap(),
            gpu: GpuSpec::builtin(gpu).unwrap(),
            tensor_parallel: tp,
            efficiency: RooflineEfficiency::TYPICAL,
        }).unwrap();
        prop_assert!(r.pass_secs(&more) >= r.pass_secs(&base));
    }
}

const ENGINE: &str = r#"
block_size = 16
num_blocks = 2048
max_num_seqs = 64
max_num_batched_tokens = 2048
max_model_len = 8192
enable_chunked_prefill = true
enable_prefix_caching = true
external_hash_seed = 1
speedup = 1.0
"#;

#[test]
fn engine_configs_parse_from_toml_with_each_timing_model() {
    let polynomial =
        EngineConfig::from_toml_str(&format!("{ENGINE}\n[timing]\nkind = \"polynomial\"\n")).unwrap();
    assert_eq!(polynomial.timing, TimingConfig::Polynomial);

    let model = include_str!("../data/models/qwen2.5-7b.toml");
    let gpu = include_str!("../data/gpus/a100-sxm-80gb.toml");
    let roofline = format!(
        "{ENGINE}\n[timing]\nkind = \"roofline\"\ntensor_parallel = 1\n\
         [timing.efficiency]\nprefill_compute = 0.45\ndecode_compute = 0.3\nmemory = 0.8\n\
         interconnect = 0.7\nstep_overhead_secs = 0.0005\n[timing.model]\n{model}\n[timing.gpu]\n{gpu}"
    );
    let config = EngineConfig::from_toml_str(&roofline).unwrap();
    let TimingConfig::Roofline(r) = &config.timing else {
        panic!("{:?}", config.timing)
    };
    assert_eq!(r.model, ModelSpec::builtin("qwen2.5-7b").unwrap());
    assert_eq!(r.efficiency, RooflineEfficiency::TYPICAL);
    kvroute_engine::Engine::new(config).unwrap();

    let table = format!(
        "{ENGINE}\n[timing]\nkind = \"table\"\n[timing.prefill]\ntokens = [1, 100]\nms = [1.0, 2.0]\n\
         [timing.decode]\nbatch_size = [1]\nkv_tokens = [1]\nms = [[1.0]]\n"
    );
    assert!(matches!(
        EngineConfig::from_toml_str(&table).unwrap().timing,
        TimingConfig::Table(_)
    ));
}

#[test]
fn bad_engine_configs_are_refused_with_the_reason() {
    let parse = |extra: &str| {
        EngineConfig::from_toml_str(&format!("{ENGINE}{extra}\n[timing]\nkind = \"polynomial\"\n"))
    };
    assert!(matches!(
        parse("surprise = 1"),
        Err(ConfigError::Parse(SpecError::Parse { .. }))
    ));
    let text = ENGINE.replace("speedup = 1.0", "speedup = 0.0");
    let err = EngineConfig::from_toml_str(&format!("{text}\n[timing]\nkind = \"polynomial\"\n")).unwrap_err();
    assert_eq!(err, ConfigError::Speedup(0.0));
    let text = ENGINE.replace("num_blocks = 2048", "num_blocks = 0");
    let err = EngineConfig::from_toml_str(&format!("{text}\n[timing]\nkind = \"polynomial\"\n")).unwrap_err();
    assert_eq!(err, ConfigError::Zero { field: "num_blocks" });
    let text = ENGINE.replace("enable_chunked_prefill = true", "enable_chunked_prefill = false");
    let err = EngineConfig::from_toml_str(&format!("{text}\n[timing]\nkind = \"polynomial\"\n")).unwrap_err();
    assert_eq!(
        err,
        ConfigError::BudgetBelowModelLen {
            max_num_batched_tokens: 2048,
            max_model_len: 8192
        }
    );
    let mut config =
        EngineConfig::from_toml_str(&format!("{ENGINE}\n[timing]\nkind = \"polynomial\"\n")).unwrap();
    config.timing = TimingConfig::Roofline(RooflineConfig {
        model: ModelSpec::builtin("llama-3.1-8b").unwrap(),
        gpu: GpuSpec::builtin("h100-sxm").unwrap(),
        tensor_parallel: 0,
        efficiency: EFFICIENCY,
    });
    assert!(matches!(
        kvroute_engine::Engine::new(config),
        Err(ConfigError::Timing(SpecError::Invalid {
            field: "tensor_parallel",
            ..
        }))
    ));
}
