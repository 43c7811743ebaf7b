//! The NATS connection: how a replica proves itself to the server (NATS's own token, user and
//! password, or `.creds` file), TLS (a CA that verifies the server, a client certificate for
//! mutual TLS), and a first attempt that tells a refusal from a server not reachable yet.
//!
//! A refusal (credentials the server does not accept, a certificate that does not verify) is a
//! configuration error: [`crate::SyncTransport::start`] returns it ([`crate::SyncError::Refused`]),
//! naming what to check, and the replica does not start. A server not reachable yet is not: the
//! connection is made in the background, as it is remade after any outage, and the replica
//! starts on its own view meanwhile.
//!
//! Credentials never reach a log line, an error or a `Debug` output: [`Secret`] prints as
//! `Secret(..)`, and the server's refusal names the credential's key, never its value.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use async_nats::{Client, ConnectErrorKind, ConnectOptions, Event, rustls};
use kvroute_core::router::RouterId;
use tokio::sync::mpsc;

use crate::transport::{NatsSyncConfig, SyncError};

/// A credential (a NATS token or password, an engine's API key). Its [`Debug`] output is
/// `Secret(..)`; it has no `Display` and no `Serialize` (a configuration reads it, nothing writes
/// it).
#[derive(Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// Wraps `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value, for the one place that hands it to the server.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// How a replica proves itself to the NATS server (the server's `authorization` block, or an
/// operator's accounts for a `.creds` file).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum NatsAuth {
    /// No credentials.
    #[default]
    None,
    /// A token (`authorization { token: ... }`).
    Token(Secret),
    /// A user and password (`authorization { user: ..., password: ... }`).
    UserPassword {
        /// The user.
        user: String,
        /// The password.
        password: Secret,
    },
    /// A `.creds` file, as `nsc` writes it: a user JWT and the NKey seed that signs the
    /// server's challenge (read when connecting).
    CredentialsFile(PathBuf),
}

impl NatsAuth {
    /// The configuration keys that name this credential, for errors (never its value); `None`
    /// without credentials.
    pub fn keys(&self) -> Option<&'static str> {
        match self {
            Self::None => None,
            Self::Token(_) => Some("nats-token"),
            Self::UserPassword { .. } => Some("nats-user and nats-password"),
            Self::CredentialsFile(_) => Some("nats-credentials"),
        }
    }
}

/// TLS to the NATS server.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NatsTls {
    /// Whether the connection must be TLS (a server without TLS is refused). A `tls://` URL
    /// requires it too; so does a server whose configuration has a `tls` block.
    pub required: bool,
    /// PEM file of the CA certificates that verify the server. None: the system's.
    pub ca: Option<PathBuf>,
    /// The client's certificate and key, for a server that verifies its clients (mutual TLS).
    pub client: Option<ClientCertificate>,
}

/// A client certificate and its private key, PEM files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientCertificate {
    /// The certificate (chain).
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
}

/// Checks that a `.creds` file can be read and holds a user JWT and an NKey seed (without
/// saying what they are), so that a bad file stops a replica at start-up.
pub fn check_credentials_file(path: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    ConnectOptions::with_credentials(&text)
        .map(|_| ())
        .map_err(|_| "not a NATS credentials file (a user JWT and an NKey seed, as nsc writes it)".to_owned())
}

/// The connection options of replica `id`: its name, no echo of its own messages, reconnecting
/// after any outage (with a short growing pause), its credentials and TLS; connection events go
/// to `events`.
async fn options(
    id: RouterId,
    config: &NatsSyncConfig,
    events: &mpsc::UnboundedSender<Event>,
) -> Result<ConnectOptions, SyncError> {
    let events = events.clone();
    let mut options = ConnectOptions::new()
        .name(format!("kvroute-{:016x}", id.0))
        .no_echo()
        .connection_timeout(config.join_timeout)
        .reconnect_delay_callback(|attempts| Duration::from_millis(50 * attempts.min(10) as u64))
        .event_callback(move |event| {
            let tx = events.clone();
            async move {
                let _ = tx.send(event);
            }
        });
    options = match &config.auth {
        NatsAuth::None => options,
        NatsAuth::Token(token) => options.token(token.expose().to_owned()),
        NatsAuth::UserPassword { user, password } => {
            options.user_and_password(user.clone(), password.expose().to_owned())
        }
        NatsAuth::CredentialsFile(path) => {
            options
                .credentials_file(path)
                .await
                .map_err(|e| SyncError::Connect {
                    url: config.url.clone(),
                    message: format!("nats-credentials {}: {e}", path.display()),
                })?
        }
    };
    if let Some(ca) = &config.tls.ca {
        options = options.add_root_certificates(ca.clone());
    }
    if let Some(client) = &config.tls.client {
        options = options.add_client_certificate(client.cert.clone(), client.key.clone());
    }
    Ok(options.require_tls(config.tls.required))
}

