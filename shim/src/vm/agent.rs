//! The shim's side of burrow-agent's ttrpc service.
//!
//! In a VM the agent is reached through the VMM's hybrid vsock: connect to
//! the unix socket, write `CONNECT <port>\n`, read `OK <n>\n`, and the rest
//! of the stream is the guest connection. In the agent's test mode it is a
//! plain unix socket.

mod session;

use std::future::Future;
use std::path::Path;
use std::time::Duration;

use burrow_protocol::agent as pb;
use burrow_protocol::ttrpc;
use burrow_protocol::ttrpc::context::Context;
use burrow_protocol::AgentClient;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;

use crate::sandbox::{Chunk, ExitStatus, ProcessEntry, Result, SandboxError, SandboxStats, Stream};

/// How long one connection attempt (connect and handshake) may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Longest reply line of the vsock handshake.
const MAX_HANDSHAKE_LINE: usize = 64;

/// How to reach the agent.
#[derive(Debug, Clone)]
pub enum AgentAddr {
    /// The VMM's vsock unix socket and the guest port.
    Vsock { path: std::path::PathBuf, port: u32 },
    /// A plain unix socket (agent test mode).
    Unix(std::path::PathBuf),
}

impl AgentAddr {
    /// The unix socket connected to.
    pub fn path(&self) -> &Path {
        match self {
            Self::Vsock { path, .. } | Self::Unix(path) => path,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("connecting to {path}: {err}")]
    Io { path: String, err: std::io::Error },
    #[error("vsock handshake with {path}: {msg}")]
    Handshake { path: String, msg: String },
}

async fn handshake(
    stream: &mut UnixStream,
    path: &Path,
    port: u32,
) -> std::result::Result<(), ConnectError> {
    let p = path.display().to_string();
    let io = |err| ConnectError::Io {
        path: p.clone(),
        err,
    };
    stream
        .write_all(format!("CONNECT {port}\n").as_bytes())
        .await
        .map_err(io)?;
    let mut line = Vec::with_capacity(16);
    loop {
        let mut b = [0u8; 1];
        let n = stream.read(&mut b).await.map_err(|err| ConnectError::Io {
            path: p.clone(),
            err,
        })?;
        if n == 0 {
            return Err(ConnectError::Handshake {
                path: p,
                msg: "closed before answering (is the agent listening yet?)".into(),
            });
        }
        if b[0] == b'\n' {
            break;
        }
        line.push(b[0]);
        if line.len() > MAX_HANDSHAKE_LINE {
            return Err(ConnectError::Handshake {
                path: p,
                msg: "answer line too long".into(),
            });
        }
    }
    let text = String::from_utf8_lossy(&line);
    if text.starts_with("OK ") || text == "OK" {
        Ok(())
    } else {
        Err(ConnectError::Handshake {
            path: p,
            msg: format!("unexpected answer {text:?}"),
        })
    }
}

/// Open one connection to the agent (no retries).
pub async fn connect_once(addr: &AgentAddr) -> std::result::Result<AgentClient, ConnectError> {
    let (path, port) = match addr {
        AgentAddr::Vsock { path, port } => (path.as_path(), Some(*port)),
        AgentAddr::Unix(path) => (path.as_path(), None),
    };
    let mut stream = super::vmm::connect(path)
        .await
        .map_err(|err| ConnectError::Io {
            path: path.display().to_string(),
            err,
        })?;
    if let Some(port) = port {
        handshake(&mut stream, path, port).await?;
    }
    let socket = ttrpc::r#async::transport::Socket::new(stream);
    Ok(AgentClient::new(ttrpc::r#async::Client::new(socket)))
}

fn map_ttrpc(call: &str, e: ttrpc::Error) -> SandboxError {
    match e {
        ttrpc::Error::RpcStatus(s) => {
            SandboxError::from_code(s.code(), format!("agent {call}: {}", s.message))
        }
        ttrpc::Error::LocalClosed | ttrpc::Error::RemoteClosed | ttrpc::Error::Eof => {
            SandboxError::Unavailable(format!(
                "agent {call}: the connection to the agent closed ({e})"
            ))
        }
        other => SandboxError::Unavailable(format!("agent {call}: {other}")),
    }
}

/// A connected agent with per-call timeouts.
#[derive(Clone)]
pub struct Agent {
    client: AgentClient,
    timeout: Duration,
}

impl Agent {
    pub fn new(client: AgentClient, timeout: Duration) -> Self {
        Self { client, timeout }
    }

    /// Connect, retrying until the agent answers `Health` or `deadline`
    /// passes (the guest is still booting meanwhile).
    pub async fn connect(
        addr: &AgentAddr,
        timeout: Duration,
        boot_timeout: Duration,
    ) -> Result<Self> {
        let start = tokio::time::Instant::now();
        let mut last = String::from("never tried");
        // A restored guest answers within a few ms of its VMM's socket
        // appearing: look again soon at first, then every 50 ms.
        let mut pause = Duration::from_millis(5);
        while start.elapsed() < boot_timeout {
            // A guest that takes the connection and never answers the
            // handshake must not hold the shim past its deadline (issue 15).
            let limit = boot_timeout
                .saturating_sub(start.elapsed())
                .min(HANDSHAKE_TIMEOUT);
            let attempt = tokio::time::timeout(limit, connect_once(addr))
                .await
                .unwrap_or_else(|_| {
                    Err(ConnectError::Handshake {
                        path: addr.path().display().to_string(),
                        msg: format!("no answer within {}s", limit.as_secs()),
                    })
                });
            match attempt {
                Ok(client) => {
                    let agent = Agent::new(client, timeout.min(Duration::from_secs(10)));
                    match agent.health().await {
                        Ok(h) => {
                            if h.protocol_version != burrow_protocol::PROTOCOL_VERSION {
                                return Err(SandboxError::FailedPrecondition(format!(
                                    "the guest agent speaks protocol {} but this shim speaks {}: rebuild the guest image",
                                    h.protocol_version,
                                    burrow_protocol::PROTOCOL_VERSION
                                )));
                            }
                            return Ok(Agent::new(agent.client, timeout));
                        }
                        Err(e) => last = e.to_string(),
                    }
                }
                Err(e) => last = e.to_string(),
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(50));
        }
        Err(SandboxError::Timeout(format!(
            "the guest agent did not answer within {}s of boot (last error: {last})",
            boot_timeout.as_secs()
        )))
    }

    /// One call bounded by the per-call timeout.
    async fn call<T>(&self, name: &str, fut: impl Future<Output = ttrpc::Result<T>>) -> Result<T> {
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(r) => r.map_err(|e| map_ttrpc(name, e)),
            Err(_) => Err(SandboxError::Timeout(format!(
                "the guest agent did not answer {name} within {}s",
                self.timeout.as_secs()
            ))),
        }
    }

    /// One call that may block as long as the process runs.
    async fn call_unbounded<T>(
        &self,
        name: &str,
        fut: impl Future<Output = ttrpc::Result<T>>,
    ) -> Result<T> {
        fut.await.map_err(|e| map_ttrpc(name, e))
    }

    fn ctx() -> Context {
        Context::default()
    }

    pub async fn health(&self) -> Result<pb::HealthResponse> {
        self.call(
            "Health",
            self.client.health(Self::ctx(), &pb::HealthRequest::new()),
        )
        .await
    }

    pub async fn set_time_now(&self) -> Result<()> {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let req = pb::SetTimeRequest {
            unix_seconds: i64::try_from(now.as_secs()).unwrap_or(0),
            nanos: now.subsec_nanos(),
            ..Default::default()
        };
        self.call("SetTime", self.client.set_time(Self::ctx(), &req))
            .await
            .map(drop)
    }

    /// Configure the NIC that booted with MAC `nic` from `net` (it takes
    /// `net`'s MAC too).
    pub async fn configure_network(
        &self,
        nic: [u8; 6],
        net: &burrow_protocol::net::GuestNet,
    ) -> Result<()> {
        let req = pb::ConfigureNetworkRequest {
            nic_mac: nic.to_vec(),
            config: net.to_string(),
            ..Default::default()
        };
        self.call(
            "ConfigureNetwork",
            self.client.configure_network(Self::ctx(), &req),
        )
        .await
        .map(drop)
    }

    /// Give the guest fresh entropy (after a restore, every restored copy
    /// would otherwise continue from the same RNG state).
    pub async fn add_entropy(&self) -> Result<()> {
        use std::io::Read;
        let mut data = vec![0u8; 256];
        std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut data))
            .map_err(|e| SandboxError::Internal(format!("reading /dev/urandom: {e}")))?;
        let req = pb::AddEntropyRequest {
            data,
            ..Default::default()
        };
        self.call("AddEntropy", self.client.add_entropy(Self::ctx(), &req))
            .await
            .map(drop)
    }

