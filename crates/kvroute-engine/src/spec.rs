//! Descriptions of models and GPUs, for the roofline timing model.
//!
//! Both are plain data, read from TOML text. The crate ships a few as files under `data/`
//! (compiled in with `include_str!`, so no file is read at run time); [`ModelSpec::builtin`] and
//! [`GpuSpec::builtin`] name them. A user's own description is parsed from a string with
//! `from_toml_str`: reading the file is the caller's job (the CLI's), as all I/O is.
//!
//! Every description is validated when parsed, so a `ModelSpec` or `GpuSpec` in hand is usable.

use serde::Deserialize;

/// Why a model, GPU or profile description was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SpecError {
    /// The TOML text did not parse into the expected shape.
    #[error("cannot parse {what}: {message}")]
    Parse {
        /// What was being parsed ("model", "gpu", "table profile").
        what: &'static str,
        /// The parser's message, with the line and column.
        message: String,
    },
    /// No built-in description has this name.
    #[error("no built-in {what} named {name:?} (known: {known})")]
    UnknownBuiltin {
        /// "model" or "gpu".
        what: &'static str,
        /// The name asked for.
        name: String,
        /// The built-in names, comma-separated.
        known: String,
    },
    /// A field has a value the model cannot use.
    #[error("{what}: {field} {reason}")]
    Invalid {
        /// "model", "gpu" or "table profile".
        what: &'static str,
        /// The field at fault.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The model does not fit on its GPUs with room for a KV block.
    #[error(
        "{model} on {tensor_parallel} x {gpu}: weights and activations take {taken:.1} GB of each \
         GPU, of the {allowed:.1} GB the engine may use: no room for the KV cache (more tensor \
         parallelism, a larger GPU or a higher gpu-memory-utilization)",
        taken = *.taken_bytes as f64 / 1e9,
        allowed = *.allowed_bytes as f64 / 1e9
    )]
    DoesNotFit {
        /// The model's name.
        model: String,
        /// The GPU's name.
        gpu: String,
        /// GPUs the model is split over.
        tensor_parallel: u32,
        /// Bytes of each GPU the weights and activations take.
        taken_bytes: u64,
        /// Bytes of each GPU the engine may use.
        allowed_bytes: u64,
    },
}

/// Mixture-of-experts shape of a model's feed-forward layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MoeSpec {
    /// Experts per layer.
    pub num_experts: u32,
    /// Experts each token is routed to.
    pub experts_per_token: u32,
}

/// A transformer model's shape: what the roofline model needs to count FLOPs and bytes.
///
/// Attention is grouped-query (`num_kv_heads` may be below `num_attention_heads`) and the
/// feed-forward block is gated (SwiGLU: three `hidden × intermediate` matrices), as in the Llama,
/// Qwen and Mixtral families. Norms and biases are left out: they are well under 1% of weights
/// and FLOPs.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    /// A short name, such as `llama-3.1-8b`.
    pub name: String,
    /// Transformer layers.
    pub num_layers: u32,
    /// Width of the residual stream.
    pub hidden_size: u32,
    /// Query heads.
    pub num_attention_heads: u32,
    /// Key/value heads.
    pub num_kv_heads: u32,
    /// Width of one head.
    pub head_dim: u32,
    /// Width of one feed-forward expert (the whole feed-forward block for dense models).
    pub intermediate_size: u32,
    /// Vocabulary size (rows of the embedding and of the output projection).
    pub vocab_size: u32,
    /// Bytes per weight and per KV-cache element (2 for BF16).
    pub dtype_bytes: u32,
    /// Whether the output projection shares the embedding's weights. It changes the weight
    /// count, not the timing: every pass reads the output projection, and only a few rows of
    /// the embedding.
    pub tie_word_embeddings: bool,
    /// The mixture-of-experts shape; absent for dense models.
    #[serde(default)]
    pub moe: Option<MoeSpec>,
}

/// A GPU's datasheet figures.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuSpec {
    /// A short name, such as `h100-sxm`.
    pub name: String,
    /// Peak dense (not sparse) FLOP/s at the model's dtype.
    pub peak_dense_flops: f64,
    /// Memory bandwidth, bytes/s.
    pub memory_bandwidth: f64,
    /// GPU-to-GPU bandwidth used by tensor-parallel all-reduces, bytes/s.
    pub interconnect_bandwidth: f64,
    /// Memory capacity, bytes.
    pub memory_bytes: f64,
}

