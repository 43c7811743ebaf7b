//! The calibrated timing model: a step takes fixed costs plus fitted multiples of roofline work.
//!
//! A step (one engine cycle: scheduling, the forward pass, sampling, output handling) takes
//!
//! ```text
//! step_secs + layer_secs·L + tp_sync_secs·2L·[tp > 1] + seq_secs·S + token_secs·T
//!   + weights·W/BW + kv·KV/BW + prefill_compute·Fp/F + decode_compute·Fd/F + allreduce·AR
//! ```
//!
//! with `L` layers, `S` sequences and `T` tokens in the pass, and the roofline's work of the pass
//! per GPU ([`Roofline::work`]): `W` weight bytes read, `KV` KV-cache bytes moved, `Fp` and `Fd`
//! prefill and decode FLOPs, `AR` all-reduce seconds at the interconnect's peak; `BW` and `F` are
//! the GPU's peak memory bandwidth and FLOP/s. The coefficients are the same for every model, GPU
//! and tensor-parallel degree, so a model fitted on some configurations predicts others: the
//! physics is in the basis, the fit only says how far from peak each term runs and what the
//! fixed costs are. Every term is a non-negative multiple of work that grows with the pass, so
//! the model is monotone. `request_overhead_secs` and `request_overhead_steps` are not step
//! costs: they are what a client sees on top of the engine (HTTP, tokenization, the output
//! pipeline's lag of a few steps), added to a request's time to first token and end-to-end
//! latency by whoever reports them (`kvroute validate`).
//!
//! The coefficients alone are a model file (`kind = "calibrated"`, the fitted numbers); the
//! model, GPU and tensor-parallel degree come with it when an engine runs it.

use serde::{Deserialize, Serialize};

use super::roofline::{PassShape, Roofline, RooflineConfig, RooflineEfficiency};
use super::{TimingConfig, TimingModel};
use crate::metrics::ForwardPass;
use crate::spec::{GpuSpec, ModelSpec, SpecError, check};

/// Terms of the step-time basis, in [`CalibratedCoefficients::as_array`] order.
pub const TERMS: usize = 10;

/// The terms' names, in order (the model file's keys).
pub const TERM_NAMES: [&str; TERMS] = [
    "step_secs",
    "layer_secs",
    "tp_sync_secs",
    "seq_secs",
    "token_secs",
    "weights",
    "kv",
    "prefill_compute",
    "decode_compute",
    "allreduce",
];

/// The fitted coefficients: the same for every model, GPU and tensor-parallel degree.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CalibratedCoefficients {
    /// Seconds every step costs.
    pub step_secs: f64,
    /// Seconds per transformer layer per step (kernel launches).
    pub layer_secs: f64,
    /// Seconds per all-reduce call (two a layer) when the model is split over GPUs.
    pub tp_sync_secs: f64,
    /// Seconds per sequence in the pass (scheduling, sampling, output handling).
    pub seq_secs: f64,
    /// Seconds per token in the pass.
    pub token_secs: f64,
    /// Multiple of the weights' read time at peak bandwidth.
    pub weights: f64,
    /// Multiple of the KV cache's read and write time at peak bandwidth.
    pub kv: f64,
    /// Multiple of the prefill FLOPs' time at peak.
    pub prefill_compute: f64,
    /// Multiple of the decode FLOPs' time at peak.
    pub decode_compute: f64,
    /// Multiple of the all-reduces' time at peak interconnect bandwidth.
    pub allreduce: f64,
    /// Seconds a client sees on top of the engine, per request, in its time to first token and
    /// its end-to-end latency; not a step cost.
    #[serde(default)]
    pub request_overhead_secs: f64,
    /// Steps a client sees on top of the engine, per request, in its time to first token and
    /// its end-to-end latency, each step as long as the request's own mean inter-token time:
    /// tokens reach the client through a pipeline (engine core, output processing, HTTP
    /// stream) that lags the engine by about this many steps. Not a step cost.
    #[serde(default)]
    pub request_overhead_steps: f64,
}

impl CalibratedCoefficients {
    /// The step-time coefficients in [`TERM_NAMES`] order.
    pub fn as_array(&self) -> [f64; TERMS] {
        [
            self.step_secs,
            self.layer_secs,
            self.tp_sync_secs,
            self.seq_secs,
            self.token_secs,
            self.weights,
            self.kv,
            self.prefill_compute,
            self.decode_compute,
            self.allreduce,
        ]
    }