    /// Give the guest its own hostname, machine id and VM generation.
    pub async fn set_identity(
        &self,
        hostname: &str,
        machine_id: &str,
        generation: u64,
    ) -> Result<()> {
        let host = pb::SetHostnameRequest {
            hostname: hostname.to_string(),
            ..Default::default()
        };
        let id = pb::SetIdentityRequest {
            machine_id: machine_id.to_string(),
            vm_generation: generation,
            ..Default::default()
        };
        // Independent: both in flight on the one connection.
        tokio::try_join!(
            self.call("SetHostname", self.client.set_hostname(Self::ctx(), &host)),
            self.call("SetIdentity", self.client.set_identity(Self::ctx(), &id)),
        )
        .map(drop)
    }

    /// Bring the guest's CPUs `0..count` online (the VMM must let them
    /// run first); how many are online afterwards.
    pub async fn online_cpus(&self, count: u32) -> Result<u32> {
        let req = pb::OnlineCpusRequest {
            count,
            ..Default::default()
        };
        self.call("OnlineCpus", self.client.online_cpus(Self::ctx(), &req))
            .await
            .map(|r| r.online)
    }

    pub async fn power_off(&self) -> Result<()> {
        self.call(
            "PowerOff",
            self.client
                .power_off(Self::ctx(), &pb::PowerOffRequest::new()),
        )
        .await
        .map(drop)
    }