/// The model descriptions compiled into the crate: (name, TOML text).
const BUILTIN_MODELS: &[(&str, &str)] = &[
    ("llama-3.1-8b", include_str!("../data/models/llama-3.1-8b.toml")),
    ("llama-3.1-70b", include_str!("../data/models/llama-3.1-70b.toml")),
    ("qwen2.5-7b", include_str!("../data/models/qwen2.5-7b.toml")),
    ("mixtral-8x7b", include_str!("../data/models/mixtral-8x7b.toml")),
    ("llama-3.3-70b", include_str!("../data/models/llama-3.3-70b.toml")),
    ("llama-2-7b", include_str!("../data/models/llama-2-7b.toml")),
    ("llama-2-70b", include_str!("../data/models/llama-2-70b.toml")),
    ("codellama-34b", include_str!("../data/models/codellama-34b.toml")),
    ("qwen3-8b", include_str!("../data/models/qwen3-8b.toml")),
    ("qwen3-14b", include_str!("../data/models/qwen3-14b.toml")),
    ("qwen3-32b", include_str!("../data/models/qwen3-32b.toml")),
    (
        "mistral-nemo-12b",
        include_str!("../data/models/mistral-nemo-12b.toml"),
    ),
    ("mixtral-8x22b", include_str!("../data/models/mixtral-8x22b.toml")),
];

/// Other spellings of the built-in models (lower-cased, organisation and `-instruct` /
/// `-hf` suffixes dropped first): Hugging Face's repository names and common short names.
const MODEL_ALIASES: &[(&str, &str)] = &[
    ("meta-llama-3.1-8b", "llama-3.1-8b"),
    ("meta-llama-3.1-70b", "llama-3.1-70b"),
    ("mistral-nemo", "mistral-nemo-12b"),
    ("mistral-nemo-2407", "mistral-nemo-12b"),
];

/// The GPU descriptions compiled into the crate: (name, TOML text).
const BUILTIN_GPUS: &[(&str, &str)] = &[
    ("h100-sxm", include_str!("../data/gpus/h100-sxm.toml")),
    ("h200-sxm", include_str!("../data/gpus/h200-sxm.toml")),
    ("a100-sxm-80gb", include_str!("../data/gpus/a100-sxm-80gb.toml")),
    ("l40s", include_str!("../data/gpus/l40s.toml")),
    ("a100-sxm-40gb", include_str!("../data/gpus/a100-sxm-40gb.toml")),
];

/// Other spellings of the built-in GPUs (lower-cased first).
const GPU_ALIASES: &[(&str, &str)] = &[
    ("h100", "h100-sxm"),
    ("h100-80gb", "h100-sxm"),
    ("h100-sxm5", "h100-sxm"),
    ("h100-sxm-80gb", "h100-sxm"),
    ("h100-80gb-hbm3", "h100-sxm"),
    ("h200", "h200-sxm"),
    ("h200-141gb", "h200-sxm"),
    ("a100", "a100-sxm-80gb"),
    ("a100-80gb", "a100-sxm-80gb"),
    ("a100-sxm", "a100-sxm-80gb"),
    ("a100-40gb", "a100-sxm-40gb"),
    ("l40s-48gb", "l40s"),
];