    /// Coefficients from an array in [`TERM_NAMES`] order and the request overhead.
    pub fn from_array(c: [f64; TERMS], request_overhead_secs: f64) -> Self {
        Self::with_overheads(c, request_overhead_secs, 0.0)
    }

    /// Coefficients from an array in [`TERM_NAMES`] order and both request overheads.
    pub fn with_overheads(c: [f64; TERMS], request_overhead_secs: f64, request_overhead_steps: f64) -> Self {
        Self {
            step_secs: c[0],
            layer_secs: c[1],
            tp_sync_secs: c[2],
            seq_secs: c[3],
            token_secs: c[4],
            weights: c[5],
            kv: c[6],
            prefill_compute: c[7],
            decode_compute: c[8],
            allreduce: c[9],
            request_overhead_secs,
            request_overhead_steps,
        }
    }

    /// Checks that every coefficient is finite and not negative.
    pub fn validate(&self) -> Result<(), SpecError> {
        let ok = self
            .as_array()
            .iter()
            .chain([&self.request_overhead_secs, &self.request_overhead_steps])
            .all(|x| x.is_finite() && *x >= 0.0);
        check(
            ok,
            "calibrated model",
            "coefficients",
            "must be finite and not negative",
        )
    }

    /// The model file: a TOML [`TimingConfig`] of kind `calibrated` holding these coefficients.
    pub fn to_model_file(&self) -> String {
        #[derive(Serialize)]
        struct File<'a> {
            kind: &'static str,
            coefficients: &'a CalibratedCoefficients,
        }
        // Serializing plain numbers cannot fail.
        toml::to_string(&File {
            kind: "calibrated",
            coefficients: self,
        })
        .unwrap_or_default()
    }
}

/// A calibrated model's configuration: the coefficients and, to run, the engine it times.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CalibratedConfig {
    /// The fitted coefficients.
    pub coefficients: CalibratedCoefficients,
    /// The model served; needed to build the timing model.
    #[serde(default)]
    pub model: Option<ModelSpec>,
    /// The GPU; needed to build the timing model.
    #[serde(default)]
    pub gpu: Option<GpuSpec>,
    /// GPUs the model is split over; needed to build the timing model.
    #[serde(default)]
    pub tensor_parallel: Option<u32>,
}

impl CalibratedConfig {
    /// Parses a model file (a TOML [`TimingConfig`] of kind `calibrated`).
    pub fn from_model_file(text: &str) -> Result<Self, SpecError> {
        match crate::spec::parse_toml::<TimingConfig>(text, "calibrated model file")? {
            TimingConfig::Calibrated(config) => {
                config.coefficients.validate()?;
                Ok(config)
            }
            _ => Err(SpecError::Invalid {
                what: "calibrated model file",
                field: "kind",
                reason: "must be \"calibrated\"",
            }),
        }
    }

    /// The same coefficients timing `model` on `tensor_parallel` of `gpu`.
    pub fn for_engine(&self, model: ModelSpec, gpu: GpuSpec, tensor_parallel: u32) -> Self {
        Self {
            coefficients: self.coefficients,
            model: Some(model),
            gpu: Some(gpu),
            tensor_parallel: Some(tensor_parallel),
        }
    }

    /// Checks the coefficients and whatever engine is given.
    pub fn validate(&self) -> Result<(), SpecError> {
        self.coefficients.validate()?;
        if let Some(m) = &self.model {
            m.validate()?;
        }
        if let Some(g) = &self.gpu {
            g.validate()?;
        }
        check(
            self.tensor_parallel != Some(0),
            "calibrated model",
            "tensor_parallel",
            "must be above zero",
        )
    }
}

/// The basis of one engine (model, GPU, tensor-parallel degree): a pass's terms, which the
/// calibrated model weighs with its coefficients and the fit regresses on.
#[derive(Clone, Debug, PartialEq)]
pub struct Basis {
    roofline: Roofline,
    layers: f64,
    tp: u32,
}