    pub async fn create_container(
        &self,
        id: &str,
        spec: &[u8],
        rootfs: pb::Rootfs,
        stdin: bool,
    ) -> Result<u32> {
        let req = pb::CreateContainerRequest {
            container_id: id.into(),
            oci_spec: spec.to_vec(),
            rootfs: Some(rootfs).into(),
            stdin,
            ..Default::default()
        };
        self.call(
            "CreateContainer",
            self.client.create_container(Self::ctx(), &req),
        )
        .await
        .map(|r| r.pid)
    }

    fn creq(id: &str) -> pb::ContainerRequest {
        pb::ContainerRequest {
            container_id: id.into(),
            ..Default::default()
        }
    }

    fn preq(id: &str, exec_id: &str) -> pb::ProcessRequest {
        pb::ProcessRequest {
            container_id: id.into(),
            exec_id: exec_id.into(),
            ..Default::default()
        }
    }

    pub async fn start_container(&self, id: &str) -> Result<()> {
        self.call(
            "StartContainer",
            self.client.start_container(Self::ctx(), &Self::creq(id)),
        )
        .await
        .map(drop)
    }

    pub async fn delete_container(&self, id: &str) -> Result<()> {
        self.call(
            "DeleteContainer",
            self.client.delete_container(Self::ctx(), &Self::creq(id)),
        )
        .await
        .map(drop)
    }

