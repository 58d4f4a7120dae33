//! The task service's background jobs: a started process's stdio pumps
//! and its waiter (which publishes the exit once the output drained), and
//! the sandbox's OOM watcher (TaskOOM events).

use std::time::Duration;

use containerd_shim::protos::events::task::{TaskExit, TaskOOM};
use containerd_shim::protos::protobuf::MessageField;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::state::{Exited, ProcState};
use super::{now, TaskService};
use crate::sandbox::Stream;
use crate::stdio::{self, StdioPaths};

impl TaskService {
    /// Start the stdio pumps and the exit watcher of a process that has just
    /// been started in the sandbox.
    pub(super) fn spawn_process_tasks(
        &self,
        id: &str,
        exec_id: &str,
        stdio: &StdioPaths,
    ) -> (Vec<JoinHandle<()>>, Option<watch::Sender<bool>>) {
        let sb = self.inner.sandbox.clone();
        let mut pumps = vec![tokio::spawn(stdio::pump_output(
            sb.clone(),
            id.to_string(),
            exec_id.to_string(),
            Stream::Stdout,
            stdio.stdout.clone(),
        ))];
        if !stdio.terminal {
            pumps.push(tokio::spawn(stdio::pump_output(
                sb.clone(),
                id.to_string(),
                exec_id.to_string(),
                Stream::Stderr,
                stdio.stderr.clone(),
            )));
        }
        let stdin_close = if stdio.stdin.is_empty() {
            None
        } else {
            let (tx, rx) = watch::channel(false);
            tokio::spawn(stdio::pump_stdin(
                sb,
                id.to_string(),
                exec_id.to_string(),
                stdio.stdin.clone(),
                rx,
            ));
            Some(tx)
        };
        (pumps, stdin_close)
    }

    /// Publish containerd's TaskOOM for container `id` if its OOM kill
    /// count `kills` is news.
    pub(super) async fn note_oom(&self, id: &str, kills: u64) {
        if self.seen_oom(id, kills) {
            tracing::warn!("{id}: the guest's OOM killer killed a process ({kills} so far)");
            self.publish(TaskOOM {
                container_id: id.to_string(),
                ..Default::default()
            })
            .await;
        }
    }

    /// Record that container `id` has had `kills` OOM kills; true if that
    /// is more than known before.
    pub(super) fn seen_oom(&self, id: &str, kills: u64) -> bool {
        let mut seen = self
            .inner
            .oom_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let before = seen.entry(id.to_string()).or_insert(0);
        let news = kills > *before;
        *before = (*before).max(kills);
        news
    }

    fn oom_seen(&self, id: &str) -> u64 {
        let seen = self
            .inner
            .oom_seen
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        seen.get(id).copied().unwrap_or(0)
    }

    /// Publish TaskOOM for container `id` each time the OOM killer strikes
    /// in it, until it or the sandbox is gone.
    pub(super) fn spawn_oom_watcher(&self, id: String) {
        let this = self.clone();
        tokio::spawn(async move {
            tracing::info!("{id}: watching the guest's OOM kills");
            loop {
                match this.inner.sandbox.wait_oom(&id, this.oom_seen(&id)).await {
                    Ok(kills) => this.note_oom(&id, kills).await,
                    Err(e) => {
                        tracing::info!("{id}: no more OOM events: {e}");
                        break;
                    }
                }
            }
        });
    }

    pub(super) fn spawn_waiter(&self, id: String, exec_id: String) {
        let this = self.clone();
        tokio::spawn(async move {
            let status = match this.inner.sandbox.wait(&id, &exec_id).await {
                Ok(s) => s.containerd_status(),
                Err(e) => {
                    tracing::error!("{id}/{exec_id}: lost the process: {e}");
                    255
                }
            };
            // A SIGKILL may be the OOM killer's: containerd learns of the
            // OOM before the exit, as with runc. The guest counts the kill
            // before the process is gone, so this answers at once if so.
            if status == 128 + 9 {
                let check = this.inner.sandbox.wait_oom(&id, this.oom_seen(&id));
                if let Ok(Ok(kills)) = tokio::time::timeout(Duration::from_secs(1), check).await {
                    this.note_oom(&id, kills).await;
                }
            }
            this.process_exited(&id, &exec_id, status).await;
        });
    }

    pub(super) async fn process_exited(&self, id: &str, exec_id: &str, exit_status: u32) {
        // Let the output drain first, so that containerd has all of it when
        // it learns of the exit.
        let pumps = {
            let mut st = self.lock();
            st.process_mut(id, exec_id)
                .map(|p| std::mem::take(&mut p.pumps))
                .unwrap_or_default()
        };
        for mut pump in pumps {
            if tokio::time::timeout(self.inner.io_drain, &mut pump)
                .await
                .is_err()
            {
                tracing::warn!(
                    "{id}/{exec_id}: output did not drain in {:?}",
                    self.inner.io_drain
                );
                pump.abort();
            }
        }
        let exited = Exited {
            status: exit_status,
            at: now(),
        };
        let pid = {
            let mut st = self.lock();
            let Some(p) = st.process_mut(id, exec_id) else {
                return;
            };
            p.state = ProcState::Stopped;
            p.exited = Some(exited.clone());
            // Dropping the sender ends the stdin pump.
            p.stdin_close = None;
            p.pid
        };
        self.publish(TaskExit {
            container_id: id.to_string(),
            id: if exec_id.is_empty() {
                id.to_string()
            } else {
                exec_id.to_string()
            },
            pid,
            exit_status,
            exited_at: MessageField::some(exited.at.clone()),
            ..Default::default()
        })
        .await;
        let st = self.lock();
        if let Some(p) = st.containers.get(id).and_then(|c| c.process(exec_id)) {
            p.exit_tx.send_replace(Some(exited));
        }
    }
}
