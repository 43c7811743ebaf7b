//! A local `nats-server` child process on a loopback port, for tests and `kvroute demo
//! --replicas` (Debian's `nats-server` package; CI installs it). Stopped when dropped.

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
        let binary = Self::binary().ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "nats-server is not installed (apt-get install nats-server)",
            )
        })?;
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port();
        let mut server = Self {
            binary,
            port,
            child: None,
        };
        server.restart()?;
        Ok(server)
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
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
        let child = Command::new(&self.binary)
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
    }
}
