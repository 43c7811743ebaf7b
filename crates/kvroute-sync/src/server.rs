//! A local `nats-server` child process on a loopback port, for tests and `kvroute demo
//! --replicas` (Debian's `nats-server` package; CI installs it). Stopped when dropped.
//!
//! [`NatsServer::start_with`] starts one that requires credentials and TLS: it writes a
//! configuration file with an `authorization` block and a `tls` block (certificate files the
//! caller made), removed with the server.

use std::io;
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `nats-server` this process started.
#[derive(Debug)]
pub struct NatsServer {
    binary: PathBuf,
    port: u16,
    child: Option<Child>,
    /// The configuration file written for [`NatsServer::start_with`], if any.
    config_file: Option<PathBuf>,
    tls: bool,
}

/// What a started server demands of its clients.
#[derive(Clone, Debug, Default)]
pub struct ServerSecurity {
    /// The credentials it accepts. None: anyone.
    pub auth: Option<ServerAuth>,
    /// TLS. None: plain TCP.
    pub tls: Option<ServerTls>,
}

/// The one credential a server accepts (its `authorization` block).
#[derive(Clone, Debug)]
pub enum ServerAuth {
    /// A token.
    Token(String),
    /// A user and password.
    UserPassword {
        /// The user.
        user: String,
        /// The password.
        password: String,
    },
}

/// A server's TLS (its `tls` block): every client must speak TLS.
#[derive(Clone, Debug)]
pub struct ServerTls {
    /// The server's certificate (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// When set, clients must present a certificate this CA (PEM) signed (mutual TLS).
    pub verify_clients: Option<PathBuf>,
}

/// `s` as a quoted string of the server's configuration language (JSON's escapes).
fn quoted(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

impl ServerSecurity {
    /// The server's configuration file: its `authorization` and `tls` blocks.
    fn config_text(&self) -> String {
        let mut text = String::new();
        match &self.auth {
            None => {}
            Some(ServerAuth::Token(token)) => {
                text += &format!("authorization {{\n  token: {}\n}}\n", quoted(token));
            }
            Some(ServerAuth::UserPassword { user, password }) => {
                text += &format!(
                    "authorization {{\n  user: {}\n  password: {}\n}}\n",
                    quoted(user),
                    quoted(password)
                );
            }
        }
        if let Some(tls) = &self.tls {
            text += &format!(
                "tls {{\n  cert_file: {}\n  key_file: {}\n  timeout: 5\n",
                quoted(&tls.cert.display().to_string()),
                quoted(&tls.key.display().to_string())
            );
            if let Some(ca) = &tls.verify_clients {
                text += &format!(
                    "  ca_file: {}\n  verify: true\n",
                    quoted(&ca.display().to_string())
                );
            }
            text += "}\n";
        }
        text
    }
}

impl NatsServer {
    /// The `nats-server` binary: on `PATH`, else Debian's `/usr/sbin/nats-server`.
    pub fn binary() -> Option<PathBuf> {
        let on_path = std::env::var_os("PATH").into_iter().flat_map(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join("nats-server"))
                .collect::<Vec<_>>()
        });
        on_path
            .chain([PathBuf::from("/usr/sbin/nats-server")])
            .find(|p| p.is_file())
    }

    /// Starts `nats-server` on a free loopback port and waits until it accepts connections.
    pub fn start() -> io::Result<Self> {
        Self::start_with(ServerSecurity::default())
    }

    /// Starts `nats-server` on a free loopback port, demanding `security` of its clients, and
    /// waits until it accepts connections.
    pub fn start_with(security: ServerSecurity) -> io::Result<Self> {
        let binary = Self::binary().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "nats-server is not installed (apt-get install nats-server)",
            )
        })?;
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port();
        let config_file = if security.auth.is_none() && security.tls.is_none() {
            None
        } else {
            let path = std::env::temp_dir().join(format!("kvroute-nats-{}-{port}.conf", std::process::id()));
            std::fs::write(&path, security.config_text())?;
            Some(path)
        };
        let mut server = Self {
            binary,
            port,
            child: None,
            config_file,
            tls: security.tls.is_some(),
        };
        server.restart()?;
        Ok(server)
    }

    /// The server's process id (to read its CPU time), while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// `nats://127.0.0.1:PORT`, or `tls://127.0.0.1:PORT` when it requires TLS.
    pub fn url(&self) -> String {
        let scheme = if self.tls { "tls" } else { "nats" };
        format!("{scheme}://127.0.0.1:{}", self.port)
    }

    /// Stops the server (clients see the connection drop).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts it again on the same port (stopping it first if running) and waits until it
    /// accepts connections (10 s at most).
    pub fn restart(&mut self) -> io::Result<()> {
        self.stop();
        let mut command = Command::new(&self.binary);
        if let Some(file) = &self.config_file {
            command.arg("-c").arg(file);
        }
        let child = command
            .args(["-a", "127.0.0.1", "-p", &self.port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if TcpStream::connect((Ipv4Addr::LOCALHOST, self.port)).is_ok() {
                return Ok(());
            }
            if let Some(child) = &mut self.child
                && let Some(status) = child.try_wait()?
            {
                return Err(io::Error::other(format!("nats-server exited: {status}")));
            }
            if Instant::now() > deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "nats-server did not accept connections within 10 s",
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.stop();
        if let Some(file) = &self.config_file {
            let _ = std::fs::remove_file(file);
        }
    }
}
