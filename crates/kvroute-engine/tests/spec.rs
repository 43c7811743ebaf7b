//! Model and GPU descriptions: Hugging Face `config.json` files read into the built-ins' shapes,
//! names and aliases, and the KV blocks a deployment fits, against hand computations.

use kvroute_engine::capacity::{Deployment, NON_TORCH_RESERVE_BYTES, PassLimits};
use kvroute_engine::{GpuSpec, ModelSpec, SpecError};
use proptest::prelude::*;

/// Each fixture is a model's `config.json` as published; it reads into the built-in of that
/// name (whose figures were copied from the same file by hand).
#[test]
fn hf_config_files_read_into_the_builtins() {
    let fixtures = [
        ("qwen3-8b", include_str!("data/hf/qwen3-8b.config.json")),
        ("mixtral-8x7b", include_str!("data/hf/mixtral-8x7b.config.json")),
    ];
    for (name, text) in fixtures {
        let parsed = ModelSpec::from_hf_config(name, text).expect(name);
        assert_eq!(parsed, ModelSpec::builtin(name).expect(name), "{name}");
    }
}

#[test]
fn hf_config_defaults_and_refusals() {
    // No head_dim: hidden / heads; no num_key_value_heads: one per query head; no dtype: bf16.
    let text = r#"{"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
        "intermediate_size": 512, "vocab_size": 1000, "torch_dtype": "float32"}"#;
    let m = ModelSpec::from_hf_config("tiny", text).expect("valid");
    assert_eq!(
        (m.head_dim, m.num_kv_heads, m.dtype_bytes, m.moe),
        (64, 4, 4, None)
    );
    let bad = text.replace("float32", "complex64");
    assert!(matches!(
        ModelSpec::from_hf_config("tiny", &bad),
        Err(SpecError::Invalid {
            field: "torch_dtype",
            ..
        })
    ));
    let missing = text.replace("\"vocab_size\": 1000,", "");
    let err = ModelSpec::from_hf_config("tiny", &missing).expect_err("no vocab_size");
    assert!(err.to_string().contains("vocab_size"), "{err}");
}

#[test]
fn builtins_answer_to_their_aliases() {
    for (alias, name) in [
        ("H100", "h100-sxm"),
        ("h100-80gb", "h100-sxm"),
        ("H100-80GB", "h100-sxm"),
        ("h200", "h200-sxm"),
        ("A100-80GB", "a100-sxm-80gb"),
        ("A100-40GB", "a100-sxm-40gb"),
        ("L40S", "l40s"),
    ] {
        assert_eq!(GpuSpec::builtin(alias).expect(alias).name, name);
    }
    for (alias, name) in [
        ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
        ("meta-llama/Llama-3.3-70B-Instruct", "llama-3.3-70b"),
        ("Qwen/Qwen3-32B", "qwen3-32b"),
        ("codellama/CodeLlama-34b-Instruct-hf", "codellama-34b"),
        ("meta-llama/Llama-2-7b-hf", "llama-2-7b"),
        ("mistralai/Mistral-Nemo-Instruct-2407", "mistral-nemo-12b"),
        ("mistralai/Mixtral-8x22B-Instruct-v0.1", "mixtral-8x22b"),
    ] {
        assert_eq!(ModelSpec::builtin(alias).expect(alias).name, name);
    }
    let err = GpuSpec::builtin("b200").expect_err("not built in");
    assert!(
        err.to_string().contains("\"b200\"") && err.to_string().contains("a100-sxm-40gb"),
        "{err}"
    );
}

/// Weight counts against the published totals (models.csv of the real-vLLM runs, from the
/// safetensors' sizes).
#[test]
fn builtin_weight_counts_match_the_published_ones() {
    for (name, billions) in [
        ("llama-2-7b", 6.74),
        ("llama-2-70b", 68.98),
        ("codellama-34b", 33.74),
        ("llama-3.1-70b", 70.55),
        ("qwen3-14b", 14.77),
        ("mistral-nemo-12b", 12.25),
        ("mixtral-8x22b", 140.63),
    ] {
        let total = ModelSpec::builtin(name).expect(name).total_params() / 1e9;
        // Norms and biases are left out: well under 1%.
        assert!((total - billions).abs() / billions < 0.01, "{name}: {total}");
    }
}

const LIMITS: PassLimits = PassLimits {
    block_size: 16,
    max_num_batched_tokens: 8192,
    max_num_seqs: 256,
};

#[test]
fn kv_blocks_of_llama_8b_on_one_h100_by_hand() {
    let (model, gpu) = (
        ModelSpec::builtin("llama-3.1-8b").unwrap(),
        GpuSpec::builtin("h100").unwrap(),
    );
    let d = Deployment {
        model: &model,
        gpu: &gpu,
        tensor_parallel: 1,
        gpu_memory_utilization: 0.9,
    };
    // Weights: 32 × (4096·4096·2 + 2·4096·1024 + 3·4096·14336) + 2·4096·128256
    // = 8,029,995,008 weights, 16,059,990,016 bytes.
    assert_eq!(d.weight_bytes(), 16_059_990_016.0);
    // Reserve: 1 GiB + 8192 · (4·4096 + 2·14336) · 2 + 256 · 128256 · 4 = 1,943,273,472.
    assert_eq!(d.activation_reserve_bytes(LIMITS), 1_943_273_472.0);
    // Block: 16 · 2 · 32 · 8 · 128 · 2 = 2,097,152 bytes.
    assert_eq!(d.kv_block_bytes(16), 2_097_152.0);
    // An H100's 80 GiB at 0.9: 77,309,411,328 bytes.
    // (77,309,411,328 − 16,059,990,016 − 1,943,273,472) / 2,097,152 = 28,279.6.
    assert_eq!(d.kv_blocks(LIMITS), Ok(28_279));
}

