//! Running burrow-agent in its test mode for the tests in this folder.

// Each test binary uses part of this.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use burrow_protocol::agent::*;
use burrow_protocol::ttrpc::{self, context};
use burrow_protocol::AgentClient;

/// Start `burrow-agent --listen unix:<dir>/agent.sock --state-dir
/// <dir>/state` with `args` added and `RUST_LOG=rust_log`, and connect to
/// it, waiting up to 20 s for it to come up. The caller owns the child.
pub async fn spawn_agent(dir: &Path, args: &[&OsStr], rust_log: &str) -> (Child, AgentClient) {
    let sock = dir.join("agent.sock");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_burrow-agent"))
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .args(args)
        .env("RUST_LOG", rust_log)
        .spawn()
        .expect("spawn burrow-agent");
    let deadline = Instant::now() + Duration::from_secs(20);
    let addr = format!("unix://{}", sock.display());
    let client = loop {
        if sock.exists() {
            if let Ok(c) = ttrpc::r#async::Client::connect(&addr).await {
                break c;
            }
        }
        assert!(Instant::now() < deadline, "agent did not come up on {addr}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    (child, AgentClient::new(client))
}

/// The agent in its test mode, killed on drop.
pub struct TestAgent {
    pub child: std::process::Child,
    pub dir: tempfile::TempDir,
    pub client: AgentClient,
}

impl TestAgent {
    pub async fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let (child, client) = spawn_agent(dir.path(), &[], "warn").await;
        TestAgent { child, dir, client }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Peak resident memory of the agent (VmHWM), in KiB.
    pub fn peak_rss_kib(&self) -> u64 {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.pid())).expect("agent status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmHWM")
    }
}

impl Drop for TestAgent {
    fn drop(&mut self) {
        // SAFETY-free: plain kill via the std API.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn ctx() -> context::Context {
    context::with_duration(Duration::from_secs(60))
}

pub fn code_of<T: std::fmt::Debug>(r: ttrpc::Result<T>) -> (ttrpc::Code, String) {
    match r {
        Err(ttrpc::Error::RpcStatus(s)) => (s.code(), s.message().to_string()),
        other => panic!("expected an RPC status error, got {other:?}"),
    }
}

pub fn make_rootfs(base: &Path) -> PathBuf {
    let root = base.join("rootfs");
    for d in ["usr", "etc", "tmp", "root"] {
        std::fs::create_dir_all(root.join(d)).expect("mkdir");
    }
    for l in ["bin", "lib", "lib64", "sbin"] {
        std::os::unix::fs::symlink(format!("usr/{l}"), root.join(l)).expect("symlink");
    }
    std::fs::write(root.join("etc/marker"), "marker\n").expect("marker");
    root
}

pub fn spec_json(args: &[&str]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {
            "args": args,
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
            "cwd": "/",
            "user": {"uid": 0, "gid": 0},
            "noNewPrivileges": true,
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 512}],
            "capabilities": {
                "bounding": ["CAP_CHOWN", "CAP_KILL", "CAP_SETUID", "CAP_SETGID"],
                "effective": ["CAP_CHOWN", "CAP_KILL", "CAP_SETUID", "CAP_SETGID"],
                "permitted": ["CAP_CHOWN", "CAP_KILL", "CAP_SETUID", "CAP_SETGID"]
            }
        },
        "root": {"path": "rootfs", "readonly": false},
        "hostname": "ctr-test",
        "mounts": [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/usr", "type": "bind", "source": "/usr", "options": ["rbind", "ro"]}
        ],
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "mount"}, {"type": "uts"}, {"type": "ipc"}],
            "maskedPaths": ["/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                            "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi", "/sys/firmware"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
        }
    }))
    .expect("json")
}

pub async fn create(
    a: &TestAgent,
    id: &str,
    rootfs: &Path,
    args: &[&str],
    stdin: bool,
) -> ttrpc::Result<CreateContainerResponse> {
    create_with_spec(a, id, rootfs, spec_json(args), stdin).await
}

/// Create container `id` on `rootfs` from the OCI spec `spec` (JSON).
pub async fn create_with_spec(
    a: &TestAgent,
    id: &str,
    rootfs: &Path,
    spec: Vec<u8>,
    stdin: bool,
) -> ttrpc::Result<CreateContainerResponse> {
    let mut req = CreateContainerRequest::new();
    req.container_id = id.into();
    req.oci_spec = spec;
    req.stdin = stdin;
    let mut r = Rootfs::new();
    r.source = rootfs.display().to_string();
    r.fstype = "bind".into();
    req.rootfs = Some(r).into();
    a.client.create_container(ctx(), &req).await
}

pub fn creq(id: &str) -> ContainerRequest {
    let mut r = ContainerRequest::new();
    r.container_id = id.into();
    r
}

pub async fn read_all(a: &TestAgent, container: &str, id: &str, stderr: bool) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let mut req = ReadStreamRequest::new();
        req.container_id = container.into();
        req.exec_id = id.into();
        let r = if stderr {
            a.client.read_stderr(ctx(), &req).await
        } else {
            a.client.read_stdout(ctx(), &req).await
        }
        .expect("read stream");
        if r.eof {
            return out;
        }
        out.extend_from_slice(&r.data);
    }
}

pub async fn wait(a: &TestAgent, container: &str, id: &str) -> WaitProcessResponse {
    let req = preq(container, id);
    a.client.wait_process(ctx(), &req).await.expect("wait")
}

/// The request naming process `exec_id` ("" for init) of `container`.
pub fn preq(container: &str, exec_id: &str) -> ProcessRequest {
    let mut r = ProcessRequest::new();
    r.container_id = container.into();
    r.exec_id = exec_id.into();
    r
}
