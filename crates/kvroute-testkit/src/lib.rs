//! Support the workspace's tests share, as a dev-dependency only.
//!
//! - [`PATIENCE`]: how long any test waits for something that should happen. It is reached only
//!   when a test is failing, so it is generous; no test's outcome depends on it being short.
//! - [`eventually`] and [`eventually_blocking`]: wait for a condition, or fail naming it.
//! - [`External`] and [`require`]: a test that needs a program from outside the workspace
//!   (`nats-server`, Python with pyzmq, `dnsmasq`) skips, saying so, where it is absent; in CI (`CI` set to
//!   `true` or `1`) it fails instead, naming the install step, so a missing install can never
//!   pass as a green run.
//! - [`Scratch`]: a directory of a test's own under the system temp dir, removed on drop.
//! - [`Pki`]: a CA and the certificates it signed, made at test time, for TLS tests.

use std::fmt::Display;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
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

/// A directory of its own for one test's files under the system temp dir, removed with
/// everything in it on drop. Its name is `kvroute-{name}-{pid}-{n}`, `n` counting the scratch
/// directories this process made, so no two tests (nor two runs) share one.
///
/// A test keeps it alive as long as anything uses its files: a helper that makes one returns
/// it, not only its path. A test whose files tell why it failed (a worker's log) may keep them
/// then ([`Scratch::keep_on_failure`]).
#[derive(Debug)]
pub struct Scratch {
    dir: PathBuf,
    keep_on_failure: bool,
}

impl Scratch {
    /// Makes the directory, empty.
    ///
    /// # Panics
    /// If the directory cannot be made (a test's setup).
    pub fn new(name: &str) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "kvroute-{name}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        // A directory of this name is a dead process's, whose pid this one now has.
        let _ = std::fs::remove_dir_all(&dir);
        if let Err(e) = std::fs::create_dir_all(&dir) {
            panic!("cannot make the scratch directory {}: {e}", dir.display());
        }
        Self {
            dir,
            keep_on_failure: false,
        }
    }

    /// The same directory, left in place when it is dropped while the test panics (its path
    /// printed, so that its files can be read); removed as usual when the test passes.
    #[must_use]
    pub fn keep_on_failure(mut self) -> Self {
        self.keep_on_failure = true;
        self
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// The path of `name` in the directory.
    pub fn join(&self, name: impl AsRef<Path>) -> PathBuf {
        self.dir.join(name)
    }

    /// Writes `contents` to the file `name` in the directory; its path.
    ///
    /// # Panics
    /// If the file cannot be written.
    pub fn write(&self, name: impl AsRef<Path>, contents: impl AsRef<[u8]>) -> PathBuf {
        let path = self.join(name);
        if let Err(e) = std::fs::write(&path, contents) {
            panic!("cannot write {}: {e}", path.display());
        }
        path
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if self.keep_on_failure && std::thread::panicking() {
            eprintln!("kept for the failed test: {}", self.dir.display());
            return;
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A CA, and a server and a client certificate it signed (for `localhost` and 127.0.0.1), as PEM
/// files in a [`Scratch`] directory of their own, removed on drop: `ca.pem`, `server.pem`,
/// `server-key.pem`, `client.pem`, `client-key.pem`. A test may write its own files beside them
/// ([`Pki::write`]).
#[derive(Debug)]
pub struct Pki {
    dir: Scratch,
}

impl Pki {
    /// Makes the CA and the certificates.
    ///
    /// # Panics
    /// If the directory cannot be written or a certificate cannot be made (a test's setup).
    #[allow(clippy::unwrap_used)]
    pub fn new() -> Self {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, SanType};
        let dir = Scratch::new("pki");
        let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca.distinguished_name.push(DnType::CommonName, "kvroute test CA");
        let ca_key = KeyPair::generate().unwrap();
        dir.write("ca.pem", ca.self_signed(&ca_key).unwrap().pem());
        let issuer = Issuer::new(ca, ca_key);
        for (name, cn) in [("server", "127.0.0.1"), ("client", "kvroute replica")] {
            let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
            params
                .subject_alt_names
                .push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
            params.distinguished_name.push(DnType::CommonName, cn);
            let key = KeyPair::generate().unwrap();
            let cert = params.signed_by(&key, &issuer).unwrap();
            dir.write(format!("{name}.pem"), cert.pem());
            dir.write(format!("{name}-key.pem"), key.serialize_pem());
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
    pub fn write(&self, name: &str, contents: &str) -> PathBuf {
        self.dir.write(name, contents)
    }
}

impl Default for Pki {
    fn default() -> Self {
        Self::new()
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
    fn a_scratch_directory_is_its_own_and_goes_with_everything_in_it() {
        let (a, b) = (Scratch::new("testkit"), Scratch::new("testkit"));
        assert_ne!(a.path(), b.path());
        let name = a.path().file_name().unwrap().to_str().unwrap().to_owned();
        assert!(
            name.starts_with(&format!("kvroute-testkit-{}-", std::process::id())),
            "{name}"
        );
        let file = a.write("f.txt", "text");
        assert_eq!(file, a.join("f.txt"));
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "text");
        std::fs::create_dir_all(a.join("sub/deeper")).unwrap();
        a.write("sub/deeper/g", [1u8, 2]);
        let dir = a.path().to_owned();
        drop(a);
        assert!(!dir.exists(), "{} is left", dir.display());
        assert!(b.path().is_dir(), "another's stays");
    }

    #[test]
    fn a_scratch_directory_kept_on_failure_goes_when_the_test_passes() {
        let kept = Scratch::new("testkit-kept").keep_on_failure();
        kept.write("log", "line");
        let dir = kept.path().to_owned();
        drop(kept);
        assert!(!dir.exists(), "{} is left", dir.display());
    }

    #[test]
    fn a_scratch_directory_kept_on_failure_stays_when_the_test_panics() {
        let kept = Scratch::new("testkit-failed").keep_on_failure();
        let dir = kept.path().to_owned();
        let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let _kept = kept;
            panic!("the test fails (as this test means it to)");
        }));
        assert!(failed.is_err());
        assert!(dir.is_dir(), "{} was removed", dir.display());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_pki_goes_with_its_directory() {
        let pki = Pki::new();
        let dir = pki.path("ca.pem").parent().unwrap().to_owned();
        for file in [
            "ca.pem",
            "server.pem",
            "server-key.pem",
            "client.pem",
            "client-key.pem",
        ] {
            assert!(pki.path(file).is_file(), "{file}");
        }
        pki.write("extra.conf", "x");
        drop(pki);
        assert!(!dir.exists(), "{} is left", dir.display());
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
