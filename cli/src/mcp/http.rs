//! `burrow mcp --http`: the same MCP server ([`Burrow`], the same tools) on
//! the Streamable HTTP transport, served with hyper on a loopback TCP port
//! or a unix socket, and nowhere else: the tools run commands in sandboxes
//! and the endpoint has no authentication of its own, so it must not be
//! reachable from another machine. rmcp also checks the `Host` header
//! against loopback names (DNS rebinding from a browser).

use std::net::SocketAddr;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context};
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use rmcp::transport::streamable_http_server::session::local::LocalSessionManager;
use rmcp::transport::{StreamableHttpServerConfig, StreamableHttpService};
use tokio::io::{AsyncRead, AsyncWrite};

use super::Burrow;

/// Where `--http` listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    /// A loopback address (`127.0.0.1:PORT`, `[::1]:PORT`; port 0 picks one).
    Tcp(SocketAddr),
    /// A unix socket, created 0600.
    Unix(PathBuf),
}

impl std::str::FromStr for Listen {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a path (unix:/run/burrow-mcp.sock)".into());
            }
            return Ok(Listen::Unix(PathBuf::from(path)));
        }
        let addr: SocketAddr = match s.strip_prefix("localhost:") {
            Some(port) => format!("127.0.0.1:{port}").parse(),
            None => s.parse(),
        }
        .map_err(|_| format!("expected 127.0.0.1:PORT, [::1]:PORT or unix:/PATH, not {s:?}"))?;
        if !addr.ip().is_loopback() {
            return Err(format!(
                "refusing to listen on {addr}: the MCP tools run commands in sandboxes and \
                 have no authentication, so `burrow mcp --http` serves only on loopback \
                 (127.0.0.1, ::1) or a unix socket"
            ));
        }
        Ok(Listen::Tcp(addr))
    }
}

type Service = StreamableHttpService<Burrow, LocalSessionManager>;

/// Serve `server` on `listen` until SIGINT or SIGTERM; the bound address
/// (the real port when 0 was asked) is printed on stderr once listening.
pub fn serve(server: Burrow, listen: Listen) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async move {
        // One handler for every session: output references stay pageable
        // across the connections of a client.
        let service: Service = StreamableHttpService::new(
            move || Ok(server.clone()),
            Arc::new(LocalSessionManager::default()),
            StreamableHttpServerConfig::default(),
        );
        let stop = service.config.cancellation_token.clone();
        // Handlers first: a stop asked as soon as the address is printed
        // still removes the socket.
        let stopped = shutdown_signal()?;
        let (listener, unix_path) = match listen {
            Listen::Tcp(addr) => {
                let l = tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("listening on {addr}"))?;
                let bound = l.local_addr().context("the bound address")?;
                eprintln!("burrow mcp: listening on http://{bound}/mcp");
                (Listener::Tcp(l), None)
            }
            Listen::Unix(path) => {
                let l = bind_unix(&path)?;
                eprintln!("burrow mcp: listening on unix:{}", path.display());
                (Listener::Unix(l), Some(path))
            }
        };
        tokio::select! {
            () = accept_loop(listener, service) => {},
            () = stopped => {},
        }
        if let Some(path) = unix_path {
            let _ = std::fs::remove_file(path);
        }
        // End the sessions' streams before the runtime goes.
        stop.cancel();
        Ok(())
    })
}

enum Listener {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

/// Accept connections until the process is stopped. A failed accept (out
/// of file descriptors, say) is reported and retried: one bad moment must
/// not take the server down under its clients.
async fn accept_loop(listener: Listener, service: Service) {
    loop {
        let accepted = match &listener {
            Listener::Tcp(l) => l
                .accept()
                .await
                .map(|(c, _)| spawn_connection(c, service.clone())),
            Listener::Unix(l) => l
                .accept()
                .await
                .map(|(c, _)| spawn_connection(c, service.clone())),
        };
        if let Err(e) = accepted {
            eprintln!("burrow mcp: accepting a connection: {e}");
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
}

/// One HTTP/1.1 connection, served until the client closes it.
fn spawn_connection<IO>(io: IO, service: Service)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        // A client going away mid-stream is not the server's failure.
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(TokioIo::new(io), TowerToHyperService::new(service))
            .await;
    });
}

/// Resolves on SIGTERM or SIGINT; the handlers are installed at once.
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
    })
}

/// Bind a unix socket at `path`, mode 0600 from the start: it is bound in
/// a fresh 0700 directory beside `path`, made 0600, then renamed into
/// place, so no other user can connect in between. A stale socket there
/// is replaced; a live one (a server answers) or any other file is not.
fn bind_unix(path: &Path) -> anyhow::Result<tokio::net::UnixListener> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                bail!("{} is in use: another server listens on it", path.display());
            }
            std::fs::remove_file(path)
                .with_context(|| format!("removing the stale socket {}", path.display()))?;
        }
        Ok(_) => bail!(
            "refusing to replace {}: it exists and is not a socket",
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("looking at {}", path.display())),
    }
    let name = path
        .file_name()
        .with_context(|| format!("{} names no file", path.display()))?;
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let private = parent.join(format!(
        ".{}.{}.tmp",
        name.to_string_lossy(),
        std::process::id()
    ));
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&private)
        .with_context(|| format!("creating {}", private.display()))?;
    let inner = private.join("s");
    let bound = (|| {
        let listener = std::os::unix::net::UnixListener::bind(&inner)
            .with_context(|| format!("binding a unix socket in {}", private.display()))?;
        std::fs::set_permissions(&inner, std::fs::Permissions::from_mode(0o600))
            .context("making the socket 0600")?;
        std::fs::rename(&inner, path)
            .with_context(|| format!("moving the socket to {}", path.display()))?;
        listener.set_nonblocking(true).context("nonblocking")?;
        tokio::net::UnixListener::from_std(listener).context("registering the listener")
    })();
    let _ = std::fs::remove_file(&inner);
    let _ = std::fs::remove_dir(&private);
    bound
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::Listen;

    #[test]
    fn only_loopback_and_unix_are_accepted() {
        let ok = |s: &str| s.parse::<Listen>().unwrap();
        assert_eq!(
            ok("127.0.0.1:0"),
            Listen::Tcp("127.0.0.1:0".parse().unwrap())
        );
        assert_eq!(ok("[::1]:8080"), Listen::Tcp("[::1]:8080".parse().unwrap()));
        assert_eq!(
            ok("localhost:7"),
            Listen::Tcp("127.0.0.1:7".parse().unwrap())
        );
        assert_eq!(ok("unix:/run/m.sock"), Listen::Unix("/run/m.sock".into()));
        for bad in ["0.0.0.0:1", "[::]:1", "10.1.2.3:80", "[::ffff:127.0.0.1]:1"] {
            let e = bad.parse::<Listen>().unwrap_err();
            assert!(e.contains("refusing to listen"), "{bad}: {e}");
        }
        for bad in ["unix:", "example.com:80", "127.0.0.1", ""] {
            assert!(bad.parse::<Listen>().is_err(), "{bad} was accepted");
        }
    }
}
