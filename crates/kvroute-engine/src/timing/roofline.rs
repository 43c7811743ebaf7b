//! The roofline timing model: FLOPs and bytes of a pass, from a model and a GPU description.
//!
//! Each phase of a pass takes `max(FLOPs / achieved FLOP/s, bytes / achieved bandwidth)` plus
//! its tensor-parallel all-reduces; a pass takes a fixed overhead plus its prefill phase plus its
//! decode phase. Everything is per GPU: weights, FLOPs and KV heads are split over the
//! `tensor_parallel` GPUs (KV heads are replicated when there are fewer of them than GPUs).
//!
//! What is counted:
//!
//! * **Linear layers.** `2 · active weights` FLOPs per token: attention projections, the
//!   experts a token is routed to (the whole feed-forward block for dense models) and the MoE
//!   router.
//! * **Attention.** `4 · heads · head_dim` FLOPs per layer for every (query, key) pair: `QKᵀ` and
//!   `AV`. A prefill chunk of `n` tokens after `c` tokens of context attends
//!   `n·c + n(n+1)/2` pairs; a decode token after `c` tokens attends `c + 1`.
//! * **Output projection.** One row of logits per sequence in the pass (vLLM computes logits
//!   only at each sequence's last position).
//! * **Weights** are read once per pass. They are charged to the prefill phase when the pass
//!   has one, else to the decode phase. A MoE layer reads only the experts that some token of the
//!   pass uses: `E·(1 − (1 − k/E)^N)` of them in expectation for `N` tokens routed uniformly.
//! * **KV cache.** Prefill writes its tokens' KV and reads its context once; decode reads every
//!   token of its context.
//! * **All-reduce.** Two per layer of `hidden · dtype` bytes per token, ring algorithm:
//!   `2(tp − 1)/tp` of the bytes cross the interconnect.
//!
//! Left out: activations' memory traffic, norms, biases, kernel-launch gaps inside a pass (they
//! are in the per-step overhead), and overlap of communication with compute.

use serde::Deserialize;

use super::TimingModel;
use crate::metrics::ForwardPass;
use crate::spec::{GpuSpec, ModelSpec, SpecError, check};

/// What the roofline model needs: the model, the GPU, how many GPUs share the model, and how
/// close to peak the kernels run.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RooflineConfig {
    /// The model's shape.
    pub model: ModelSpec,
    /// The GPU's datasheet figures.
    pub gpu: GpuSpec,
    /// Tensor-parallel degree: GPUs the weights and heads are split over.
    pub tensor_parallel: u32,
    /// Achieved fractions of peak, and the per-step overhead.
    pub efficiency: RooflineEfficiency,
}

/// How close to the datasheet the kernels get, and what a step costs besides its kernels.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RooflineEfficiency {
    /// Fraction of peak FLOP/s achieved by prefill (model FLOPs utilisation).
    pub prefill_compute: f64,
    /// Fraction of peak FLOP/s achieved by decode.
    pub decode_compute: f64,
    /// Fraction of peak memory bandwidth achieved.
    pub memory: f64,
    /// Fraction of peak interconnect bandwidth achieved by all-reduces.
    pub interconnect: f64,
    /// Seconds every step costs on top of its kernels (scheduling, launches, sampling).
    pub step_overhead_secs: f64,
}

impl RooflineEfficiency {
    /// Plausible figures for vLLM on a data-center GPU, not a calibration: MFU 0.45 for prefill
    /// and 0.30 for decode (the values BLIS's roofline uses for H100), 80% of memory bandwidth,
    /// 70% of interconnect bandwidth, 0.5 ms per step.
    pub const TYPICAL: Self = Self {
        prefill_compute: 0.45,
        decode_compute: 0.30,
        memory: 0.80,
        interconnect: 0.70,
        step_overhead_secs: 0.5e-3,
    };

    /// Checks that every fraction is in `(0, 1]` and the overhead is finite and not negative.
    pub fn validate(&self) -> Result<(), SpecError> {
        const W: &str = "roofline efficiency";
        let fraction = |x: f64| x.is_finite() && x > 0.0 && x <= 1.0;
        const FRACTION: &str = "must be above 0 and at most 1";
        check(fraction(self.prefill_compute), W, "prefill_compute", FRACTION)?;
        check(fraction(self.decode_compute), W, "decode_compute", FRACTION)?;
        check(fraction(self.memory), W, "memory", FRACTION)?;
        check(fraction(self.interconnect), W, "interconnect", FRACTION)?;
        let overhead = self.step_overhead_secs;
        check(
            overhead.is_finite() && overhead >= 0.0,
            W,
            "step_overhead_secs",
            "must be finite and not negative",
        )
    }
}