#[test]
fn kv_blocks_of_llama_70b_split_over_gpus_by_hand() {
    let model = ModelSpec::builtin("llama-3.1-70b").unwrap();
    let h100 = GpuSpec::builtin("h100").unwrap();
    let d = Deployment {
        model: &model,
        gpu: &h100,
        tensor_parallel: 4,
        gpu_memory_utilization: 0.9,
    };
    // 70,552,387,584 weights · 2 bytes / 4 GPUs; 8 KV heads → 2 per GPU.
    // Reserve: 1 GiB + 8192 · (4·8192 + 2·28672/4) · 2 + 256 · 128256 · 4 = 1,976,827,904.
    // Block: 16 · 2 · 80 · 2 · 128 · 2 = 1,310,720 bytes.
    // (77,309,411,328 − 35,276,193,792 − 1,976,827,904) / 1,310,720 = 30,560.6.
    assert_eq!(d.kv_blocks(LIMITS), Ok(30_560));
    // On two 40 GB A100s the weights alone (70.6 GB a GPU) leave no room.
    let a100 = GpuSpec::builtin("A100-40GB").unwrap();
    let err = Deployment {
        gpu: &a100,
        tensor_parallel: 2,
        ..d
    }
    .kv_blocks(LIMITS)
    .expect_err("does not fit");
    assert!(
        err.to_string().contains("llama-3.1-70b on 2 x a100-sxm-40gb"),
        "{err}"
    );
}

/// Real vLLM's own counts (the calibration set's T runs: H100s at 0.9, 16-token blocks, 2,048
/// batched tokens, 128 sequences) are met within 2 %.
#[test]
fn kv_blocks_are_within_two_percent_of_what_vllm_allocated() {
    let h100 = GpuSpec::builtin("H100-80GB").unwrap();
    let limits = PassLimits {
        block_size: 16,
        max_num_batched_tokens: 2048,
        max_num_seqs: 128,
    };
    for (model, tp, vllm) in [
        ("llama-2-7b", 1, 7_462),
        ("llama-2-70b", 4, 31_356),
        ("codellama-34b", 2, 26_602),
        ("mixtral-8x7b", 2, 27_510),
    ] {
        let model = ModelSpec::builtin(model).unwrap();
        let ours = Deployment {
            model: &model,
            gpu: &h100,
            tensor_parallel: tp,
            gpu_memory_utilization: 0.9,
        }
        .kv_blocks(limits)
        .unwrap();
        let off = (f64::from(ours) / f64::from(vllm) - 1.0).abs();
        assert!(off < 0.02, "{} on {tp}: {ours} blocks, vLLM {vllm}", model.name);
    }
}

proptest! {
    /// Against a reference: the blocks fit in what weights and reserve leave, one more does not;
    /// more memory or more GPUs never fit fewer blocks.
    #[test]
    fn kv_blocks_fill_what_is_left(
        model in prop::sample::select(ModelSpec::builtin_names().collect::<Vec<_>>()),
        gpu in prop::sample::select(GpuSpec::builtin_names().collect::<Vec<_>>()),
        tp in prop::sample::select(vec![1u32, 2, 4, 8]),
        util in 0.5f64..0.99,
        block_size in prop::sample::select(vec![16u32, 32, 64]),
    ) {
        let (model, gpu) = (ModelSpec::builtin(model).unwrap(), GpuSpec::builtin(gpu).unwrap());
        let d = Deployment { model: &model, gpu: &gpu, tensor_parallel: tp, gpu_memory_utilization: util };
        let limits = PassLimits { block_size, ..LIMITS };
        let free = gpu.memory_bytes * util - model.weight_bytes() / f64::from(tp)
            - d.activation_reserve_bytes(limits);
        prop_assert!(d.activation_reserve_bytes(limits) > NON_TORCH_RESERVE_BYTES);
        match d.kv_blocks(limits) {
            Ok(n) => {
                let block = d.kv_block_bytes(block_size);
                prop_assert!(f64::from(n) * block <= free && f64::from(n + 1) * block > free);
                let more = Deployment { gpu_memory_utilization: (util + 0.05).min(1.0), ..d };
                prop_assert!(more.kv_blocks(limits).unwrap() >= n);
                let wider = Deployment { tensor_parallel: tp * 2, ..d };
                prop_assert!(wider.kv_blocks(limits).unwrap() >= n);
            }
            Err(_) => prop_assert!(free < d.kv_block_bytes(block_size)),
        }
    }
}