/// The built-in name `name` stands for: itself lower-cased, with `prefixes` and `suffixes`
/// dropped, through `aliases`.
fn canonical(name: &str, aliases: &[(&str, &'static str)], suffixes: &[&str]) -> String {
    let mut n = name.trim().to_ascii_lowercase();
    if let Some((_, last)) = n.rsplit_once('/') {
        n = last.to_owned();
    }
    for suffix in suffixes {
        if let Some(stripped) = n.strip_suffix(suffix) {
            n = stripped.to_owned();
        }
    }
    match aliases.iter().find(|(a, _)| *a == n) {
        Some((_, canonical)) => (*canonical).to_owned(),
        None => n,
    }
}

/// Parses `text` as TOML into `T`, naming `what` in the error.
pub(crate) fn parse_toml<T: serde::de::DeserializeOwned>(
    text: &str,
    what: &'static str,
) -> Result<T, SpecError> {
    toml::from_str(text).map_err(|e| SpecError::Parse {
        what,
        message: e.to_string(),
    })
}

/// Parses `text` as TOML into `T` and checks it with `validate`, naming `what` in errors.
pub(crate) fn parse_valid<T: serde::de::DeserializeOwned>(
    text: &str,
    what: &'static str,
    validate: impl FnOnce(&T) -> Result<(), SpecError>,
) -> Result<T, SpecError> {
    let value: T = parse_toml(text, what)?;
    validate(&value)?;
    Ok(value)
}

/// The names in a table of built-in texts.
fn names(table: &'static [(&'static str, &'static str)]) -> impl Iterator<Item = &'static str> {
    table.iter().map(|(name, _)| *name)
}

/// The built-in text named `name` in `table`.
fn builtin_text(table: &[(&str, &'static str)], name: &str) -> Option<&'static str> {
    table.iter().find(|(n, _)| *n == name).map(|(_, text)| *text)
}

/// The error for a built-in `name` that `table` does not hold.
fn unknown(table: &[(&str, &'static str)], what: &'static str, name: &str) -> SpecError {
    SpecError::UnknownBuiltin {
        what,
        name: name.to_owned(),
        known: table.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", "),
    }
}

/// The keys of a Hugging Face `config.json` a [`ModelSpec`] is read from; others are ignored.
#[derive(Deserialize)]
struct HfConfig {
    num_hidden_layers: u32,
    hidden_size: u32,
    num_attention_heads: u32,
    num_key_value_heads: Option<u32>,
    head_dim: Option<u32>,
    intermediate_size: u32,
    vocab_size: u32,
    num_local_experts: Option<u32>,
    num_experts: Option<u32>,
    num_experts_per_tok: Option<u32>,
    torch_dtype: Option<String>,
    dtype: Option<String>,
    tie_word_embeddings: Option<bool>,
}

/// `Ok` if `ok`, else the [`SpecError::Invalid`] for `field`.
pub(crate) fn check(
    ok: bool,
    what: &'static str,
    field: &'static str,
    reason: &'static str,
) -> Result<(), SpecError> {
    if ok {
        Ok(())
    } else {
        Err(SpecError::Invalid { what, field, reason })
    }
}

/// `Ok` if `x` is finite and above zero.
fn check_positive(x: f64, what: &'static str, field: &'static str) -> Result<(), SpecError> {
    check(
        x.is_finite() && x > 0.0,
        what,
        field,
        "must be a finite number above zero",
    )
}

impl ModelSpec {
    /// The names of the built-in model descriptions.
    pub fn builtin_names() -> impl Iterator<Item = &'static str> {
        names(BUILTIN_MODELS)
    }

    /// The built-in description named `name` (see [`ModelSpec::builtin_names`]). Case does not
    /// matter, and a Hugging Face repository name names its model (`meta-llama/Llama-3.1-8B-Instruct`
    /// is `llama-3.1-8b`): the organisation and an `-instruct` or `-hf` suffix are dropped.
    pub fn builtin(name: &str) -> Result<Self, SpecError> {
        let canonical = canonical(
            name,
            MODEL_ALIASES,
            &["-hf", "-instruct-2407", "-instruct-v0.1", "-v0.1", "-instruct"],
        );
        let text =
            builtin_text(BUILTIN_MODELS, &canonical).ok_or_else(|| unknown(BUILTIN_MODELS, "model", name))?;
        Self::from_toml_str(text)
    }

    /// Reads a Hugging Face `config.json` (its text): `num_hidden_layers`, `hidden_size`,
    /// `num_attention_heads`, `num_key_value_heads` (default: as many as the query heads),
    /// `head_dim` (default `hidden_size / num_attention_heads`), `intermediate_size`,
    /// `vocab_size`, `num_local_experts` (or `num_experts`) with `num_experts_per_tok`,
    /// `torch_dtype` (or `dtype`; default bfloat16) and `tie_word_embeddings` (default false).
    /// Other keys are ignored: a config.json has many this model does not use. The result is
    /// named `name`.
    pub fn from_hf_config(name: &str, text: &str) -> Result<Self, SpecError> {
        let c: HfConfig = serde_json::from_str(text).map_err(|e| SpecError::Parse {
            what: "config.json",
            message: e.to_string(),
        })?;
        let heads = c.num_attention_heads;
        let head_dim = match c.head_dim {
            Some(d) => d,
            None => {
                check(
                    heads > 0,
                    "config.json",
                    "num_attention_heads",
                    "must be above zero",
                )?;
                c.hidden_size / heads
            }
        };
        let dtype = c.torch_dtype.or(c.dtype).unwrap_or_else(|| "bfloat16".to_owned());
        let dtype_bytes = match dtype.as_str() {
            "bfloat16" | "float16" | "half" => 2,
            "float32" | "float" => 4,
            "float8_e4m3fn" | "float8_e5m2" | "int8" | "uint8" => 1,
            _ => {
                return Err(SpecError::Invalid {
                    what: "config.json",
                    field: "torch_dtype",
                    reason: "is not one of bfloat16, float16, float32, float8_e4m3fn, float8_e5m2, int8",
                });
            }
        };
        let moe = match (c.num_local_experts.or(c.num_experts), c.num_experts_per_tok) {
            (Some(e), Some(k)) if e > 1 => Some(MoeSpec {
                num_experts: e,
                experts_per_token: k,
            }),
            (Some(e), None) if e > 1 => {
                return Err(SpecError::Invalid {
                    what: "config.json",
                    field: "num_experts_per_tok",
                    reason: "is needed with num_local_experts",
                });
            }
            _ => None,
        };
        let spec = Self {
            name: name.to_owned(),
            num_layers: c.num_hidden_layers,
            hidden_size: c.hidden_size,
            num_attention_heads: heads,
            num_kv_heads: c.num_key_value_heads.unwrap_or(heads),
            head_dim,
            intermediate_size: c.intermediate_size,
            vocab_size: c.vocab_size,
            dtype_bytes,
            tie_word_embeddings: c.tie_word_embeddings.unwrap_or(false),
            moe,
        };
        spec.validate()?;
        Ok(spec)
    }

    /// Parses and validates a model description written in TOML (the format of the files in
    /// `data/models/`).
    pub fn from_toml_str(text: &str) -> Result<Self, SpecError> {
        parse_valid(text, "model", Self::validate)
    }

    /// Checks that every dimension is usable.
    pub fn validate(&self) -> Result<(), SpecError> {
        const W: &str = "model";
        const POSITIVE: &str = "must be above zero";
        check(self.num_layers > 0, W, "num_layers", POSITIVE)?;
        check(self.hidden_size > 0, W, "hidden_size", POSITIVE)?;
        check(self.num_attention_heads > 0, W, "num_attention_heads", POSITIVE)?;
        check(self.num_kv_heads > 0, W, "num_kv_heads", POSITIVE)?;
        check(
            self.num_attention_heads % self.num_kv_heads == 0,
            W,
            "num_kv_heads",
            "must divide num_attention_heads",
        )?;
        check(self.head_dim > 0, W, "head_dim", POSITIVE)?;
        check(self.intermediate_size > 0, W, "intermediate_size", POSITIVE)?;
        check(self.vocab_size > 0, W, "vocab_size", POSITIVE)?;
        check(self.dtype_bytes > 0, W, "dtype_bytes", POSITIVE)?;
        if let Some(moe) = self.moe {
            check(moe.num_experts > 0, W, "moe.num_experts", POSITIVE)?;
            check(
                (1..=moe.num_experts).contains(&moe.experts_per_token),
                W,
                "moe.experts_per_token",
                "must be between 1 and num_experts",
            )?;
        }
        Ok(())
    }

    /// Weights of one layer's attention projections (Q, K, V and output).
    pub fn attention_params_per_layer(&self) -> f64 {
        let hidden = f64::from(self.hidden_size);
        let q = f64::from(self.num_attention_heads) * f64::from(self.head_dim);
        let kv = f64::from(self.num_kv_heads) * f64::from(self.head_dim);
        hidden * q + 2.0 * hidden * kv + q * hidden
    }

    /// Weights of one feed-forward expert (the whole feed-forward block of a dense model):
    /// gate, up and down projections.
    pub fn expert_params(&self) -> f64 {
        3.0 * f64::from(self.hidden_size) * f64::from(self.intermediate_size)
    }

    /// Experts per layer and experts per token (1 and 1 for a dense model).
    pub fn experts(&self) -> (u32, u32) {
        self.moe.map_or((1, 1), |m| (m.num_experts, m.experts_per_token))
    }

    /// Weights of the output projection (the "LM head").
    pub fn lm_head_params(&self) -> f64 {
        f64::from(self.hidden_size) * f64::from(self.vocab_size)
    }

    /// Bytes of KV cache one token takes in one layer, over all KV heads.
    pub fn kv_bytes_per_token_per_layer(&self) -> f64 {
        2.0 * f64::from(self.num_kv_heads) * f64::from(self.head_dim) * f64::from(self.dtype_bytes)
    }

    /// Every weight: each layer's attention, experts and (for MoE) router, the output
    /// projection, and the embedding unless tied to it.
    pub fn total_params(&self) -> f64 {
        let (experts, _) = self.experts();
        let router = if self.moe.is_some() {
            f64::from(self.hidden_size) * f64::from(experts)
        } else {
            0.0
        };
        let embedding = if self.tie_word_embeddings {
            0.0
        } else {
            self.lm_head_params()
        };
        f64::from(self.num_layers)
            * (self.attention_params_per_layer() + router + f64::from(experts) * self.expert_params())
            + self.lm_head_params()
            + embedding
    }

    /// Bytes of every weight ([`ModelSpec::total_params`] at `dtype_bytes`).
    pub fn weight_bytes(&self) -> f64 {
        self.total_params() * f64::from(self.dtype_bytes)
    }

    /// Bytes of KV cache one token takes over all layers (keys and values): what a
    /// prefill/decode transfer moves per token.
    pub fn kv_bytes_per_token(&self) -> u64 {
        2 * u64::from(self.num_layers)
            * u64::from(self.num_kv_heads)
            * u64::from(self.head_dim)
            * u64::from(self.dtype_bytes)
    }
}

impl GpuSpec {
    /// The names of the built-in GPU descriptions.
    pub fn builtin_names() -> impl Iterator<Item = &'static str> {
        names(BUILTIN_GPUS)
    }

    /// The built-in description named `name` (see [`GpuSpec::builtin_names`]), whatever its
    /// case, or a common alias: `h100`, `H100-80GB`, `h200`, `a100`, `A100-80GB`, `A100-40GB`,
    /// `l40s-48gb`.
    pub fn builtin(name: &str) -> Result<Self, SpecError> {
        let canonical = canonical(name, GPU_ALIASES, &[]);
        let text =
            builtin_text(BUILTIN_GPUS, &canonical).ok_or_else(|| unknown(BUILTIN_GPUS, "gpu", name))?;
        Self::from_toml_str(text)
    }

    /// Parses and validates a GPU description written in TOML (the format of the files in
    /// `data/gpus/`).
    pub fn from_toml_str(text: &str) -> Result<Self, SpecError> {
        parse_valid(text, "gpu", Self::validate)
    }

    /// Checks that every figure is a finite number above zero.
    pub fn validate(&self) -> Result<(), SpecError> {
        check_positive(self.peak_dense_flops, "gpu", "peak_dense_flops")?;
        check_positive(self.memory_bandwidth, "gpu", "memory_bandwidth")?;
        check_positive(self.interconnect_bandwidth, "gpu", "interconnect_bandwidth")?;
        check_positive(self.memory_bytes, "gpu", "memory_bytes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_builtin_parses_and_validates() {
        for name in ModelSpec::builtin_names() {
            assert_eq!(ModelSpec::builtin(name).unwrap().name, name);
        }
        for name in GpuSpec::builtin_names() {
            assert_eq!(GpuSpec::builtin(name).unwrap().name, name);
        }
    }

    #[test]
    fn builtin_figures_match_their_sources() {
        // Parameter counts from the shapes: Llama-3.1-8B has about 8.03 B weights.
        let m = ModelSpec::builtin("llama-3.1-8b").unwrap();
        let total = f64::from(m.num_layers) * (m.attention_params_per_layer() + m.expert_params())
            + 2.0 * m.lm_head_params();
        assert!((total / 1e9 - 8.03).abs() < 0.01, "{total}");
        // 2 (K and V) x 32 layers x 8 KV heads x 128 dims x 2 bytes.
        assert_eq!(m.kv_bytes_per_token(), 131_072);
        let mixtral = ModelSpec::builtin("mixtral-8x7b").unwrap();
        assert_eq!(mixtral.experts(), (8, 2));
        // Mixtral 8x7B: about 46.7 B weights.
        let total = f64::from(mixtral.num_layers)
            * (mixtral.attention_params_per_layer() + 8.0 * mixtral.expert_params())
            + 2.0 * mixtral.lm_head_params();
        assert!((total / 1e9 - 46.7).abs() < 0.1, "{total}");
        let l40s = GpuSpec::builtin("l40s").unwrap();
        assert_eq!(l40s.peak_dense_flops, 362e12);
    }

    #[test]
    fn bad_descriptions_are_refused_with_the_field() {
        let err = ModelSpec::builtin("gpt-5").unwrap_err();
        assert!(err.to_string().contains("llama-3.1-8b"), "{err}");
        let text =
            include_str!("../data/models/llama-3.1-8b.toml").replace("num_kv_heads = 8", "num_kv_heads = 5");
        assert_eq!(
            ModelSpec::from_toml_str(&text).unwrap_err(),
            SpecError::Invalid {
                what: "model",
                field: "num_kv_heads",
                reason: "must divide num_attention_heads"
            }
        );
        let text = include_str!("../data/gpus/h100-sxm.toml").replace("name", "nome");
        assert!(matches!(
            GpuSpec::from_toml_str(&text),
            Err(SpecError::Parse { what: "gpu", .. })
        ));
        let text = include_str!("../data/gpus/h100-sxm.toml").replace("3.35e12", "-1.0");
        assert!(matches!(
            GpuSpec::from_toml_str(&text),
            Err(SpecError::Invalid {
                field: "memory_bandwidth",
                ..
            })
        ));
    }
}