impl Basis {
    /// The basis of `model` on `tensor_parallel` of `gpu`.
    pub fn new(model: ModelSpec, gpu: GpuSpec, tensor_parallel: u32) -> Result<Self, SpecError> {
        let layers = f64::from(model.num_layers);
        let peak = RooflineEfficiency {
            prefill_compute: 1.0,
            decode_compute: 1.0,
            memory: 1.0,
            interconnect: 1.0,
            step_overhead_secs: 0.0,
        };
        let roofline = Roofline::new(RooflineConfig {
            model,
            gpu,
            tensor_parallel,
            efficiency: peak,
        })?;
        Ok(Self {
            roofline,
            layers,
            tp: tensor_parallel,
        })
    }

    /// The terms of a pass of shape `pass`, in [`TERM_NAMES`] order.
    pub fn terms(&self, pass: &PassShape) -> [f64; TERMS] {
        let w = self.roofline.work(pass);
        let gpu = &self.roofline.config().gpu;
        let tp_sync = if self.tp > 1 { 2.0 * self.layers } else { 0.0 };
        [
            1.0,
            self.layers,
            tp_sync,
            pass.seqs(),
            pass.tokens(),
            w.weight_bytes / gpu.memory_bandwidth,
            (w.prefill_kv_bytes + w.decode_kv_bytes) / gpu.memory_bandwidth,
            w.prefill_flops / gpu.peak_dense_flops,
            w.decode_flops / gpu.peak_dense_flops,
            w.allreduce_secs,
        ]
    }

    /// Seconds a step of shape `pass` takes with `coefficients`.
    pub fn step_secs(&self, coefficients: &CalibratedCoefficients, pass: &PassShape) -> f64 {
        let c = coefficients.as_array();
        self.terms(pass).iter().zip(c).map(|(x, c)| x * c).sum()
    }
}

/// The calibrated model, built for one engine.
#[derive(Clone, Debug, PartialEq)]
pub struct Calibrated {
    basis: Basis,
    coefficients: CalibratedCoefficients,
}

impl Calibrated {
    /// The model `config` describes; it must name the model, the GPU and the tensor-parallel
    /// degree.
    pub fn new(config: CalibratedConfig) -> Result<Self, SpecError> {
        config.validate()?;
        const W: &str = "calibrated model";
        const NEEDED: &str = "is needed to run the model (a model file holds the coefficients only)";
        let model = config.model.ok_or(SpecError::Invalid {
            what: W,
            field: "model",
            reason: NEEDED,
        })?;
        let gpu = config.gpu.ok_or(SpecError::Invalid {
            what: W,
            field: "gpu",
            reason: NEEDED,
        })?;
        let tp = config.tensor_parallel.ok_or(SpecError::Invalid {
            what: W,
            field: "tensor_parallel",
            reason: NEEDED,
        })?;
        Ok(Self {
            basis: Basis::new(model, gpu, tp)?,
            coefficients: config.coefficients,
        })
    }
}

impl TimingModel for Calibrated {
    fn pass_secs(&self, pass: &ForwardPass) -> f64 {
        self.basis.step_secs(&self.coefficients, &PassShape::from(pass))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn coefficients() -> CalibratedCoefficients {
        CalibratedCoefficients::from_array([2e-3, 1e-5, 5e-6, 5e-5, 1e-7, 1.2, 1.5, 1.8, 2.0, 1.1], 0.01)
    }

    #[test]
    fn a_model_file_round_trips_and_needs_an_engine_to_run() {
        let text = coefficients().to_model_file();
        let config = CalibratedConfig::from_model_file(&text).unwrap();
        assert_eq!(config.coefficients, coefficients());
        let err = Calibrated::new(config.clone()).unwrap_err();
        assert!(err.to_string().contains("model"), "{err}");
        let model = ModelSpec::builtin("llama-3.1-8b").unwrap();
        let gpu = GpuSpec::builtin("h100-sxm").unwrap();
        let timed = Calibrated::new(config.for_engine(model, gpu, 1)).unwrap();
        let mut small = ForwardPass::default();
        small.add_decode(100);
        let mut large = small;
        large.add_decode(1000);
        large.add_prefill(512, 0);
        assert!(timed.pass_secs(&large) > timed.pass_secs(&small));
        let bad = text.replace("weights = 1.2", "weights = -1.0");
        assert!(CalibratedConfig::from_model_file(&bad).is_err());
    }
}