    pub async fn processes(&self, id: &str) -> Result<Vec<ProcessEntry>> {
        let r = self
            .call(
                "ListProcesses",
                self.client.list_processes(Self::ctx(), &Self::creq(id)),
            )
            .await?;
        Ok(r.processes
            .into_iter()
            .map(|p| ProcessEntry {
                exec_id: p.exec_id,
                pid: p.pid,
                running: p.running,
            })
            .collect())
    }

    /// The guest pid of container `id`'s init in a restored guest (its
    /// process runs already).
    pub async fn restored_init(&self, id: &str) -> Result<u32> {
        self.processes(id)
            .await?
            .iter()
            .find(|p| p.exec_id.is_empty())
            .map(|p| p.pid)
            .ok_or_else(|| {
                SandboxError::FailedPrecondition(format!(
                    "the restored guest has no init process for container {id}"
                ))
            })
    }

    /// Container `id`'s resource use as the guest counts it.
    pub async fn stats(&self, id: &str) -> Result<SandboxStats> {
        let r = self
            .call(
                "ContainerStats",
                self.client.container_stats(Self::ctx(), &Self::creq(id)),
            )
            .await?;
        Ok(SandboxStats {
            cpu_usage_usec: r.cpu_usage_usec,
            memory_bytes: r.memory_usage_bytes,
            memory_limit_bytes: r.memory_total_bytes,
            pids: r.pids,
            oom_kills: r.oom_kills,
        })
    }

    /// New limits (OCI `linux.resources` JSON) for container `id`.
    pub async fn update_container(&self, id: &str, resources: &[u8]) -> Result<()> {
        let req = pb::UpdateContainerRequest {
            container_id: id.into(),
            resources: resources.to_vec(),
            ..Default::default()
        };
        self.call(
            "UpdateContainer",
            self.client.update_container(Self::ctx(), &req),
        )
        .await
        .map(drop)
    }

    pub async fn exec(&self, id: &str, exec_id: &str, process: &[u8], stdin: bool) -> Result<u32> {
        let req = pb::ExecProcessRequest {
            container_id: id.into(),
            exec_id: exec_id.into(),
            oci_process: process.to_vec(),
            stdin,
            ..Default::default()
        };
        self.call("ExecProcess", self.client.exec_process(Self::ctx(), &req))
            .await
            .map(|r| r.pid)
    }

    pub async fn signal(&self, id: &str, exec_id: &str, signal: u32, all: bool) -> Result<()> {
        let req = pb::SignalProcessRequest {
            container_id: id.into(),
            exec_id: exec_id.into(),
            signal,
            all,
            ..Default::default()
        };
        self.call(
            "SignalProcess",
            self.client.signal_process(Self::ctx(), &req),
        )
        .await
        .map(drop)
    }

    pub async fn wait(&self, id: &str, exec_id: &str) -> Result<ExitStatus> {
        let r = self
            .call_unbounded(
                "WaitProcess",
                self.client
                    .wait_process(Self::ctx(), &Self::preq(id, exec_id)),
            )
            .await?;
        Ok(if r.signal != 0 {
            ExitStatus::Signal(r.signal)
        } else {
            ExitStatus::Code(r.exit_code)
        })
    }

    /// Block until container `id`'s OOM-kill count exceeds `seen`.
    pub async fn wait_oom_kill(&self, id: &str, seen: u64) -> Result<u64> {
        let mut req = pb::WaitOomKillRequest::new();
        req.seen = seen;
        req.container_id = id.into();
        let r = self
            .call_unbounded("WaitOomKill", self.client.wait_oom_kill(Self::ctx(), &req))
            .await?;
        Ok(r.kills)
    }

    pub async fn delete_process(&self, id: &str, exec_id: &str) -> Result<()> {
        self.call(
            "DeleteProcess",
            self.client
                .delete_process(Self::ctx(), &Self::preq(id, exec_id)),
        )
        .await
        .map(drop)
    }

