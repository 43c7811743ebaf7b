//! How many KV blocks fit on a worker, from its GPUs' memory, sized as vLLM sizes its cache:
//! the memory it may use (`gpu_memory_utilization` of each GPU) less the weights and the
//! activations of the largest pass, divided by what one block takes.
//!
//! Per GPU, with `tp` GPUs sharing the model:
//!
//! * **Allowed:** `memory_bytes · gpu_memory_utilization`.
//! * **Weights:** [`ModelSpec::weight_bytes`] / `tp`.
//! * **Activation reserve** (an estimate; vLLM measures it in a profiling pass): a fixed
//!   [`NON_TORCH_RESERVE_BYTES`] (CUDA context, NCCL buffers, CUDA graphs), the pass of
//!   `max_num_batched_tokens` tokens' widest activations, `tokens · (4 · hidden + 2 ·
//!   intermediate · experts_per_token / tp) · dtype_bytes`, and the sampler's float32 logits,
//!   `max_num_seqs · vocab · 4`.
//! * **One block:** `block_size · 2 · layers · ⌈kv_heads / tp⌉ · head_dim · max(dtype_bytes, 2)` (KV
//!   heads are split over the GPUs, replicated when there are fewer of them than GPUs; the cache is
//!   16-bit when only the weights are 8-bit, as vLLM's default `kv_cache_dtype = "auto"` keeps it).

use crate::spec::{GpuSpec, ModelSpec, SpecError};

/// Bytes of every GPU set aside whatever the model: CUDA context, NCCL buffers, CUDA graphs
/// (1 GiB).
pub const NON_TORCH_RESERVE_BYTES: f64 = 1_073_741_824.0;

/// A model served on `tensor_parallel` GPUs of one kind, using `gpu_memory_utilization` of
/// each one's memory.
#[derive(Clone, Copy, Debug)]
pub struct Deployment<'a> {
    /// The model.
    pub model: &'a ModelSpec,
    /// The GPU.
    pub gpu: &'a GpuSpec,
    /// GPUs the model is split over.
    pub tensor_parallel: u32,
    /// Fraction of each GPU's memory the engine may use (vLLM's default: 0.9).
    pub gpu_memory_utilization: f64,
}

/// The engine's pass limits the activation reserve depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PassLimits {
    /// Tokens per KV block.
    pub block_size: u32,
    /// Tokens computed per pass at most.
    pub max_num_batched_tokens: u32,
    /// Requests running at once at most.
    pub max_num_seqs: u32,
}

impl Deployment<'_> {
    /// Bytes of one KV block on one GPU.
    pub fn kv_block_bytes(&self, block_size: u32) -> f64 {
        let m = self.model;
        let heads = m.num_kv_heads.div_ceil(self.tensor_parallel.max(1));
        f64::from(block_size)
            * 2.0
            * f64::from(m.num_layers)
            * f64::from(heads)
            * f64::from(m.head_dim)
            * f64::from(m.dtype_bytes.max(2))
    }

    /// Bytes of one GPU the engine may use.
    pub fn allowed_bytes(&self) -> f64 {
        self.gpu.memory_bytes * self.gpu_memory_utilization
    }

    /// Bytes of the weights on one GPU.
    pub fn weight_bytes(&self) -> f64 {
        self.model.weight_bytes() / f64::from(self.tensor_parallel.max(1))
    }

    /// Bytes of one GPU kept for activations (see the module docs).
    pub fn activation_reserve_bytes(&self, limits: PassLimits) -> f64 {
        let m = self.model;
        let (_, per_token) = m.experts();
        let tp = f64::from(self.tensor_parallel.max(1));
        let width =
            4.0 * f64::from(m.hidden_size) + 2.0 * f64::from(m.intermediate_size) * f64::from(per_token) / tp;
        NON_TORCH_RESERVE_BYTES
            + f64::from(limits.max_num_batched_tokens) * width * f64::from(m.dtype_bytes)
            + f64::from(limits.max_num_seqs) * f64::from(m.vocab_size) * 4.0
    }

    /// KV blocks that fit, or [`SpecError::DoesNotFit`] when weights and activations leave no
    /// room for one.
    pub fn kv_blocks(&self, limits: PassLimits) -> Result<u32, SpecError> {
        let allowed = self.allowed_bytes();
        let taken = self.weight_bytes() + self.activation_reserve_bytes(limits);
        let blocks = ((allowed - taken) / self.kv_block_bytes(limits.block_size)).floor();
        if blocks.is_nan() || blocks < 1.0 {
            return Err(SpecError::DoesNotFit {
                model: self.model.name.clone(),
                gpu: self.gpu.name.clone(),
                tensor_parallel: self.tensor_parallel,
                taken_bytes: taken as u64,
                allowed_bytes: allowed as u64,
            });
        }
        Ok(blocks.min(f64::from(u32::MAX)) as u32)
    }
}