impl RooflineConfig {
    /// Checks the model, the GPU, the efficiencies and the tensor-parallel degree.
    pub fn validate(&self) -> Result<(), SpecError> {
        self.model.validate()?;
        self.gpu.validate()?;
        self.efficiency.validate()?;
        check(
            self.tensor_parallel > 0,
            "roofline",
            "tensor_parallel",
            "must be above zero",
        )
    }
}

/// The roofline model, with its per-token constants worked out once.
#[derive(Clone, Debug, PartialEq)]
pub struct Roofline {
    config: RooflineConfig,
    /// Linear-layer FLOPs per token, per GPU.
    linear_flops_per_token: f64,
    /// Attention FLOPs per (query, key) pair over all layers, per GPU.
    attention_flops_per_pair: f64,
    /// Output-projection FLOPs per sequence, per GPU.
    lm_head_flops_per_seq: f64,
    /// Bytes of the weights every pass reads (all but the experts), per GPU.
    shared_weight_bytes: f64,
    /// Bytes of one expert over all layers, per GPU.
    expert_weight_bytes: f64,
    /// KV-cache bytes per token over all layers, per GPU.
    kv_bytes_per_token: f64,
    /// All-reduce seconds per token.
    allreduce_secs_per_token: f64,
}

impl Roofline {
    /// The model `config` describes.
    pub fn new(config: RooflineConfig) -> Result<Self, SpecError> {
        config.validate()?;
        let m = &config.model;
        let tp = f64::from(config.tensor_parallel);
        let layers = f64::from(m.num_layers);
        let dtype = f64::from(m.dtype_bytes);
        let (experts, per_token) = m.experts();
        let router = if m.moe.is_some() {
            f64::from(m.hidden_size) * f64::from(experts)
        } else {
            0.0
        };
        let active =
            layers * (m.attention_params_per_layer() + router + f64::from(per_token) * m.expert_params());
        let kv_heads_per_gpu = m.num_kv_heads.div_ceil(config.tensor_parallel);
        let kv_bytes_per_token = layers * 2.0 * f64::from(kv_heads_per_gpu) * f64::from(m.head_dim) * dtype;
        let allreduce_bytes_per_token = 2.0 * layers * f64::from(m.hidden_size) * dtype;
        let ring = 2.0 * (tp - 1.0) / tp;
        let interconnect = config.gpu.interconnect_bandwidth * config.efficiency.interconnect;
        Ok(Self {
            linear_flops_per_token: 2.0 * active / tp,
            attention_flops_per_pair: 4.0 * f64::from(m.num_attention_heads) * f64::from(m.head_dim) * layers
                / tp,
            lm_head_flops_per_seq: 2.0 * m.lm_head_params() / tp,
            shared_weight_bytes: dtype
                * (layers * (m.attention_params_per_layer() + router) + m.lm_head_params())
                / tp,
            expert_weight_bytes: dtype * layers * m.expert_params() / tp,
            kv_bytes_per_token,
            allreduce_secs_per_token: allreduce_bytes_per_token * ring / interconnect,
            config,
        })
    }

    /// The configuration this model was built from.
    pub fn config(&self) -> &RooflineConfig {
        &self.config
    }

    /// Bytes of weights a pass of `tokens` tokens reads, per GPU.
    pub fn weight_bytes(&self, tokens: u64) -> f64 {
        self.weight_bytes_f(tokens as f64)
    }

    /// The work of a pass of shape `pass`: FLOPs, bytes and all-reduce time, per GPU. The
    /// roofline turns it into seconds with its efficiencies; the calibrated model
    /// ([`super::Calibrated`]) fits multiples of it.
    pub fn work(&self, pass: &PassShape) -> PassWork {
        let prefill_flops = if pass.prefill_tokens > 0.0 {
            pass.prefill_tokens * self.linear_flops_per_token
                + pass.prefill_attention_pairs * self.attention_flops_per_pair
                + pass.prefill_seqs * self.lm_head_flops_per_seq
        } else {
            0.0
        };
        let decode_flops = pass.decode_seqs * (self.linear_flops_per_token + self.lm_head_flops_per_seq)
            + pass.decode_context_tokens * self.attention_flops_per_pair;
        let prefill_kv_tokens = if pass.prefill_tokens > 0.0 {
            pass.prefill_tokens + pass.prefill_context_tokens
        } else {
            0.0
        };
        PassWork {
            prefill_flops,
            decode_flops,
            weight_bytes: self.weight_bytes_f(pass.tokens()),
            prefill_kv_bytes: prefill_kv_tokens * self.kv_bytes_per_token,
            decode_kv_bytes: pass.decode_context_tokens * self.kv_bytes_per_token,
            allreduce_secs: pass.tokens() * self.allreduce_secs_per_token,
        }
    }

