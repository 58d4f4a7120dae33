//! containerd's task API v2, implemented on top of a [`Sandbox`].
//!
//! This is the containerd-facing state machine: which containers and
//! processes exist, their states, exit statuses and times, the stdio pumps,
//! and the events containerd expects. It knows nothing about VMs, so the
//! unit tests drive it in-process with a fake sandbox.
//!
//! Every RPC of the `Task` service is implemented explicitly; none falls
//! back to the generated "not supported" default. `Checkpoint` writes a
//! whole-VM checkpoint and Create with `checkpoint` restores one (see
//! `vm::snapshot` for the layout); `Update` with resources sets the
//! container's cgroup in the guest (and grows a pod's VM first when the
//! new limits need it: `vm::grow`).
//!
//! - [`state`]: containers, processes, their states (plain data, one mutex)
//!   and the one lookup the handlers use;
//! - [`jobs`]: per-process stdio pumps and waiter, the OOM watcher;
//! - [`handlers`]: the RPCs, each a check of the state, one sandbox call
//!   and its event;
//! - this file: the service, its error mapping and small helpers.

mod handlers;
mod jobs;
mod state;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use containerd_shim::asynchronous::ExitSignal;
use containerd_shim::event::Event;
use containerd_shim::protos::protobuf::well_known_types::any::Any;
use containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim::protos::protobuf::{Message, MessageDyn, MessageFull};
use containerd_shim::protos::shim::oci::CheckpointOptions;
use containerd_shim::protos::ttrpc::{self, Code};
use containerd_shim::TtrpcResult;

use crate::events::{send, EventSink};
use crate::sandbox::{Sandbox, SandboxError};
use crate::spec;

use self::state::State;

/// How long a process's exit waits for its output to drain before the exit
/// is reported anyway.
pub const DEFAULT_IO_DRAIN: Duration = Duration::from_secs(5);

/// Longest exec'd process spec (JSON) accepted.
pub const MAX_PROCESS_SPEC: usize = 256 * 1024;

struct Inner {
    sandbox: Arc<dyn Sandbox>,
    events: Arc<dyn EventSink>,
    exit: Arc<ExitSignal>,
    state: Mutex<State>,
    io_drain: Duration,
    /// OOM kills already published as TaskOOM, by container.
    oom_seen: Mutex<HashMap<String, u64>>,
    /// Whether the sandbox was torn down (its last container deleted).
    torn_down: tokio::sync::Mutex<bool>,
}

/// The task service containerd talks to. Cheap to clone.
#[derive(Clone)]
pub struct TaskService {
    inner: Arc<Inner>,
}

fn status(code: Code, msg: impl Into<String>) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, msg.into()))
}

/// Fail an RPC with `code` and `msg`.
fn fail<T>(code: Code, msg: impl Into<String>) -> TtrpcResult<T> {
    Err(status(code, msg))
}

fn not_found(what: impl std::fmt::Display) -> ttrpc::Error {
    status(Code::NOT_FOUND, format!("{what} not found"))
}

impl From<SandboxError> for ttrpc::Error {
    fn from(e: SandboxError) -> Self {
        status(e.code(), e.to_string())
    }
}

/// The current time as a protobuf timestamp.
pub fn now() -> Timestamp {
    let d = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    Timestamp {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
        ..Default::default()
    }
}

/// Check a container or exec id: non-empty, bounded, and safe as a path
/// component.
pub fn validate_id(kind: &str, id: &str) -> Result<(), ttrpc::Error> {
    if crate::is_plain_name(id, burrow_protocol::MAX_ID_LEN) {
        Ok(())
    } else {
        fail(
            Code::INVALID_ARGUMENT,
            format!(
                "invalid {kind} {id:?}: want 1..={} characters of [A-Za-z0-9_.-]",
                burrow_protocol::MAX_ID_LEN
            ),
        )
    }
}

/// runc's checkpoint options (`containerd.runc.v1.CheckpointOptions`),
/// which containerd sends from `ctr c checkpoint` (`ctr task checkpoint`
/// sends none to non-runc runtimes); none: the defaults. containerd 1.6
/// names the type without the `type.googleapis.com/` prefix.
fn checkpoint_options(options: Option<&Any>) -> TtrpcResult<CheckpointOptions> {
    let Some(any) = options.filter(|o| !o.type_url.is_empty()) else {
        return Ok(CheckpointOptions::default());
    };
    let name = any.type_url.rsplit('/').next().unwrap_or_default();
    if name != CheckpointOptions::descriptor().full_name() {
        return fail(
            Code::INVALID_ARGUMENT,
            format!("checkpoint options of type {name:?}: want runc's CheckpointOptions"),
        );
    }
    CheckpointOptions::parse_from_bytes(&any.value).map_err(|e| {
        status(
            Code::INVALID_ARGUMENT,
            format!("decoding the checkpoint options: {e}"),
        )
    })
}

fn to_any(msg: &dyn MessageDyn) -> TtrpcResult<Any> {
    let mut value = Vec::new();
    msg.write_to_vec_dyn(&mut value)
        .map_err(|e| status(Code::INTERNAL, format!("encoding {e}")))?;
    Ok(Any {
        type_url: msg.descriptor_dyn().full_name().to_string(),
        value,
        ..Default::default()
    })
}

impl TaskService {
    pub fn new(
        sandbox: Arc<dyn Sandbox>,
        events: Arc<dyn EventSink>,
        exit: Arc<ExitSignal>,
    ) -> Self {
        Self::with_io_drain(sandbox, events, exit, DEFAULT_IO_DRAIN)
    }

    pub fn with_io_drain(
        sandbox: Arc<dyn Sandbox>,
        events: Arc<dyn EventSink>,
        exit: Arc<ExitSignal>,
        io_drain: Duration,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                sandbox,
                events,
                exit,
                state: Mutex::new(State::default()),
                io_drain,
                oom_seen: Mutex::new(HashMap::new()),
                torn_down: tokio::sync::Mutex::new(false),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.inner
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn sandbox(&self) -> &dyn Sandbox {
        self.inner.sandbox.as_ref()
    }

    /// Publish `event` on the topic its type names.
    async fn publish<E: Event + MessageDyn + 'static>(&self, event: E) {
        send(self.inner.events.as_ref(), event).await;
    }

    /// Tear the sandbox down (stop its VM, remove its files) once it has
    /// no container left; later calls wait for the first and do nothing.
    /// The last Delete does it, not Shutdown: containerd gives Shutdown
    /// 3 s (`io.containerd.timeout.shim.shutdown`) and then kills the
    /// shim, and stopping a VM on a busy host can take longer, which left
    /// the shim's files behind.
    async fn tear_down_if_empty(&self) {
        let mut done = self.inner.torn_down.lock().await;
        if *done || self.container_count() > 0 {
            return;
        }
        let t = std::time::Instant::now();
        if let Err(e) = self.sandbox().shutdown().await {
            tracing::warn!("shutting the sandbox down: {e}");
        }
        tracing::info!("sandbox shut down in {} ms", t.elapsed().as_millis());
        *done = true;
    }

    /// Number of containers this shim still tracks.
    pub fn container_count(&self) -> usize {
        self.lock().containers.len()
    }

    fn read_bundle_spec(bundle: &str) -> TtrpcResult<serde_json::Value> {
        spec::read_spec(Path::new(bundle))
            .map_err(|e| status(Code::INVALID_ARGUMENT, e.to_string()))
    }
}
