//! Support the workspace's tests share, as a dev-dependency only.
//!
//! - [`PATIENCE`]: how long any test waits for something that should happen. It is reached only
//!   when a test is failing, so it is generous; no test's outcome depends on it being short.
//! - [`eventually`] and [`eventually_blocking`]: wait for a condition, or fail naming it.
//! - [`External`] and [`require`]: a test that needs a program from outside the workspace
//!   (`nats-server`, Python with pyzmq) skips, saying so, where it is absent; in CI (`CI` set to
//!   `true` or `1`) it fails instead, naming the install step, so a missing install can never
//!   pass as a green run.

use std::fmt::Display;
use std::time::{Duration, Instant};

/// How long a test waits for what it expects before failing.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// How often [`eventually`] looks again.
const POLL: Duration = Duration::from_millis(10);

/// Waits until `done()` holds, looking every few milliseconds; panics naming `what` after
/// [`PATIENCE`].
pub async fn eventually(what: impl Display, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {PATIENCE:?}: {what}"
        );
        tokio::time::sleep(POLL).await;
    }
}

/// [`eventually`], describing what failed (say, with the state it ended in) only when it does.
pub async fn eventually_or(describe: impl Fn() -> String, mut done: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while !done() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not within {PATIENCE:?}: {}",
            describe()
        );
        tokio::time::sleep(POLL).await;
    }
}

/// [`eventually`] for a test without a runtime.
pub fn eventually_blocking(what: impl Display, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !done() {
        assert!(Instant::now() < deadline, "not within {PATIENCE:?}: {what}");
        std::thread::sleep(POLL);
    }
}

/// A program from outside the workspace that some tests need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum External {
    /// `nats-server`, for router replicas.
    NatsServer,
    /// Python 3 with the `pyzmq` package, a libzmq peer.
    Pyzmq,
}

impl External {
    /// The step that installs it, as `.ci/run` takes it.
    pub fn install_step(self) -> &'static str {
        match self {
            External::NatsServer => "apt-get install nats-server",
            External::Pyzmq => "python3 -m pip install pyzmq",
        }
    }

    fn name(self) -> &'static str {
        match self {
            External::NatsServer => "nats-server",
            External::Pyzmq => "python3 with pyzmq",
        }
    }
}

/// Whether the environment says this is a CI run (`CI=true` or `CI=1`, as CI services set it).
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v.eq_ignore_ascii_case("true") || v == "1")
}

/// Whether a test may go on: `true` when `dependency` was `found`. When it was not, outside CI
/// this prints that the test skipped and returns `false`; in CI it panics naming the missing
/// install step.
#[must_use = "a test must return when its dependency is missing"]
pub fn require(dependency: External, found: bool) -> bool {
    require_in(Run::from_env(), dependency, found)
}

/// Where a test runs, as far as a missing dependency goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Run {
    /// A developer's machine: a test without its dependency skips.
    Local,
    /// CI: a test without its dependency fails.
    Ci,
}

impl Run {
    fn from_env() -> Self {
        if in_ci() { Run::Ci } else { Run::Local }
    }
}

fn require_in(run: Run, dependency: External, found: bool) -> bool {
    if found {
        return true;
    }
    let name = dependency.name();
    let install = dependency.install_step();
    assert!(
        run == Run::Local,
        "{name} is required in CI but was not found: the CI script must run `{install}`"
    );
    println!("skipped: {name} not found (install it with `{install}`)");
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_present_dependency_lets_the_test_go_on_anywhere() {
        for run in [Run::Local, Run::Ci] {
            assert!(require_in(run, External::NatsServer, true));
        }
    }

    #[test]
    fn a_missing_dependency_skips_locally() {
        assert!(!require_in(Run::Local, External::Pyzmq, false));
    }

    #[test]
    #[should_panic(expected = "the CI script must run `apt-get install nats-server`")]
    fn a_missing_dependency_fails_in_ci_naming_the_install_step() {
        let _ = require_in(Run::Ci, External::NatsServer, false);
    }

    #[test]
    fn eventually_returns_once_the_condition_holds() {
        let mut calls = 0;
        eventually_blocking("the third look", || {
            calls += 1;
            calls == 3
        });
        assert_eq!(calls, 3);
    }
}
