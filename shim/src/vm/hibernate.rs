//! Hibernation as the sandbox uses it: snapshot the VM to `<snapshot_dir>/
//! <namespace>/<sandbox id>/` and stop burrow-vmm (no process, no guest RAM
//! on the host) while containerd still sees the task running; restore it
//! transparently on the next call that needs the guest. The state machine
//! (phases, the incremental chain, waking) is the
//! [`Lifecycle`](super::lifecycle::Lifecycle)'s; this file holds its two
//! triggers and the manifest each link gets:
//!
//! - Hibernate on idle: `hibernate_idle_secs` (config) or the annotation
//!   `io.burrow.hibernate_idle_secs`; a timer hibernates after that long
//!   with no exec, no stdio traffic and no RPC that reached the guest.
//! - A control socket `<state dir>/control.sock` takes JSON lines
//!   `{"cmd":"hibernate"|"wake"|"status"}` or
//!   `{"cmd":"checkpoint","name":NAME}` (see [`super::named`]) and answers
//!   `{"ok":true,"state":PHASE}` (the lifecycle's phase name: `running`,
//!   `paused`, `snapshotting`, `asleep`, ...; with `"dir"` for a
//!   checkpoint) or `{"ok":false,"error":"..."}` (the `burrow sandbox`
//!   verbs use it).

use std::time::{Duration, Instant};

use serde::Deserialize;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use super::checkpoint;
use super::lifecycle::Phase;
use super::VmSandbox;
use crate::sandbox::Result;
use crate::spec;

pub use super::lifecycle::MAX_CHAIN;

/// The control socket's file name in the sandbox's state directory.
pub const CONTROL_SOCKET: &str = "control.sock";
/// Longest control request line.
const MAX_REQUEST: u64 = 4096;

impl VmSandbox {
    /// Record activity (resets the idle timer).
    pub(super) fn touch(&self) {
        *self.last_activity.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    fn idle_for(&self) -> Duration {
        self.last_activity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed()
    }

    /// Snapshot the VM and stop burrow-vmm. A no-op when already asleep.
    pub async fn hibernate(&self) -> Result<()> {
        let c = self.the_container()?;
        let dir = self.vm.hibernate_dir().to_path_buf();
        self.vm
            .hibernate(|info, link| {
                let r = checkpoint::complete_hibernation(&dir, &c, info, link);
                async { r }
            })
            .await
    }

    /// Restore a hibernated VM and reconnect. A no-op when it runs.
    pub async fn wake(&self) -> Result<()> {
        self.touch();
        self.vm.wake().await
    }

    /// After a container's VM is up: the control socket, and the idle timer
    /// if the config or the spec asks for one.
    pub(super) fn started(&self, container_spec: &serde_json::Value) {
        self.touch();
        let idle = spec::annotation(container_spec, spec::ANNOTATION_HIBERNATE_IDLE)
            .and_then(|v| v.trim().parse::<u64>().ok())
            .or_else(|| self.cfg().ok().map(|c| c.hibernate_idle_secs))
            .unwrap_or(0);
        let sock = self.path(CONTROL_SOCKET);
        let _ = std::fs::remove_file(&sock);
        match UnixListener::bind(&sock) {
            Ok(l) => {
                tokio::spawn(serve_control(self.me.clone(), l));
            }
            Err(e) => tracing::warn!("control socket {}: {e}", sock.display()),
        }
        if idle > 0 {
            tracing::info!("hibernating after {idle}s idle");
            tokio::spawn(idle_timer(self.me.clone(), Duration::from_secs(idle)));
        }
    }
}

async fn idle_timer(me: std::sync::Weak<VmSandbox>, idle: Duration) {
    let tick = Duration::from_secs(1).min(idle);
    loop {
        tokio::time::sleep(tick).await;
        let Some(sb) = me.upgrade() else { return };
        match sb.vm.phase() {
            // The VM was stopped for good.
            Phase::Gone(_) => return,
            Phase::Running(_) if sb.idle_for() >= idle => {
                tracing::info!("idle for {}s: hibernating", idle.as_secs());
                if let Err(e) = sb.hibernate().await {
                    tracing::warn!("hibernate on idle: {e}");
                    sb.touch();
                }
            }
            _ => {}
        }
    }
}

#[derive(Deserialize)]
struct Request {
    cmd: String,
    /// The checkpoint's name (`checkpoint`).
    #[serde(default)]
    name: Option<String>,
}

async fn serve_control(me: std::sync::Weak<VmSandbox>, l: UnixListener) {
    loop {
        let Ok((s, _)) = l.accept().await else { return };
        let Some(sb) = me.upgrade() else { return };
        tokio::spawn(async move {
            if let Err(e) = handle_control(&sb, s).await {
                tracing::debug!("control socket: {e}");
            }
        });
    }
}

async fn handle_control(sb: &VmSandbox, s: UnixStream) -> std::io::Result<()> {
    let (r, mut w) = s.into_split();
    let mut line = String::new();
    BufReader::new(r.take(MAX_REQUEST))
        .read_line(&mut line)
        .await?;
    let mut dir = None;
    let result = match serde_json::from_str::<Request>(line.trim()) {
        Err(e) => Err(format!("bad request: {e}")),
        Ok(req) => match req.cmd.as_str() {
            "hibernate" => sb.hibernate().await.map_err(|e| e.to_string()),
            "wake" => sb.wake().await.map_err(|e| e.to_string()),
            "status" => Ok(()),
            "checkpoint" => match req.name.as_deref() {
                None => Err("checkpoint: no name".to_string()),
                Some(name) => sb
                    .checkpoint_named(name)
                    .await
                    .map(|d| dir = Some(d))
                    .map_err(|e| e.to_string()),
            },
            other => Err(format!("unknown command {other:?}")),
        },
    };
    let state = sb.vm.phase().name();
    let reply = match result {
        Ok(()) => serde_json::json!({"ok": true, "state": state, "dir": dir}),
        Err(e) => serde_json::json!({"ok": false, "state": state, "error": e}),
    };
    w.write_all(format!("{reply}\n").as_bytes()).await?;
    w.shutdown().await
}