    /// [`Roofline::weight_bytes`] for a (possibly fractional, averaged) token count.
    fn weight_bytes_f(&self, tokens: f64) -> f64 {
        let (experts, per_token) = self.config.model.experts();
        let e = f64::from(experts);
        let untouched_by_one = 1.0 - f64::from(per_token) / e;
        let touched = e * (1.0 - untouched_by_one.powf(tokens));
        self.shared_weight_bytes + touched * self.expert_weight_bytes
    }

    /// Seconds of the prefill phase of `pass`, weights included; 0 without prefill.
    pub fn prefill_secs(&self, pass: &ForwardPass) -> f64 {
        if pass.prefill_tokens == 0 {
            return 0.0;
        }
        let w = self.work(&PassShape::from(pass));
        let bytes = w.weight_bytes + w.prefill_kv_bytes;
        let tokens = pass.prefill_tokens as f64;
        self.phase_secs(
            w.prefill_flops,
            self.config.efficiency.prefill_compute,
            bytes,
            tokens,
        )
    }

    /// Seconds of the decode phase of `pass`; its weights are counted here only when the pass
    /// has no prefill. 0 without decode.
    pub fn decode_secs(&self, pass: &ForwardPass) -> f64 {
        if pass.decode_seqs == 0 {
            return 0.0;
        }
        let w = self.work(&PassShape::from(pass));
        let weights = if pass.prefill_tokens == 0 {
            w.weight_bytes
        } else {
            0.0
        };
        let bytes = weights + w.decode_kv_bytes;
        let seqs = f64::from(pass.decode_seqs);
        self.phase_secs(w.decode_flops, self.config.efficiency.decode_compute, bytes, seqs)
    }

    /// `max(compute time, memory time)` plus the all-reduces of `tokens` tokens.
    fn phase_secs(&self, flops: f64, compute_efficiency: f64, bytes: f64, tokens: f64) -> f64 {
        let gpu = &self.config.gpu;
        let compute = flops / (gpu.peak_dense_flops * compute_efficiency);
        let memory = bytes / (gpu.memory_bandwidth * self.config.efficiency.memory);
        compute.max(memory) + tokens * self.allreduce_secs_per_token
    }
}

/// A pass's composition in real numbers: a [`ForwardPass`], or the average pass of a run
/// (what the calibration fits run summaries with).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PassShape {
    /// Requests with a prefill chunk.
    pub prefill_seqs: f64,
    /// Tokens computed by prefill chunks.
    pub prefill_tokens: f64,
    /// Tokens of context before the prefill chunks, summed.
    pub prefill_context_tokens: f64,
    /// (query, key) pairs attended by prefill tokens.
    pub prefill_attention_pairs: f64,
    /// Requests decoding one token each.
    pub decode_seqs: f64,
    /// KV tokens read by decoding requests.
    pub decode_context_tokens: f64,
}

impl PassShape {
    /// Tokens computed, prefill and decode.
    pub fn tokens(&self) -> f64 {
        self.prefill_tokens + self.decode_seqs
    }

    /// Requests in the pass.
    pub fn seqs(&self) -> f64 {
        self.prefill_seqs + self.decode_seqs
    }
}

impl From<&ForwardPass> for PassShape {
    fn from(p: &ForwardPass) -> Self {
        Self {
            prefill_seqs: f64::from(p.prefill_seqs),
            prefill_tokens: p.prefill_tokens as f64,
            prefill_context_tokens: p.prefill_context_tokens as f64,
            prefill_attention_pairs: p.prefill_attention_pairs as f64,
            decode_seqs: f64::from(p.decode_seqs),
            decode_context_tokens: p.decode_context_tokens as f64,
        }
    }
}

/// The work of one pass, per GPU (see [`Roofline::work`]).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PassWork {
    /// FLOPs of the prefill chunks (linear layers, attention, logits).
    pub prefill_flops: f64,
    /// FLOPs of the decoding requests.
    pub decode_flops: f64,
    /// Bytes of weights read (MoE: the experts some token uses, in expectation).
    pub weight_bytes: f64,
    /// KV bytes prefill writes and reads.
    pub prefill_kv_bytes: f64,
    /// KV bytes decode reads.
    pub decode_kv_bytes: f64,
    /// Seconds of tensor-parallel all-reduces at the configured interconnect efficiency.
    pub allreduce_secs: f64,
}

impl TimingModel for Roofline {
    fn pass_secs(&self, pass: &ForwardPass) -> f64 {
        self.config.efficiency.step_overhead_secs + self.prefill_secs(pass) + self.decode_secs(pass)
    }
}