    pub async fn read(&self, id: &str, exec_id: &str, stream: Stream, max: usize) -> Result<Chunk> {
        let req = pb::ReadStreamRequest {
            container_id: id.into(),
            exec_id: exec_id.into(),
            max_bytes: u32::try_from(max.min(burrow_protocol::MAX_CHUNK)).unwrap_or(0),
            ..Default::default()
        };
        let r = match stream {
            Stream::Stdout => {
                self.call_unbounded("ReadStdout", self.client.read_stdout(Self::ctx(), &req))
                    .await?
            }
            Stream::Stderr => {
                self.call_unbounded("ReadStderr", self.client.read_stderr(Self::ctx(), &req))
                    .await?
            }
        };
        if r.data.len() > burrow_protocol::MAX_CHUNK {
            return Err(SandboxError::Internal(format!(
                "agent sent a {}-byte chunk",
                r.data.len()
            )));
        }
        Ok(Chunk {
            data: r.data,
            eof: r.eof,
        })
    }

    pub async fn write_stdin(&self, id: &str, exec_id: &str, data: &[u8]) -> Result<usize> {
        let data = data
            .get(..data.len().min(burrow_protocol::MAX_CHUNK))
            .unwrap_or_default();
        let req = pb::WriteStdinRequest {
            container_id: id.into(),
            exec_id: exec_id.into(),
            data: data.to_vec(),
            ..Default::default()
        };
        let r = self
            .call("WriteStdin", self.client.write_stdin(Self::ctx(), &req))
            .await?;
        Ok(usize::try_from(r.written).unwrap_or(0).min(data.len()))
    }

    pub async fn close_stdin(&self, id: &str, exec_id: &str) -> Result<()> {
        self.call(
            "CloseStdin",
            self.client
                .close_stdin(Self::ctx(), &Self::preq(id, exec_id)),
        )
        .await
        .map(drop)
    }

    /// Up to `max` bytes of file `path` in container `id` from `offset`:
    /// (data, the file's size, whether the end was reached).
    pub async fn read_file(
        &self,
        id: &str,
        path: &str,
        offset: u64,
        max: usize,
    ) -> Result<(Vec<u8>, u64, bool)> {
        let max = max.min(burrow_protocol::MAX_CHUNK);
        let req = pb::ReadFileRequest {
            container_id: id.into(),
            path: path.into(),
            offset,
            max_bytes: u32::try_from(max).unwrap_or(0),
            ..Default::default()
        };
        let r = self
            .call("ReadFile", self.client.read_file(Self::ctx(), &req))
            .await?;
        if r.data.len() > max {
            return Err(SandboxError::Internal(format!(
                "agent sent {} bytes of a file for a {max}-byte read",
                r.data.len()
            )));
        }
        Ok((r.data, r.size, r.eof))
    }

    /// Replace file `path` in container `id` atomically with `data`
    /// (permission bits `mode`, 0 for 0644), making missing parents.
    pub async fn write_file(&self, id: &str, path: &str, data: &[u8], mode: u32) -> Result<()> {
        let req = pb::WriteFileRequest {
            container_id: id.into(),
            path: path.into(),
            data: data.to_vec(),
            mode,
            append: false,
            make_parents: true,
            ..Default::default()
        };
        self.call("WriteFile", self.client.write_file(Self::ctx(), &req))
            .await
            .map(drop)
    }

    /// Write `data` to file `path` in container `id`: with `append`, at
    /// its end (created, mode `mode`, if missing), else replacing it
    /// atomically; its parent directory must exist.
    pub async fn put_file(
        &self,
        id: &str,
        path: &str,
        data: Vec<u8>,
        mode: u32,
        append: bool,
    ) -> Result<()> {
        let req = pb::WriteFileRequest {
            container_id: id.into(),
            path: path.into(),
            data,
            mode,
            append,
            make_parents: false,
            ..Default::default()
        };
        self.call("WriteFile", self.client.write_file(Self::ctx(), &req))
            .await
            .map(drop)
    }

