//! An in-process [`Sandbox`] for unit tests of the task service: processes
//! are tiny scripts chosen by their first argument.
//!
//! - `echo ARGS...`: writes ARGS joined by spaces and a newline to stdout,
//!   `err` as first word writes to stderr instead; exits 0
//! - `exit N`: exits with N
//! - `cat`: copies stdin to stdout until stdin is closed, then exits 0
//! - anything else (`sleep`): runs until signalled

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};

use async_trait::async_trait;
use tokio::sync::Notify;

use crate::sandbox::*;

#[derive(Default)]
struct Proc {
    pid: u32,
    started: bool,
    script: Vec<String>,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    exit: Option<ExitStatus>,
    stdin_closed: bool,
}

#[derive(Default)]
struct St {
    procs: HashMap<(String, String), Proc>,
    containers: Vec<String>,
    next_pid: u32,
    paused: bool,
    dead: bool,
    shutdown: bool,
    oom_kills: u64,
    restorable: bool,
    calls: Vec<String>,
}

/// The fake sandbox. Clone shares state.
#[derive(Default, Clone)]
pub struct FakeSandbox {
    st: Arc<Mutex<St>>,
    changed: Arc<Notify>,
}

fn args_of(v: &serde_json::Value) -> Vec<String> {
    v.get("args")
        .and_then(|a| a.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|s| s.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

impl FakeSandbox {
    fn lock(&self) -> MutexGuard<'_, St> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Simulate the VM dying (kill -9 of the VMM).
    pub fn crash(&self) {
        self.lock().dead = true;
        self.changed.notify_waiters();
    }

    /// Simulate the guest's OOM killer killing a process.
    pub fn oom_kill(&self) {
        self.lock().oom_kills += 1;
        self.changed.notify_waiters();
    }

    /// Let Create with a checkpoint "restore" and Checkpoint "write" one
    /// (off: the fake refuses both).
    pub fn allow_restore(&self) {
        self.lock().restorable = true;
    }

    pub fn paused(&self) -> bool {
        self.lock().paused
    }

    pub fn is_shut_down(&self) -> bool {
        self.lock().shutdown
    }

    pub fn containers(&self) -> Vec<String> {
        self.lock().containers.clone()
    }

    /// Calls made so far, as "name id/exec".
    pub fn calls(&self) -> Vec<String> {
        self.lock().calls.clone()
    }

    fn run_script(p: &mut Proc) {
        let first = p.script.first().cloned().unwrap_or_default();
        match first.as_str() {
            "echo" => {
                let rest = p.script.get(1..).unwrap_or_default();
                if rest.first().map(String::as_str) == Some("err") {
                    p.stderr.extend_from_slice(
                        format!("{}\n", rest.get(1..).unwrap_or_default().join(" ")).as_bytes(),
                    );
                } else {
                    p.stdout
                        .extend_from_slice(format!("{}\n", rest.join(" ")).as_bytes());
                }
                p.exit = Some(ExitStatus::Code(0));
            }
            "exit" => {
                let code = p.script.get(1).and_then(|c| c.parse().ok()).unwrap_or(1);
                p.exit = Some(ExitStatus::Code(code));
            }
            _ => {}
        }
    }

    fn with_proc<T>(
        &self,
        id: &str,
        exec_id: &str,
        call: &str,
        f: impl FnOnce(&mut Proc) -> Result<T>,
    ) -> Result<T> {
        let mut st = self.lock();
        let polling = call == "read" || call == "wait";
        if !polling {
            st.calls.push(format!("{call} {id}/{exec_id}"));
        }
        if st.dead {
            return Err(SandboxError::Unavailable("the VM is gone".into()));
        }
        let p = st
            .procs
            .get_mut(&(id.to_string(), exec_id.to_string()))
            .ok_or_else(|| SandboxError::NotFound(format!("process {id}/{exec_id}")))?;
        let r = f(p);
        drop(st);
        if !polling {
            self.changed.notify_waiters();
        }
        r
    }
}

#[async_trait]
impl Sandbox for FakeSandbox {
    async fn create_container(&self, cfg: &ContainerConfig) -> Result<u32> {
        let mut st = self.lock();
        st.calls.push(format!("create {}", cfg.id));
        if st.containers.contains(&cfg.id) {
            return Err(SandboxError::AlreadyExists(cfg.id.clone()));
        }
        st.next_pid += 1;
        let pid = st.next_pid;
        let script = cfg.spec.get("process").map(args_of).unwrap_or_default();
        st.containers.push(cfg.id.clone());
        st.procs.insert(
            (cfg.id.clone(), String::new()),
            Proc {
                pid,
                script,
                ..Default::default()
            },
        );
        Ok(pid)
    }

    async fn start_container(&self, id: &str) -> Result<()> {
        self.with_proc(id, "", "start", |p| {
            // A program the image lacks: exec fails as the guest reports it.
            if p.script.first().map(String::as_str) == Some("missing") {
                return Err(SandboxError::NotFound(
                    "starting the process failed at exec \"missing\"".into(),
                ));
            }
            p.started = true;
            Self::run_script(p);
            Ok(())
        })
    }

    async fn delete_container(&self, id: &str) -> Result<()> {
        let mut st = self.lock();
        st.calls.push(format!("delete {id}"));
        st.containers.retain(|c| c != id);
        st.procs.retain(|(c, _), _| c != id);
        Ok(())
    }

    async fn exec_process(&self, id: &str, exec_id: &str, cfg: &ExecConfig) -> Result<u32> {
        let mut st = self.lock();
        st.calls.push(format!("exec {id}/{exec_id}"));
        if st.dead {
            return Err(SandboxError::Unavailable("the VM is gone".into()));
        }
        st.next_pid += 1;
        let pid = st.next_pid;
        let mut p = Proc {
            pid,
            started: true,
            script: args_of(&cfg.process),
            ..Default::default()
        };
        Self::run_script(&mut p);
        st.procs.insert((id.to_string(), exec_id.to_string()), p);
        drop(st);
        self.changed.notify_waiters();
        Ok(pid)
    }

    async fn delete_process(&self, id: &str, exec_id: &str) -> Result<()> {
        let mut st = self.lock();
        st.calls.push(format!("delete {id}/{exec_id}"));
        st.procs.remove(&(id.to_string(), exec_id.to_string()));
        Ok(())
    }

    async fn signal(&self, id: &str, exec_id: &str, signal: u32, all: bool) -> Result<()> {
        if all {
            let mut st = self.lock();
            for ((c, _), p) in st.procs.iter_mut() {
                if c == id && p.exit.is_none() {
                    p.exit = Some(ExitStatus::Signal(signal));
                }
            }
            drop(st);
            self.changed.notify_waiters();
            return Ok(());
        }
        self.with_proc(id, exec_id, "signal", |p| {
            if p.exit.is_none() {
                p.exit = Some(ExitStatus::Signal(signal));
            }
            Ok(())
        })
    }

    async fn wait(&self, id: &str, exec_id: &str) -> Result<ExitStatus> {
        loop {
            let notified = self.changed.notified();
            if let Some(e) = self.with_proc(id, exec_id, "wait", |p| Ok(p.exit))? {
                return Ok(e);
            }
            notified.await;
        }
    }

    async fn read_output(&self, id: &str, exec_id: &str, stream: Stream) -> Result<Chunk> {
        loop {
            let notified = self.changed.notified();
            let c = self.with_proc(id, exec_id, "read", |p| {
                let buf = match stream {
                    Stream::Stdout => &mut p.stdout,
                    Stream::Stderr => &mut p.stderr,
                };
                let n = buf.len().min(OUTPUT_CHUNK);
                let data: Vec<u8> = buf.drain(..n).collect();
                let eof = data.is_empty() && p.exit.is_some();
                Ok((!data.is_empty() || eof).then_some(Chunk { data, eof }))
            })?;
            if let Some(c) = c {
                return Ok(c);
            }
            notified.await;
        }
    }

    async fn write_stdin(&self, id: &str, exec_id: &str, data: &[u8]) -> Result<usize> {
        self.with_proc(id, exec_id, "write", |p| {
            if p.stdin_closed || p.exit.is_some() {
                return Err(SandboxError::FailedPrecondition("stdin closed".into()));
            }
            // Accept at most 3 bytes per call to exercise partial writes.
            let n = data.len().min(3);
            if p.script.first().map(String::as_str) == Some("cat") {
                p.stdout
                    .extend_from_slice(data.get(..n).unwrap_or_default());
            }
            Ok(n)
        })
    }

    async fn close_stdin(&self, id: &str, exec_id: &str) -> Result<()> {
        self.with_proc(id, exec_id, "close_stdin", |p| {
            p.stdin_closed = true;
            if p.script.first().map(String::as_str) == Some("cat") && p.exit.is_none() {
                p.exit = Some(ExitStatus::Code(0));
            }
            Ok(())
        })
    }

    async fn resize_pty(&self, id: &str, exec_id: &str, rows: u32, cols: u32) -> Result<()> {
        self.with_proc(id, exec_id, &format!("resize {rows}x{cols}"), |_| Ok(()))
    }

    async fn processes(&self, id: &str) -> Result<Vec<ProcessEntry>> {
        let st = self.lock();
        let mut v: Vec<ProcessEntry> = st
            .procs
            .iter()
            .filter(|((c, _), p)| c == id && p.started)
            .map(|((_, e), p)| ProcessEntry {
                exec_id: e.clone(),
                pid: p.pid,
                running: p.exit.is_none(),
            })
            .collect();
        v.sort_by_key(|p| p.pid);
        Ok(v)
    }

    async fn pause(&self) -> Result<()> {
        self.lock().paused = true;
        Ok(())
    }

    async fn resume(&self) -> Result<()> {
        self.lock().paused = false;
        Ok(())
    }

    async fn stats(&self, _id: &str) -> Result<SandboxStats> {
        Ok(SandboxStats {
            cpu_usage_usec: 42,
            memory_bytes: 1 << 20,
            memory_limit_bytes: 1 << 29,
            pids: 1,
            oom_kills: self.lock().oom_kills,
        })
    }

    async fn wait_oom(&self, _id: &str, seen: u64) -> Result<u64> {
        loop {
            let notified = self.changed.notified();
            {
                let st = self.lock();
                if st.dead || st.shutdown {
                    return Err(SandboxError::Unavailable("the fake VM is gone".into()));
                }
                if st.oom_kills > seen {
                    return Ok(st.oom_kills);
                }
            }
            notified.await;
        }
    }

    async fn oom_kills(&self, _id: &str) -> Result<u64> {
        Ok(self.lock().oom_kills)
    }

    async fn update_resources(&self, id: &str, resources: &[u8]) -> Result<()> {
        let r = String::from_utf8_lossy(resources);
        self.lock().calls.push(format!("update {id} {r}"));
        Ok(())
    }

    fn named_checkpoint(&self, name: &str) -> Result<std::path::PathBuf> {
        Ok(Path::new("/named").join(name))
    }

    /// A "checkpoint" only records the call.
    async fn checkpoint(&self, dir: &Path, after: AfterCheckpoint) -> Result<()> {
        let mut st = self.lock();
        if !st.restorable {
            return Err(SandboxError::Unimplemented(
                "this sandbox cannot be checkpointed".into(),
            ));
        }
        st.calls
            .push(format!("checkpoint to {} then {after:?}", dir.display()));
        Ok(())
    }

    /// A "restore" is a create whose process runs already.
    async fn restore_container(&self, cfg: &ContainerConfig, dir: &Path) -> Result<u32> {
        if !self.lock().restorable {
            return Err(SandboxError::Unimplemented(
                "this sandbox cannot restore checkpoints".into(),
            ));
        }
        self.lock()
            .calls
            .push(format!("restore {} from {}", cfg.id, dir.display()));
        let pid = self.create_container(cfg).await?;
        self.start_container(&cfg.id).await?;
        Ok(pid)
    }

    async fn shutdown(&self) -> Result<()> {
        self.lock().shutdown = true;
        Ok(())
    }
}
