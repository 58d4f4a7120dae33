//! Copying a process's stdio between containerd's FIFOs and the sandbox.
//!
//! Every pump holds at most one chunk ([`CHUNK`] bytes) in memory: it reads
//! one chunk, hands it on completely, then reads the next, so a slow reader
//! on either side slows the writer instead of growing a buffer.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use crate::sandbox::{Sandbox, SandboxError, Stream, OUTPUT_CHUNK};

/// Largest chunk a pump moves at once (the most a sandbox's
/// `read_output` returns).
pub const CHUNK: usize = OUTPUT_CHUNK;

/// The stdio containerd asked for (paths of FIFOs or `file://` URIs;
/// empty = none).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StdioPaths {
    pub stdin: String,
    pub stdout: String,
    pub stderr: String,
    pub terminal: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum StdioError {
    #[error("unsupported stdio URI {0:?}: only FIFO paths and file:// are supported")]
    Unsupported(String),
    #[error("opening {path}: {err}")]
    Open { path: String, err: std::io::Error },
}

/// Where an output stream goes.
enum Sink {
    /// Read and drop (containerd gave no path; the guest must not block).
    Discard,
    File(tokio::fs::File),
}

fn check_uri(path: &str) -> Result<(), StdioError> {
    if path.contains("://") && !path.starts_with("file://") {
        return Err(StdioError::Unsupported(path.to_string()));
    }
    Ok(())
}

/// Reject stdio URIs we cannot serve before anything is created.
pub fn validate(paths: &StdioPaths) -> Result<(), StdioError> {
    check_uri(&paths.stdin)?;
    check_uri(&paths.stdout)?;
    check_uri(&paths.stderr)
}

async fn open_sink(path: &str) -> Result<Sink, StdioError> {
    if path.is_empty() {
        return Ok(Sink::Discard);
    }
    check_uri(path)?;
    let (file, append) = match path.strip_prefix("file://") {
        Some(p) => (p, true),
        None => (path, false),
    };
    let mut opts = tokio::fs::OpenOptions::new();
    opts.write(true);
    if append {
        opts.append(true).create(true);
    }
    // Opening a FIFO for writing waits for its reader: containerd holds it.
    opts.open(file)
        .await
        .map(Sink::File)
        .map_err(|err| StdioError::Open {
            path: path.to_string(),
            err,
        })
}

/// Copy one output stream of a process from the sandbox to `path` until the
/// sandbox reports EOF or fails. If the FIFO's reader goes away, the rest of
/// the output is drained and dropped so the guest never blocks on it.
pub async fn pump_output(
    sandbox: Arc<dyn Sandbox>,
    id: String,
    exec_id: String,
    stream: Stream,
    path: String,
) {
    let mut sink = match open_sink(&path).await {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!("{id}/{exec_id} {stream:?}: {e}; output is dropped");
            Sink::Discard
        }
    };
    loop {
        let chunk = match sandbox.read_output(&id, &exec_id, stream).await {
            Ok(c) => c,
            Err(e) => {
                tracing::debug!("{id}/{exec_id} {stream:?} ends: {e}");
                break;
            }
        };
        if !chunk.data.is_empty() {
            if let Sink::File(f) = &mut sink {
                if let Err(e) = f.write_all(&chunk.data).await {
                    tracing::warn!(
                        "{id}/{exec_id} {stream:?}: writing to {path}: {e}; dropping the rest"
                    );
                    sink = Sink::Discard;
                }
            }
        }
        if chunk.eof {
            break;
        }
    }
    if let Sink::File(f) = &mut sink {
        let _ = f.flush().await;
    }
}

/// Hand `data` to the process's stdin completely, waiting while the guest's
/// buffer is full.
pub(crate) async fn forward<S: Sandbox + ?Sized>(
    sandbox: &S,
    id: &str,
    exec_id: &str,
    mut data: &[u8],
) -> Result<(), SandboxError> {
    let mut backoff = Duration::from_millis(1);
    while !data.is_empty() {
        let n = sandbox.write_stdin(id, exec_id, data).await?;
        if n == 0 {
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(Duration::from_millis(100));
            continue;
        }
        backoff = Duration::from_millis(1);
        data = data.get(n..).unwrap_or_default();
    }
    Ok(())
}

/// Copy containerd's stdin FIFO into the process until the FIFO ends, CloseIO
/// flips `closed` (then what is already in the FIFO is still delivered), or
/// the process goes away. Closes the process's stdin at the end.
pub async fn pump_stdin(
    sandbox: Arc<dyn Sandbox>,
    id: String,
    exec_id: String,
    path: String,
    mut closed: watch::Receiver<bool>,
) {
    let file = path.strip_prefix("file://").unwrap_or(&path).to_string();
    // Read-write, so opening never waits for containerd's writer and the
    // FIFO never reports EOF between two writers; CloseIO ends the stream.
    let mut rx = match tokio::net::unix::pipe::OpenOptions::new()
        .read_write(true)
        .open_receiver(&file)
    {
        Ok(rx) => rx,
        Err(e) => {
            tracing::warn!("{id}/{exec_id}: opening stdin {path}: {e}");
            let _ = sandbox.close_stdin(&id, &exec_id).await;
            return;
        }
    };
    let mut buf = vec![0u8; CHUNK];
    loop {
        if *closed.borrow() {
            break;
        }
        tokio::select! {
            changed = closed.changed() => {
                if changed.is_err() {
                    // The owner went away: the process is gone.
                    return;
                }
            }
            r = rx.read(&mut buf) => match r {
                Ok(0) => break,
                Ok(n) => {
                    let data = buf.get(..n).unwrap_or_default();
                    if let Err(e) = forward(sandbox.as_ref(), &id, &exec_id, data).await {
                        tracing::debug!("{id}/{exec_id}: stdin ends: {e}");
                        return;
                    }
                }
                Err(e) => {
                    tracing::warn!("{id}/{exec_id}: reading stdin: {e}");
                    break;
                }
            },
        }
    }
    // Deliver what the writer put in before CloseIO: read until the FIFO
    // has stayed empty for a moment.
    while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(50), rx.read(&mut buf)).await {
        if n == 0 {
            break;
        }
        let data = buf.get(..n).unwrap_or_default();
        if forward(sandbox.as_ref(), &id, &exec_id, data)
            .await
            .is_err()
        {
            return;
        }
    }
    if let Err(e) = sandbox.close_stdin(&id, &exec_id).await {
        tracing::debug!("{id}/{exec_id}: closing stdin: {e}");
    }
}
