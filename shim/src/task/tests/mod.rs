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
use containerd_shim::protos::protobuf::{MessageField, MessageFull};
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

/// Task API request `R` for container `id`, all else default: every
/// request of the task API names its container in a field `id`.
fn naming<R: MessageFull>(id: &str) -> R {
    let mut req = R::new();
    let field = R::descriptor().field_by_name("id").expect("an id field");
    field.set_singular_field(&mut req, id.to_string().into());
    req
}

/// The code of the error `r` must be; panics if `r` succeeded.
#[track_caller]
fn refused<T: std::fmt::Debug>(r: Result<T, ttrpc::Error>) -> Code {
    code(&r.expect_err("the request should have been refused"))
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
        let req = api::StartRequest {
            exec_id: exec_id.into(),
            ..naming(id)
        };
        self.svc.start(&ctx(), req).await.map(|r| r.pid)
    }

    /// Create task `id` running `args`, without stdio; its pid.
    async fn create_plain(&self, id: &str, args: &[&str]) -> u32 {
        self.create(id, args, "", "", false).await.expect("create")
    }

    /// Create and start task `id` running `args`, without stdio; its pid.
    async fn run(&self, id: &str, args: &[&str]) -> u32 {
        self.create_plain(id, args).await;
        self.start(id, "").await.expect("start")
    }

    async fn wait(&self, id: &str, exec_id: &str) -> u32 {
        let c = ctx();
        let req = api::WaitRequest {
            exec_id: exec_id.into(),
            ..naming(id)
        };
        tokio::time::timeout(Duration::from_secs(10), self.svc.wait(&c, req))
            .await
            .expect("wait timed out")
            .expect("wait")
            .exit_status
    }

    async fn state(&self, id: &str, exec_id: &str) -> Result<api::StateResponse, ttrpc::Error> {
        let req = api::StateRequest {
            exec_id: exec_id.into(),
            ..naming(id)
        };
        self.svc.state(&ctx(), req).await
    }

    /// The status State reports for process `exec_id` of `id`.
    async fn status(&self, id: &str, exec_id: &str) -> Status {
        let st = self.state(id, exec_id).await.expect("state");
        st.status.enum_value().expect("a known status")
    }

    async fn delete(&self, id: &str, exec_id: &str) -> Result<api::DeleteResponse, ttrpc::Error> {
        let req = api::DeleteRequest {
            exec_id: exec_id.into(),
            ..naming(id)
        };
        self.svc.delete(&ctx(), req).await
    }

    async fn kill(&self, id: &str, exec_id: &str, signal: u32) -> Result<api::Empty, ttrpc::Error> {
        let req = api::KillRequest {
            exec_id: exec_id.into(),
            signal,
            ..naming(id)
        };
        self.svc.kill(&ctx(), req).await
    }

    /// CloseIO for `id`'s stdin.
    async fn close_stdin(&self, id: &str) -> Result<api::Empty, ttrpc::Error> {
        let req = api::CloseIORequest {
            stdin: true,
            ..naming(id)
        };
        self.svc.close_io(&ctx(), req).await
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
            exec_id: exec_id.into(),
            stdout: stdout.into(),
            terminal,
            spec: MessageField::some(Any {
                value: process.to_string().into_bytes(),
                ..Default::default()
            }),
            ..naming(id)
        };
        self.svc.exec(&ctx(), req).await
    }
}

fn file_uri(p: &Path) -> String {
    format!("file://{}", p.display())
}
