//! How long a forward pass takes: one trait, three models, chosen by configuration.
//!
//! A model sees the pass's composition ([`ForwardPass`]) and returns seconds. The engine divides
//! that by the configured speedup factor, rounds it to a [`Duration`] of whole nanoseconds once
//! ([`duration_from_secs_f64`](kvroute_core::time::duration_from_secs_f64)) and floors it at [`MIN_STEP`], so simulated time always moves
//! forward.
//!
//! * [`Polynomial`]: Dynamo's mocker default, a fit of unknown provenance (uncalibrated), kept so
//!   results can be compared with Dynamo's replay.
//! * [`Roofline`]: FLOPs and bytes from a model and a GPU description.
//! * [`Table`]: interpolation over a measured profile.
//! * [`Calibrated`]: fixed costs plus fitted multiples of the roofline's work, fitted on real
//!   vLLM runs (`kvroute calibrate`); [`CALIBRATED_MODEL_FILE`] is the shipped fit.

mod calibrated;
mod polynomial;
mod roofline;
mod table;

use std::fmt;
use std::time::Duration;

use kvroute_core::time::TimeScale;
use serde::Deserialize;

pub use calibrated::{Basis, Calibrated, CalibratedCoefficients, CalibratedConfig, TERM_NAMES, TERMS};
pub use polynomial::Polynomial;
pub use roofline::{PassShape, PassWork, Roofline, RooflineConfig, RooflineEfficiency};

/// The calibrated model fitted on the calibration set of real vLLM runs (`kvroute calibrate`
/// over `../shared/data/real-vllm`), compiled in: the model `kvroute validate` uses when no
/// other is named.
pub const CALIBRATED_MODEL_FILE: &str = include_str!("../../data/calibrated/vllm.toml");
pub use table::{DecodeTable, PrefillTable, Table, TableProfile};

use crate::metrics::ForwardPass;
use crate::noise::StepJitter;
use crate::spec::SpecError;

/// The shortest step: a pass takes at least this long, whatever the model says, so that time
/// always advances between passes.
pub const MIN_STEP: Duration = Duration::from_micros(1);
/// [`MIN_STEP`] in nanoseconds.
const MIN_STEP_NANOS: u64 = MIN_STEP.as_nanos() as u64;

/// A model of forward-pass duration.
///
/// Implementations must be pure (the same pass gives the same time) and should be monotone: a
/// pass with more work (tokens, sequences, context) never takes less time.
pub trait TimingModel: fmt::Debug + Send + Sync {
    /// Seconds one forward pass of `pass` takes on the modeled hardware, before the speedup
    /// factor. Called only for passes that compute at least one token.
    fn pass_secs(&self, pass: &ForwardPass) -> f64;

    /// Whether [`TimingModel::pass_secs`] reads `decode_context_tokens`. When it does not, a
    /// run of pure-decode passes over the same requests and blocks takes the same time each,
    /// which lets an engine compute it once. The default is the safe answer.
    fn reads_decode_context(&self) -> bool {
        true
    }
}

/// Which timing model an engine uses, with its parameters.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum TimingConfig {
    /// Dynamo's default polynomial (see [`Polynomial`]).
    Polynomial,
    /// The roofline model (see [`Roofline`]).
    Roofline(RooflineConfig),
    /// Interpolation over a measured profile (see [`Table`]).
    Table(TableProfile),
    /// Fitted coefficients over the roofline's work (see [`Calibrated`]).
    Calibrated(CalibratedConfig),
}

impl TimingConfig {
    /// Parses and validates a timing model written in TOML: `kind = "polynomial" | "roofline" |
    /// "table"` and that model's keys, as under an engine configuration's `[timing]`.
    pub fn from_toml_str(text: &str) -> Result<Self, SpecError> {
        let config: Self = crate::spec::parse_toml(text, "timing model")?;
        config.validate()?;
        Ok(config)
    }

    /// Checks the model's parameters.
    pub fn validate(&self) -> Result<(), SpecError> {
        match self {
            TimingConfig::Polynomial => Ok(()),
            TimingConfig::Roofline(config) => config.validate(),
            TimingConfig::Table(profile) => profile.validate(),
            TimingConfig::Calibrated(config) => config.validate(),
        }
    }

    /// The model this configuration describes.
    pub fn build(&self) -> Result<Box<dyn TimingModel>, SpecError> {
        Ok(match self {
            TimingConfig::Polynomial => Box::new(Polynomial),
            TimingConfig::Roofline(config) => Box::new(Roofline::new(config.clone())?),
            TimingConfig::Table(profile) => Box::new(Table::new(profile.clone())?),
            TimingConfig::Calibrated(config) => Box::new(Calibrated::new(config.clone())?),
        })
    }
}

/// A timing model with the engine's speedup factor and step-time jitter applied.
#[derive(Debug)]
pub(crate) struct StepTimer {
    model: Box<dyn TimingModel>,
    scale: TimeScale,
    jitter: Option<StepJitter>,
}

impl StepTimer {
    /// Wraps `model`; `speedup` and `jitter` were validated by the engine's configuration.
    pub(crate) fn new(model: Box<dyn TimingModel>, scale: TimeScale, jitter: Option<StepJitter>) -> Self {
        Self { model, scale, jitter }
    }

    /// Whether a run of pure-decode passes over the same requests and blocks takes the same
    /// time each: the model does not read the decode context (see
    /// [`TimingModel::reads_decode_context`]) and no jitter varies the passes.
    pub(crate) fn constant_decode_passes(&self) -> bool {
        !self.model.reads_decode_context() && self.jitter.is_none()
    }

    /// The duration of the engine's pass number `index` (from 0), jittered, sped up, rounded
    /// and floored at [`MIN_STEP`].
    pub(crate) fn duration(&self, pass: &ForwardPass, index: u64) -> Duration {
        self.jittered(self.model.pass_secs(pass), index)
    }

    /// Whether the model reads the decode context ([`TimingModel::reads_decode_context`]):
    /// when not, a run of pure-decode passes has one modeled time, jittered pass by pass.
    pub(crate) fn reads_decode_context(&self) -> bool {
        self.model.reads_decode_context()
    }

    /// The model's seconds for `pass`, before jitter and speedup.
    pub(crate) fn pass_secs(&self, pass: &ForwardPass) -> f64 {
        self.model.pass_secs(pass)
    }

    /// The duration of pass number `index` whose model time is `secs`: jittered, sped up,
    /// rounded and floored at [`MIN_STEP`].
    pub(crate) fn jittered(&self, secs: f64, index: u64) -> Duration {
        Duration::from_nanos(self.jittered_nanos(secs, index))
    }

    /// [`StepTimer::jittered`] in nanoseconds (a run of skipped passes adds them up).
    pub(crate) fn jittered_nanos(&self, secs: f64, index: u64) -> u64 {
        let secs = match &self.jitter {
            None => secs,
            Some(j) => secs * j.dispersion.draw_at(j.seed, index),
        };
        self.scale.modeled_nanos(secs).max(MIN_STEP_NANOS)
    }
}

/// Milliseconds to seconds.
fn ms(x: f64) -> f64 {
    x / 1e3
}
