//! The prefill-to-decode KV link model, shared by the simulator's disaggregated topology and the
//! mock workers' imports: both price a KV import with [`KvTransfer::duration`].

use std::time::Duration;

use crate::spec::{ModelSpec, SpecError};

/// The prefill-to-decode KV link: a transfer of the prompt blocks the decode worker lacks takes
/// `base_latency + blocks × block_size × bytes_per_token / bandwidth` (BLIS's model; Dynamo
/// mocker's bandwidth default). Transfers do not share the link.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvTransfer {
    /// Link bandwidth, bytes per second. Default 64 GB/s (Dynamo mocker's
    /// `--kv-transfer-bandwidth`).
    pub bandwidth_bytes_per_s: f64,
    /// KV bytes per token over all layers. Default 131,072: Llama-3.1-8B in fp16
    /// (2 × 32 layers × 8 KV heads × 128 dims × 2 bytes).
    pub bytes_per_token: u64,
    /// Fixed cost of a transfer. Default 0.05 ms (BLIS's `--pd-transfer-base-latency`).
    pub base_latency: Duration,
}

impl Default for KvTransfer {
    fn default() -> Self {
        Self {
            bandwidth_bytes_per_s: 64e9,
            bytes_per_token: 131_072,
            base_latency: Duration::from_micros(50),
        }
    }
}

impl KvTransfer {
    /// KV bytes per token of the built-in model description `name` (see
    /// [`ModelSpec::builtin`]).
    pub fn model_bytes_per_token(name: &str) -> Result<u64, SpecError> {
        Ok(ModelSpec::builtin(name)?.kv_bytes_per_token())
    }

    /// Bytes of `blocks` blocks of `block_size` tokens.
    pub fn bytes(&self, blocks: u32, block_size: u32) -> u64 {
        u64::from(blocks) * u64::from(block_size) * self.bytes_per_token
    }

    /// How long moving `blocks` blocks of `block_size` tokens takes.
    pub fn duration(&self, blocks: u32, block_size: u32) -> Duration {
        let secs = self.bytes(blocks, block_size) as f64 / self.bandwidth_bytes_per_s;
        self.base_latency + Duration::from_nanos((secs * 1e9).round() as u64)
    }
}
