//! What the task service knows: containers, their init and exec'd
//! processes, states, exit statuses and times, and whether the sandbox is
//! paused. Plain data under one mutex ([`super::TaskService`] holds it); the
//! lookups answer containerd's NOT_FOUND themselves.

use std::collections::HashMap;

use containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim::protos::types::task::Status;
use containerd_shim::TtrpcResult;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use containerd_shim::protos::ttrpc::Code;

use super::{fail, not_found};
use crate::sandbox::ExecConfig;
use crate::stdio::StdioPaths;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ProcState {
    Created,
    Running,
    Stopped,
}

#[derive(Debug, Clone)]
pub(super) struct Exited {
    pub(super) status: u32,
    pub(super) at: Timestamp,
}

pub(super) struct Process {
    pub(super) pid: u32,
    pub(super) state: ProcState,
    pub(super) stdio: StdioPaths,
    pub(super) exited: Option<Exited>,
    pub(super) exit_tx: watch::Sender<Option<Exited>>,
    /// For exec'd processes not started yet.
    pub(super) exec: Option<ExecConfig>,
    pub(super) stdin_close: Option<watch::Sender<bool>>,
    pub(super) pumps: Vec<JoinHandle<()>>,
    /// Init of a task restored from a checkpoint: it runs already, Start
    /// only attaches stdio and the exit watcher.
    pub(super) restored: bool,
}

impl Process {
    pub(super) fn new(pid: u32, stdio: StdioPaths, exec: Option<ExecConfig>) -> Self {
        let (exit_tx, _) = watch::channel(None);
        Self {
            pid,
            state: ProcState::Created,
            stdio,
            exited: None,
            exit_tx,
            exec,
            stdin_close: None,
            pumps: Vec::new(),
            restored: false,
        }
    }

    pub(super) fn status(&self, paused: bool) -> Status {
        match self.state {
            ProcState::Created => Status::CREATED,
            ProcState::Running if paused => Status::PAUSED,
            ProcState::Running => Status::RUNNING,
            ProcState::Stopped => Status::STOPPED,
        }
    }
}

pub(super) struct Container {
    pub(super) bundle: String,
    pub(super) init: Process,
    pub(super) execs: HashMap<String, Process>,
}

impl Container {
    /// Refuse unless container `id`'s init runs.
    pub(super) fn require_running(&self, id: &str) -> TtrpcResult<()> {
        if self.init.state == ProcState::Running {
            Ok(())
        } else {
            fail(
                Code::FAILED_PRECONDITION,
                format!("container {id} is not running"),
            )
        }
    }

    pub(super) fn process(&self, exec_id: &str) -> Option<&Process> {
        if exec_id.is_empty() {
            Some(&self.init)
        } else {
            self.execs.get(exec_id)
        }
    }
    pub(super) fn process_mut(&mut self, exec_id: &str) -> Option<&mut Process> {
        if exec_id.is_empty() {
            Some(&mut self.init)
        } else {
            self.execs.get_mut(exec_id)
        }
    }
}

#[derive(Default)]
pub(super) struct State {
    pub(super) containers: HashMap<String, Container>,
    /// Ids whose Create is in progress.
    pub(super) creating: std::collections::HashSet<String>,
    pub(super) paused: bool,
}

impl State {
    /// Container `id`, or NOT_FOUND.
    pub(super) fn container(&self, id: &str) -> TtrpcResult<&Container> {
        self.containers
            .get(id)
            .ok_or_else(|| not_found(format!("container {id}")))
    }

    /// Container `id`, or NOT_FOUND.
    pub(super) fn container_mut(&mut self, id: &str) -> TtrpcResult<&mut Container> {
        self.containers
            .get_mut(id)
            .ok_or_else(|| not_found(format!("container {id}")))
    }

    /// Process `exec_id` ("" for init) of container `id` with its
    /// container, or NOT_FOUND.
    pub(super) fn process(&self, id: &str, exec_id: &str) -> TtrpcResult<(&Container, &Process)> {
        let c = self.container(id)?;
        let p = c
            .process(exec_id)
            .ok_or_else(|| not_found(format!("process {exec_id}")))?;
        Ok((c, p))
    }

    /// Process `exec_id` of container `id`, if both are still there.
    pub(super) fn process_mut(&mut self, id: &str, exec_id: &str) -> Option<&mut Process> {
        self.containers
            .get_mut(id)
            .and_then(|c| c.process_mut(exec_id))
    }
}