    /// Rename `from` over `to` in container `id`.
    pub async fn rename(&self, id: &str, from: &str, to: &str) -> Result<()> {
        let req = pb::RenameRequest {
            container_id: id.into(),
            from: from.into(),
            to: to.into(),
            ..Default::default()
        };
        self.call("Rename", self.client.rename(Self::ctx(), &req))
            .await
            .map(drop)
    }

    /// Remove file `path` in container `id`.
    pub async fn remove_file(&self, id: &str, path: &str) -> Result<()> {
        let req = pb::RemoveRequest {
            container_id: id.into(),
            path: path.into(),
            recursive: false,
            ..Default::default()
        };
        self.call("Remove", self.client.remove(Self::ctx(), &req))
            .await
            .map(drop)
    }

    /// Stat `path` in container `id` (not following a final symlink).
    pub async fn stat(&self, id: &str, path: &str) -> Result<pb::FileInfo> {
        let req = pb::PathRequest {
            container_id: id.into(),
            path: path.into(),
            ..Default::default()
        };
        self.call("Stat", self.client.stat(Self::ctx(), &req)).await
    }

    /// At most `max` entries of directory `path` in container `id`, and
    /// whether there were more.
    pub async fn list_dir(
        &self,
        id: &str,
        path: &str,
        max: u32,
    ) -> Result<(Vec<pb::FileInfo>, bool)> {
        let req = pb::ListDirRequest {
            container_id: id.into(),
            path: path.into(),
            max_entries: max,
            ..Default::default()
        };
        let r = self
            .call("ListDir", self.client.list_dir(Self::ctx(), &req))
            .await?;
        let over = r.entries.len() > usize::try_from(max).unwrap_or(usize::MAX);
        let mut entries = r.entries;
        entries.truncate(usize::try_from(max).unwrap_or(usize::MAX));
        Ok((entries, r.truncated || over))
    }

    pub async fn resize_pty(&self, id: &str, exec_id: &str, rows: u32, cols: u32) -> Result<()> {
        let req = pb::ResizePtyRequest {
            container_id: id.into(),
            exec_id: exec_id.into(),
            rows,
            cols,
            ..Default::default()
        };
        self.call("ResizePty", self.client.resize_pty(Self::ctx(), &req))
            .await
            .map(drop)
    }

    /// One browser call: Chromium's first start in a slow guest takes
    /// minutes, so these get [`BROWSER_TIMEOUT`] instead of the agent's.
    async fn browser_call<T>(
        &self,
        name: &str,
        fut: impl Future<Output = ttrpc::Result<T>>,
    ) -> Result<T> {
        tokio::time::timeout(BROWSER_TIMEOUT, self.call_unbounded(name, fut))
            .await
            .map_err(|_| {
                SandboxError::Timeout(format!(
                    "the guest's browser did not answer {name} within {}s",
                    BROWSER_TIMEOUT.as_secs()
                ))
            })?
    }

    /// Load `url`; the URL after redirects and the title.
    pub async fn browser_navigate(&self, url: &str, timeout_ms: u32) -> Result<(String, String)> {
        let req = pb::BrowserNavigateRequest {
            url: url.into(),
            timeout_ms,
            ..Default::default()
        };
        let r = self
            .browser_call(
                "BrowserNavigate",
                self.client.browser_navigate(Self::ctx(), &req),
            )
            .await?;
        Ok((r.url, r.title))
    }

    /// The page's text (or its element list), at most `max` bytes, and
    /// whether there was more.
    pub async fn browser_text(&self, max: usize, elements: bool) -> Result<(String, bool)> {
        let req = pb::BrowserTextRequest {
            max_bytes: u32::try_from(max).unwrap_or(u32::MAX),
            elements,
            ..Default::default()
        };
        let r = self
            .browser_call("BrowserText", self.client.browser_text(Self::ctx(), &req))
            .await?;
        if r.text.len() > max {
            return Err(SandboxError::Internal(format!(
                "agent sent {} bytes of page text for {max}",
                r.text.len()
            )));
        }
        Ok((r.text, r.truncated))
    }