/// Connects replica `id` to `config.url`. A first attempt that the server refuses (credentials,
/// TLS) is an error naming what to check; a server not reachable yet is connected to in the
/// background (the client reconnects by itself from then on) and the client returned at once.
pub(crate) async fn connect(
    id: RouterId,
    config: &NatsSyncConfig,
    events: &mpsc::UnboundedSender<Event>,
) -> Result<Client, SyncError> {
    let url = config.url.as_str();
    let first = options(id, config, events).await?.connect(url).await;
    match first {
        Ok(client) => Ok(client),
        Err(e) => {
            if let Some(reason) = refusal(&e, config) {
                return Err(SyncError::Refused {
                    url: config.url.clone(),
                    reason,
                });
            }
            tracing::debug!(error = %e, "NATS not reachable yet; connecting in the background");
            options(id, config, events)
                .await?
                .retry_on_initial_connect()
                .connect(url)
                .await
                .map_err(|e| SyncError::Connect {
                    url: config.url.clone(),
                    message: e.to_string(),
                })
        }
    }
}

/// Why the server refused this replica, if it did: a wrong or missing credential, or TLS that
/// failed (an untrusted certificate, a server without TLS when TLS is required, a client
/// certificate missing or refused, a certificate file that would not load). `None` for a server
/// not reachable.
fn refusal(e: &async_nats::ConnectError, config: &NatsSyncConfig) -> Option<String> {
    match e.kind() {
        ConnectErrorKind::AuthorizationViolation => Some(match config.auth.keys() {
            Some(keys) => format!("authorization violation: the server did not accept {keys}"),
            None => "authorization violation: the server requires credentials (nats-token, \
                     nats-user and nats-password, or nats-credentials)"
                .to_owned(),
        }),
        ConnectErrorKind::Authentication => Some(format!(
            "authentication failed: could not sign the server's challenge with {}",
            config.auth.keys().unwrap_or("no credentials")
        )),
        ConnectErrorKind::Tls => Some(format!(
            "TLS: {e} (check nats-tls-ca, nats-tls-cert and nats-tls-key)"
        )),
        // A TLS handshake that failed comes as an I/O error wrapping rustls's error; a server
        // that is down or unreachable as another I/O error.
        ConnectErrorKind::Io => {
            tls_error(e).map(|tls| format!("TLS handshake failed ({tls}); {}", tls_hint(tls, config)))
        }
        _ => None,
    }
}

/// The rustls error inside `e`, if it is one.
fn tls_error(e: &async_nats::ConnectError) -> Option<&rustls::Error> {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if let Some(tls) = s.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        if let Some(inner) = s.downcast_ref::<std::io::Error>().and_then(|io| io.get_ref())
            && let Some(tls) = inner.downcast_ref::<rustls::Error>()
        {
            return Some(tls);
        }
        source = s.source();
    }
    None
}

/// What to check for TLS error `tls`.
fn tls_hint(tls: &rustls::Error, config: &NatsSyncConfig) -> String {
    use rustls::AlertDescription as Alert;
    match tls {
        rustls::Error::InvalidCertificate(_) => match &config.tls.ca {
            Some(ca) => format!(
                "is the server's certificate, for this host, signed by the CA in nats-tls-ca ({})?",
                ca.display()
            ),
            None => "set nats-tls-ca to the CA that signed the server's certificate".to_owned(),
        },
        rustls::Error::AlertReceived(
            Alert::BadCertificate | Alert::CertificateRequired | Alert::UnknownCA | Alert::CertificateUnknown,
        ) => "the server wants a client certificate it trusts: set nats-tls-cert and nats-tls-key".to_owned(),
        rustls::Error::InvalidMessage(_) | rustls::Error::InappropriateMessage { .. } => {
            "does the server speak TLS? TLS is required (a tls:// URL or a nats-tls-* key)".to_owned()
        }
        _ => "check nats-tls-ca, nats-tls-cert and nats-tls-key".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_never_prints() {
        let auth = NatsAuth::UserPassword {
            user: "router".into(),
            password: Secret::new("hunter2"),
        };
        let shown = format!("{auth:?} {:?}", NatsAuth::Token(Secret::new("tok-123")));
        assert!(
            !shown.contains("hunter2") && !shown.contains("tok-123"),
            "{shown}"
        );
        assert!(shown.contains("router"), "{shown}");
    }

    #[test]
    fn a_credentials_file_is_checked_without_naming_its_content() {
        let dir = kvroute_testkit::Scratch::new("creds");
        // As `nsc` writes one: a user JWT (opaque here) and an NKey user seed.
        let seed = nkeys::KeyPair::new_user().seed().unwrap();
        let good = dir.join("good.creds");
        std::fs::write(
            &good,
            format!(
                "-----BEGIN NATS USER JWT-----\neyJ0eXAiOiJKV1QifQ.eyJzdWIiOiJVIn0.c2ln\n------END NATS USER JWT------\n\n\
                 -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
            ),
        )
        .unwrap();
        assert_eq!(check_credentials_file(&good), Ok(()));
        let bad = dir.join("bad.creds");
        std::fs::write(&bad, "SUAsecretseed\n").unwrap();
        let err = check_credentials_file(&bad).unwrap_err();
        assert!(
            err.contains("not a NATS credentials file") && !err.contains("SUAsecretseed"),
            "{err}"
        );
        let err = check_credentials_file(&dir.join("missing.creds")).unwrap_err();
        assert!(err.contains("No such file"), "{err}");
    }
}
