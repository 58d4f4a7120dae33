//! In-process tests of the task service against the fake sandbox (no KVM):
//! the harness; [`processes`] (lifecycle, output, exits, exec, stdin, pause,
//! OOM, restore, crash) and [`rpcs`] (refusals and the other RPCs).

mod processes;
mod rpcs;

use std::collections::HashMap;
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use containerd_shim::api;
use containerd_shim::asynchronous::ExitSignal;
use containerd_shim::protos::protobuf::well_known_types::any::Any;
use containerd_shim::protos::protobuf::MessageField;
use containerd_shim::protos::shim_async::Task;
use containerd_shim::protos::ttrpc::r#async::TtrpcContext;
use containerd_shim::protos::ttrpc::{self, Code};
use containerd_shim::protos::types::task::Status;
use tokio::io::AsyncReadExt;

use crate::events::RecordedEvents;
use crate::fake::FakeSandbox;
use crate::task::TaskService;

fn ctx() -> TtrpcContext {
    TtrpcContext {
        mh: Default::default(),
        metadata: HashMap::new(),
        timeout_nano: 0,
    }
}

fn code(e: &ttrpc::Error) -> Code {
    match e {
        ttrpc::Error::RpcStatus(s) => s.code(),
        _ => Code::UNKNOWN,
    }
}

fn message(e: &ttrpc::Error) -> String {
    match e {
        ttrpc::Error::RpcStatus(s) => s.message.clone(),
        other => other.to_string(),
    }
}

struct H {
    svc: TaskService,
    sb: FakeSandbox,
    ev: RecordedEvents,
    exit: Arc<ExitSignal>,
    dir: tempfile::TempDir,
}

impl H {
    fn new() -> Self {
        let sb = FakeSandbox::default();
        let ev = RecordedEvents::default();
        let exit = Arc::new(ExitSignal::default());
        let svc = TaskService::with_io_drain(
            Arc::new(sb.clone()),
            Arc::new(ev.clone()),
            exit.clone(),
            Duration::from_secs(2),
        );
        Self {
            svc,
            sb,
            ev,
            exit,
            dir: tempfile::tempdir().expect("tempdir"),
        }
    }

    /// `/tasks/oom` events published so far.
    fn ooms(&self) -> usize {
        self.ev
            .topics()
            .iter()
            .filter(|t| *t == "/tasks/oom")
            .count()
    }

    /// Wait (5 s at most, else fail saying `why`) for `n` OOM events.
    async fn wait_ooms(&self, n: usize, why: &str) {
        let start = std::time::Instant::now();
        while self.ooms() < n {
            assert!(start.elapsed() < Duration::from_secs(5), "{why}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn bundle(&self, id: &str, args: &[&str]) -> String {
        let b = self.path(id);
        std::fs::create_dir_all(&b).expect("bundle dir");
        let spec =
            serde_json::json!({"ociVersion": "1.0.2", "process": {"args": args, "cwd": "/"}});
        std::fs::write(b.join("config.json"), spec.to_string()).expect("config.json");
        b.display().to_string()
    }

    fn fifo(&self, name: &str) -> String {
        let p = self.path(name);
        let c = CString::new(p.display().to_string()).expect("path");
        // SAFETY: c is a valid NUL-terminated path.
        let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
        assert_eq!(rc, 0, "mkfifo {}", p.display());
        p.display().to_string()
    }

    async fn create(
        &self,
        id: &str,
        args: &[&str],
        stdout: &str,
        stdin: &str,
        terminal: bool,
    ) -> Result<u32, ttrpc::Error> {
        let req = api::CreateTaskRequest {
            id: id.into(),
            bundle: self.bundle(id, args),
            stdout: stdout.into(),
            stdin: stdin.into(),
            terminal,
            ..Default::default()
        };
        self.svc.create(&ctx(), req).await.map(|r| r.pid)
    }

    async fn start(&self, id: &str, exec_id: &str) -> Result<u32, ttrpc::Error> {
        self.svc
            .start(
                &ctx(),
                api::StartRequest {
                    id: id.into(),
                    exec_id: exec_id.into(),
                    ..Default::default()
                },
            )
            .await
            .map(|r| r.pid)
    }

    async fn wait(&self, id: &str, exec_id: &str) -> u32 {
        let c = ctx();
        let w = self.svc.wait(
            &c,
            api::WaitRequest {
                id: id.into(),
                exec_id: exec_id.into(),
                ..Default::default()
            },
        );
        tokio::time::timeout(Duration::from_secs(10), w)
            .await
            .expect("wait timed out")
            .expect("wait")
            .exit_status
    }

    async fn state(&self, id: &str, exec_id: &str) -> api::StateResponse {
        self.svc
            .state(
                &ctx(),
                api::StateRequest {
                    id: id.into(),
                    exec_id: exec_id.into(),
                    ..Default::default()
                },
            )
            .await
            .expect("state")
    }

    async fn delete(&self, id: &str, exec_id: &str) -> Result<api::DeleteResponse, ttrpc::Error> {
        self.svc
            .delete(
                &ctx(),
                api::DeleteRequest {
                    id: id.into(),
                    exec_id: exec_id.into(),
                    ..Default::default()
                },
            )
            .await
    }

    async fn kill(&self, id: &str, exec_id: &str, signal: u32) -> Result<api::Empty, ttrpc::Error> {
        self.svc
            .kill(
                &ctx(),
                api::KillRequest {
                    id: id.into(),
                    exec_id: exec_id.into(),
                    signal,
                    ..Default::default()
                },
            )
            .await
    }

    async fn exec(
        &self,
        id: &str,
        exec_id: &str,
        args: &[&str],
        stdout: &str,
        terminal: bool,
    ) -> Result<api::Empty, ttrpc::Error> {
        let process = serde_json::json!({"args": args, "cwd": "/"});
        let req = api::ExecProcessRequest {
            id: id.into(),
            exec_id: exec_id.into(),
            stdout: stdout.into(),
            terminal,
            spec: MessageField::some(Any {
                value: process.to_string().into_bytes(),
                ..Default::default()
            }),
            ..Default::default()
        };
        self.svc.exec(&ctx(), req).await
    }
}

fn file_uri(p: &Path) -> String {
    format!("file://{}", p.display())
}
