//! Support the workspace's tests share, as a dev-dependency only.
//!
//! - [`PATIENCE`]: how long any test waits for something that should happen. It is reached only
//!   when a test is failing, so it is generous; no test's outcome depends on it being short.
//! - [`eventually`] and [`eventually_blocking`]: wait for a condition, or fail naming it.
//! - [`External`] and [`require`]: a test that needs a program from outside the workspace
//!   (`nats-server`, Python with pyzmq, `dnsmasq`) skips, saying so, where it is absent; in CI (`CI` set to
//!   `true` or `1`) it fails instead, naming the install step, so a missing install can never
//!   pass as a green run.
//! - [`Pki`]: a CA and the certificates it signed, made at test time, for TLS tests.

use std::fmt::Display;
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
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
    /// `dnsmasq` (Debian's `dnsmasq-base`), a DNS server for worker discovery.
    Dnsmasq,
}

impl External {
    /// The step that installs it, as `.ci/run` takes it.
    pub fn install_step(self) -> &'static str {
        match self {
            External::NatsServer => "apt-get install nats-server",
            External::Pyzmq => "python3 -m pip install pyzmq",
            External::Dnsmasq => "apt-get install dnsmasq-base",
        }
    }

    fn name(self) -> &'static str {
        match self {
            External::NatsServer => "nats-server",
            External::Pyzmq => "python3 with pyzmq",
            External::Dnsmasq => "dnsmasq",
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

/// A CA, and a server and a client certificate it signed (for `localhost` and 127.0.0.1), as PEM
/// files in a directory of their own, removed on drop: `ca.pem`, `server.pem`, `server-key.pem`,
/// `client.pem`, `client-key.pem`. A test may write its own files beside them ([`Pki::write`]).
#[derive(Debug)]
pub struct Pki {
    dir: PathBuf,
}

impl Pki {
    /// Makes the CA and the certificates.
    ///
    /// # Panics
    /// If the directory cannot be written or a certificate cannot be made (a test's setup).
    #[allow(clippy::unwrap_used)]
    pub fn new() -> Self {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, SanType};
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvroute-pki-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name.push(DnType::CommonName, "kvroute test CA");
        let ca_key = KeyPair::generate().unwrap();
        std::fs::write(dir.join("ca.pem"), ca.self_signed(&ca_key).unwrap().pem()).unwrap();
        let issuer = Issuer::new(ca, ca_key);
        for (name, cn) in [("server", "127.0.0.1"), ("client", "kvroute replica")] {
            let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
            params
                .subject_alt_names
                .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
            params.distinguished_name.push(DnType::CommonName, cn);
            let key = KeyPair::generate().unwrap();
            let cert = params.signed_by(&key, &issuer).unwrap();
            std::fs::write(dir.join(format!("{name}.pem")), cert.pem()).unwrap();
            std::fs::write(dir.join(format!("{name}-key.pem")), key.serialize_pem()).unwrap();
        }
        Self { dir }
    }

    /// The file `name` in the directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Writes `contents` to the file `name` in the directory; its path.
    ///
    /// # Panics
    /// If the file cannot be written.
    #[allow(clippy::unwrap_used)]
    pub fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.path(name);
        std::fs::write(&path, contents).unwrap();
        path
    }
}

impl Default for Pki {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether process group `pgid` still has a member that is not a zombie, read from `/proc` (a
/// killed process's orphaned child may wait a while for its new parent to reap it). False where
/// `/proc` cannot be read.
pub fn process_group_alive(pgid: u32) -> bool {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return false;
    };
    entries.flatten().any(|entry| {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            return false;
        };
        // pid (comm) state ppid pgrp ...: comm may hold spaces, so read after its ')'.
        let Some((_, rest)) = stat.rsplit_once(')') else {
            return false;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        fields.len() > 2 && fields[0] != "Z" && fields[2] == pgid.to_string()
    })
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
