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
];

/// The GPU descriptions compiled into the crate: (name, TOML text).
const BUILTIN_GPUS: &[(&str, &str)] = &[
    ("h100-sxm", include_str!("../data/gpus/h100-sxm.toml")),
    ("h200-sxm", include_str!("../data/gpus/h200-sxm.toml")),
    ("a100-sxm-80gb", include_str!("../data/gpus/a100-sxm-80gb.toml")),
    ("l40s", include_str!("../data/gpus/l40s.toml")),
];

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

/// The built-in text named `name` in `table`, or the error listing the known names.
fn builtin_text(
    table: &[(&str, &'static str)],
    what: &'static str,
    name: &str,
) -> Result<&'static str, SpecError> {
    match table.iter().find(|(n, _)| *n == name) {
        Some((_, text)) => Ok(text),
        None => Err(SpecError::UnknownBuiltin {
            what,
            name: name.to_owned(),
            known: table.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", "),
        }),
    }
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

    /// The built-in description named `name` (see [`ModelSpec::builtin_names`]).
    pub fn builtin(name: &str) -> Result<Self, SpecError> {
        Self::from_toml_str(builtin_text(BUILTIN_MODELS, "model", name)?)
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

    /// The built-in description named `name` (see [`GpuSpec::builtin_names`]).
    pub fn builtin(name: &str) -> Result<Self, SpecError> {
        Self::from_toml_str(builtin_text(BUILTIN_GPUS, "gpu", name)?)
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