    pub async fn browser_click(&self, selector: &str) -> Result<()> {
        let req = pb::BrowserClickRequest {
            selector: selector.into(),
            ..Default::default()
        };
        self.browser_call("BrowserClick", self.client.browser_click(Self::ctx(), &req))
            .await
            .map(drop)
    }

    pub async fn browser_type(&self, selector: &str, text: &str) -> Result<()> {
        let req = pb::BrowserTypeRequest {
            selector: selector.into(),
            text: text.into(),
            ..Default::default()
        };
        self.browser_call("BrowserType", self.client.browser_type(Self::ctx(), &req))
            .await
            .map(drop)
    }

    /// A PNG of the page at `width` x `height` (0: as it is).
    pub async fn browser_screenshot(&self, width: u32, height: u32) -> Result<(Vec<u8>, u32, u32)> {
        let req = pb::BrowserScreenshotRequest {
            width,
            height,
            ..Default::default()
        };
        let r = self
            .browser_call(
                "BrowserScreenshot",
                self.client.browser_screenshot(Self::ctx(), &req),
            )
            .await?;
        if r.png.len() > burrow_protocol::MAX_SCREENSHOT_BYTES {
            return Err(SandboxError::Internal(format!(
                "agent sent a {}-byte screenshot",
                r.png.len()
            )));
        }
        Ok((r.png, r.width, r.height))
    }
}

/// Longest a browser call may take (Chromium starting in a nested guest).
const BROWSER_TIMEOUT: Duration = Duration::from_secs(900);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agent_codes_reach_containerd_unchanged() {
        use ttrpc::Code;
        for code in [
            Code::PERMISSION_DENIED,
            Code::OUT_OF_RANGE,
            Code::RESOURCE_EXHAUSTED,
            Code::NOT_FOUND,
            Code::FAILED_PRECONDITION,
        ] {
            let from_agent = ttrpc::Error::RpcStatus(ttrpc::get_status(code, "no".to_string()));
            let e = map_ttrpc("signal", from_agent);
            assert!(e.to_string().contains("agent signal: no"), "{e}");
            match ttrpc::Error::from(e) {
                ttrpc::Error::RpcStatus(s) => assert_eq!(s.code(), code),
                other => panic!("{other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn handshake_accepts_ok_and_rejects_garbage() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("v.sock");
        let listener = tokio::net::UnixListener::bind(&path).expect("bind");
        let server = tokio::spawn(async move {
            for answer in [&b"OK 1073741824\n"[..], b"NO\n", &[b'x'; 100][..]] {
                let (mut s, _) = listener.accept().await.expect("accept");
                let mut buf = [0u8; 13];
                s.read_exact(&mut buf).await.expect("read");
                assert_eq!(&buf, b"CONNECT 1024\n");
                s.write_all(answer).await.expect("write");
                // Keep it open until the client is done.
                let _ = s.read(&mut [0u8; 1]).await;
            }
        });
        for expect_ok in [true, false, false] {
            let mut s = UnixStream::connect(&path).await.expect("connect");
            let r = handshake(&mut s, &path, 1024).await;
            assert_eq!(r.is_ok(), expect_ok, "{r:?}");
        }
        drop(server);
    }

    /// A guest that accepts the connection and never answers the handshake
    /// gets a timeout error by the boot deadline; the shim is not held.
    #[tokio::test]
    async fn a_silent_guest_times_out_by_the_deadline() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("v.sock");
        let listener = tokio::net::UnixListener::bind(&path).expect("bind");
        let _server = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((s, _)) = listener.accept().await {
                held.push(s);
            }
        });
        let addr = AgentAddr::Vsock {
            path: path.clone(),
            port: 1024,
        };
        let start = std::time::Instant::now();
        let r = Agent::connect(&addr, Duration::from_secs(1), Duration::from_secs(2)).await;
        assert!(matches!(r, Err(SandboxError::Timeout(_))), "{:?}", r.err());
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "took {:?}",
            start.elapsed()
        );
    }
}
