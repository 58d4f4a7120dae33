//! In-process tests of the task service against the fake sandbox (no KVM).

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

#[tokio::test]
async fn lifecycle_output_and_events() {
    let h = H::new();
    let out = h.path("out.log");
    let pid = h
        .create(
            "c1",
            &["echo", "hello", "burrow"],
            &file_uri(&out),
            "",
            false,
        )
        .await
        .expect("create");
    assert!(pid > 0);
    assert_eq!(
        h.state("c1", "").await.status.enum_value(),
        Ok(Status::CREATED)
    );
    assert_eq!(h.start("c1", "").await.expect("start"), pid);
    assert_eq!(h.wait("c1", "").await, 0);
    let st = h.state("c1", "").await;
    assert_eq!(st.status.enum_value(), Ok(Status::STOPPED));
    assert!(st.exited_at.is_some());
    // The exit is reported only after the output has been written.
    assert_eq!(
        std::fs::read_to_string(&out).expect("output"),
        "hello burrow\n"
    );
    let d = h.delete("c1", "").await.expect("delete");
    assert_eq!((d.pid, d.exit_status), (pid, 0));
    assert!(h.sb.containers().is_empty());
    assert_eq!(
        h.ev.topics(),
        [
            "/tasks/create",
            "/tasks/start",
            "/tasks/exit",
            "/tasks/delete"
        ]
    );
    let err = h.delete("c1", "").await.expect_err("second delete");
    assert_eq!(code(&err), Code::NOT_FOUND);
}

#[tokio::test]
async fn output_through_a_fifo() {
    let h = H::new();
    let fifo = h.fifo("stdout");
    // containerd holds the read side open before Create.
    let mut rx = tokio::net::unix::pipe::OpenOptions::new()
        .open_receiver(&fifo)
        .expect("reader");
    h.create("c1", &["echo", "via", "fifo"], &fifo, "", false)
        .await
        .expect("create");
    h.start("c1", "").await.expect("start");
    assert_eq!(h.wait("c1", "").await, 0);
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), rx.read_to_end(&mut got))
        .await
        .expect("eof")
        .expect("read");
    assert_eq!(got, b"via fifo\n");
}

#[tokio::test]
async fn exit_codes_and_signals() {
    let h = H::new();
    h.create("c7", &["exit", "7"], "", "", false)
        .await
        .expect("create");
    h.start("c7", "").await.expect("start");
    assert_eq!(h.wait("c7", "").await, 7);
    let err = h.kill("c7", "", 9).await.expect_err("kill after exit");
    assert_eq!(code(&err), Code::NOT_FOUND, "{}", message(&err));

    h.create("s", &["sleep"], "", "", false)
        .await
        .expect("create");
    h.start("s", "").await.expect("start");
    assert_eq!(
        h.state("s", "").await.status.enum_value(),
        Ok(Status::RUNNING)
    );
    let err = h.delete("s", "").await.expect_err("delete while running");
    assert_eq!(code(&err), Code::FAILED_PRECONDITION);
    let err = h.kill("s", "", 0).await.expect_err("signal 0");
    assert_eq!(code(&err), Code::INVALID_ARGUMENT);
    h.kill("s", "", 15).await.expect("kill");
    assert_eq!(h.wait("s", "").await, 128 + 15);
    assert_eq!(h.delete("s", "").await.expect("delete").exit_status, 143);
}

#[tokio::test]
async fn exec_pids_and_exec_events() {
    let h = H::new();
    h.create("c", &["sleep"], "", "", false)
        .await
        .expect("create");
    let err = h
        .exec("c", "e1", &["echo", "x"], "", false)
        .await
        .expect_err("exec before start");
    assert_eq!(code(&err), Code::FAILED_PRECONDITION);
    let init = h.start("c", "").await.expect("start");
    let out = h.path("exec.log");
    h.exec("c", "e1", &["echo", "from", "exec"], &file_uri(&out), false)
        .await
        .expect("exec");
    let err = h
        .exec("c", "e1", &["echo"], "", false)
        .await
        .expect_err("dup exec");
    assert_eq!(code(&err), Code::ALREADY_EXISTS);
    assert_eq!(
        h.state("c", "e1").await.status.enum_value(),
        Ok(Status::CREATED)
    );
    let pid = h.start("c", "e1").await.expect("start exec");
    assert_ne!(pid, init);
    assert_eq!(h.wait("c", "e1").await, 0);
    assert_eq!(
        std::fs::read_to_string(&out).expect("exec output"),
        "from exec\n"
    );

    h.exec("c", "e2", &["sleep"], "", false)
        .await
        .expect("exec 2");
    let pid2 = h.start("c", "e2").await.expect("start exec 2");
    let pids = h
        .svc
        .pids(
            &ctx(),
            api::PidsRequest {
                id: "c".into(),
                ..Default::default()
            },
        )
        .await
        .expect("pids");
    let listed: Vec<u32> = pids.processes.iter().map(|p| p.pid).collect();
    assert!(
        listed.contains(&init) && listed.contains(&pid2),
        "{listed:?}"
    );
    assert!(pids.processes.iter().any(|p| p.info.is_some()));

    let err = h
        .delete("c", "")
        .await
        .expect_err("delete init with a running exec");
    assert_eq!(code(&err), Code::FAILED_PRECONDITION);
    h.kill("c", "e2", 9).await.expect("kill exec");
    assert_eq!(h.wait("c", "e2").await, 137);
    assert_eq!(h.delete("c", "e1").await.expect("delete e1").pid, pid);
    h.delete("c", "e2").await.expect("delete e2");
    let err = h
        .svc
        .state(
            &ctx(),
            api::StateRequest {
                id: "c".into(),
                exec_id: "e1".into(),
                ..Default::default()
            },
        )
        .await
        .expect_err("deleted exec");
    assert_eq!(code(&err), Code::NOT_FOUND);
    h.kill("c", "", 9).await.expect("kill init");
    h.wait("c", "").await;
    h.delete("c", "").await.expect("delete");
    let topics = h.ev.topics();
    for t in ["/tasks/exec-added", "/tasks/exec-started"] {
        assert!(topics.iter().any(|x| x == t), "{t} missing from {topics:?}");
    }
    let exits =
        h.ev.events
            .lock()
            .expect("events")
            .iter()
            .filter(|(t, _)| t == "/tasks/exit")
            .count();
    assert_eq!(exits, 3);
}

#[tokio::test]
async fn stdin_fifo_partial_writes_and_close_io() {
    let h = H::new();
    let fifo = h.fifo("stdin");
    let out = h.path("cat.log");
    h.create("cat", &["cat"], &file_uri(&out), &fifo, false)
        .await
        .expect("create");
    h.start("cat", "").await.expect("start");
    // containerd's side of the stdin FIFO.
    // (The shim opens its end asynchronously; a writer cannot open before.)
    let mut tx = None;
    for _ in 0..500 {
        if let Ok(s) = tokio::net::unix::pipe::OpenOptions::new().open_sender(&fifo) {
            tx = Some(s);
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut tx = tx.expect("the shim opened the stdin FIFO");
    use tokio::io::AsyncWriteExt;
    tx.write_all(b"hello through stdin\n").await.expect("write");
    drop(tx);
    h.svc
        .close_io(
            &ctx(),
            api::CloseIORequest {
                id: "cat".into(),
                stdin: true,
                ..Default::default()
            },
        )
        .await
        .expect("close io");
    assert_eq!(h.wait("cat", "").await, 0);
    assert_eq!(
        std::fs::read_to_string(&out).expect("out"),
        "hello through stdin\n"
    );
}

#[tokio::test]
async fn close_io_without_stdin_pump_closes_directly() {
    let h = H::new();
    h.create("cat", &["cat"], "", "", false)
        .await
        .expect("create");
    h.start("cat", "").await.expect("start");
    h.svc
        .close_io(
            &ctx(),
            api::CloseIORequest {
                id: "cat".into(),
                stdin: true,
                ..Default::default()
            },
        )
        .await
        .expect("close io");
    assert_eq!(h.wait("cat", "").await, 0);
}

#[tokio::test]
async fn pause_and_resume() {
    let h = H::new();
    h.create("p", &["sleep"], "", "", false)
        .await
        .expect("create");
    let err = h
        .svc
        .pause(
            &ctx(),
            api::PauseRequest {
                id: "p".into(),
                ..Default::default()
            },
        )
        .await
        .expect_err("pause created");
    assert_eq!(code(&err), Code::FAILED_PRECONDITION);
    h.start("p", "").await.expect("start");
    h.svc
        .pause(
            &ctx(),
            api::PauseRequest {
                id: "p".into(),
                ..Default::default()
            },
        )
        .await
        .expect("pause");
    assert!(h.sb.paused());
    assert_eq!(
        h.state("p", "").await.status.enum_value(),
        Ok(Status::PAUSED)
    );
    h.svc
        .resume(
            &ctx(),
            api::ResumeRequest {
                id: "p".into(),
                ..Default::default()
            },
        )
        .await
        .expect("resume");
    assert!(!h.sb.paused());
    assert_eq!(
        h.state("p", "").await.status.enum_value(),
        Ok(Status::RUNNING)
    );
    let err = h
        .svc
        .resume(
            &ctx(),
            api::ResumeRequest {
                id: "p".into(),
                ..Default::default()
            },
        )
        .await
        .expect_err("resume twice");
    assert_eq!(code(&err), Code::FAILED_PRECONDITION);
    let topics = h.ev.topics();
    assert!(
        topics.contains(&"/tasks/paused".to_string())
            && topics.contains(&"/tasks/resumed".to_string())
    );
}

#[tokio::test]
async fn guest_oom_kills_become_task_oom_events() {
    let h = H::new();
    h.create("c", &["sleep"], "", "", false)
        .await
        .expect("create");
    h.start("c", "").await.expect("start");
    for n in 1..=2 {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        h.sb.oom_kill();
        h.wait_ooms(n, "no /tasks/oom event").await;
    }
    assert_eq!(h.ooms(), 2);
}

#[tokio::test]
async fn a_restored_task_reports_only_oom_kills_after_its_restore() {
    let h = H::new();
    h.sb.allow_restore();
    // The guest had two OOM kills before its checkpoint.
    h.sb.oom_kill();
    h.sb.oom_kill();
    let req = api::CreateTaskRequest {
        id: "r".into(),
        bundle: h.bundle("r", &["sleep"]),
        checkpoint: h.path("cp").display().to_string(),
        ..Default::default()
    };
    h.svc.create(&ctx(), req).await.expect("restore");
    h.start("r", "").await.expect("start");
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(
        h.ooms(),
        0,
        "old OOM kills reported as new: {:?}",
        h.ev.topics()
    );
    h.sb.oom_kill();
    h.wait_ooms(1, "a new OOM kill after the restore was not reported")
        .await;
    assert_eq!(h.ooms(), 1);
}

#[tokio::test]
async fn the_restore_annotation_restores_the_named_checkpoint() {
    let h = H::new();
    h.sb.allow_restore();
    let b = h.bundle("n", &["sleep"]);
    let spec = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {"args": ["sleep"], "cwd": "/"},
        "annotations": {"io.burrow.restore": "cp1"},
    });
    std::fs::write(Path::new(&b).join("config.json"), spec.to_string()).expect("config.json");
    let req = api::CreateTaskRequest {
        id: "n".into(),
        bundle: b,
        ..Default::default()
    };
    h.svc.create(&ctx(), req).await.expect("restore by name");
    assert!(
        h.sb.calls().contains(&"restore n from /named/cp1".to_string()),
        "{:?}",
        h.sb.calls()
    );
}

#[tokio::test]
async fn sandbox_crash_reports_exit_and_delete_cleans_up() {
    let h = H::new();
    h.create("c", &["sleep"], "", "", false)
        .await
        .expect("create");
    h.start("c", "").await.expect("start");
    h.sb.crash();
    assert_eq!(h.wait("c", "").await, 255);
    assert!(h.ev.topics().contains(&"/tasks/exit".to_string()));
    h.delete("c", "").await.expect("delete after crash");
    assert_eq!(h.svc.container_count(), 0);
}

#[tokio::test]
async fn bad_requests_leave_nothing_behind() {
    let h = H::new();
    // Malformed spec.
    let b = h.path("bad");
    std::fs::create_dir_all(&b).expect("dir");
    std::fs::write(b.join("config.json"), r#"{"process": {"args": "sh"}}"#).expect("write");
    let req = api::CreateTaskRequest {
        id: "bad".into(),
        bundle: b.display().to_string(),
        ..Default::default()
    };
    let err = h.svc.create(&ctx(), req).await.expect_err("malformed spec");
    assert_eq!(code(&err), Code::INVALID_ARGUMENT);
    assert!(message(&err).contains("process.args"), "{}", message(&err));
    // Bad ids, unsupported stdio, checkpoints.
    let bundle = h.bundle("ids", &["true"]);
    for id in ["", "..", "a/b", &"x".repeat(300)] {
        let req = api::CreateTaskRequest {
            id: id.into(),
            bundle: bundle.clone(),
            ..Default::default()
        };
        let err = h.svc.create(&ctx(), req).await.expect_err("bad id");
        assert_eq!(code(&err), Code::INVALID_ARGUMENT, "{id:?}");
    }
    let err = h
        .create("c", &["true"], "binary:///usr/bin/logger", "", false)
        .await
        .expect_err("binary log");
    assert_eq!(code(&err), Code::INVALID_ARGUMENT);
    let req = api::CreateTaskRequest {
        id: "cp".into(),
        bundle: h.bundle("cp", &["true"]),
        checkpoint: "/tmp/cp".into(),
        ..Default::default()
    };
    assert_eq!(
        code(&h.svc.create(&ctx(), req).await.expect_err("restore")),
        Code::UNIMPLEMENTED
    );
    assert!(h.sb.calls().is_empty(), "{:?}", h.sb.calls());
    assert_eq!(h.svc.container_count(), 0);
    assert!(h.ev.topics().is_empty());
    // Duplicate ids.
    h.create("c", &["sleep"], "", "", false)
        .await
        .expect("create");
    assert_eq!(
        code(
            &h.create("c", &["sleep"], "", "", false)
                .await
                .expect_err("dup")
        ),
        Code::ALREADY_EXISTS
    );
    // Malformed exec spec.
    h.start("c", "").await.expect("start");
    let req = api::ExecProcessRequest {
        id: "c".into(),
        exec_id: "e".into(),
        spec: MessageField::some(Any {
            value: b"{nope".to_vec(),
            ..Default::default()
        }),
        ..Default::default()
    };
    assert_eq!(
        code(&h.svc.exec(&ctx(), req).await.expect_err("bad exec")),
        Code::INVALID_ARGUMENT
    );
}

#[tokio::test]
async fn terminal_resize() {
    let h = H::new();
    h.create("plain", &["sleep"], "", "", false)
        .await
        .expect("create");
    h.start("plain", "").await.expect("start");
    let req = api::ResizePtyRequest {
        id: "plain".into(),
        width: 80,
        height: 24,
        ..Default::default()
    };
    assert_eq!(
        code(&h.svc.resize_pty(&ctx(), req).await.expect_err("no tty")),
        Code::FAILED_PRECONDITION
    );
    h.create("tty", &["sleep"], "", "", true)
        .await
        .expect("create");
    h.start("tty", "").await.expect("start");
    let req = api::ResizePtyRequest {
        id: "tty".into(),
        width: 100,
        height: 30,
        ..Default::default()
    };
    h.svc.resize_pty(&ctx(), req).await.expect("resize");
    assert!(
        h.sb.calls().iter().any(|c| c == "resize 30x100 tty/"),
        "{:?}",
        h.sb.calls()
    );
    h.exec("tty", "t", &["sleep"], "", true)
        .await
        .expect("exec");
    h.start("tty", "t").await.expect("start exec");
    let req = api::ResizePtyRequest {
        id: "tty".into(),
        exec_id: "t".into(),
        width: 10,
        height: 5,
        ..Default::default()
    };
    h.svc.resize_pty(&ctx(), req).await.expect("resize exec");
}

#[tokio::test]
async fn update_stats_checkpoint_connect() {
    let h = H::new();
    let pid = h
        .create("c", &["sleep"], "", "", false)
        .await
        .expect("create");
    h.start("c", "").await.expect("start");
    let req = api::UpdateTaskRequest {
        id: "c".into(),
        resources: MessageField::some(Any {
            value: b"{}".to_vec(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let err = h
        .svc
        .update(&ctx(), req)
        .await
        .expect_err("update resources");
    assert_eq!(code(&err), Code::UNIMPLEMENTED);
    assert!(message(&err).contains("fixed when it boots"));
    let mut ann = HashMap::new();
    ann.insert("a".to_string(), "b".to_string());
    h.svc
        .update(
            &ctx(),
            api::UpdateTaskRequest {
                id: "c".into(),
                annotations: ann,
                ..Default::default()
            },
        )
        .await
        .expect("update annotations");

    let s = h
        .svc
        .stats(
            &ctx(),
            api::StatsRequest {
                id: "c".into(),
                ..Default::default()
            },
        )
        .await
        .expect("stats");
    assert_eq!(s.stats.type_url, "io.containerd.cgroups.v2.Metrics");

    let err = h
        .svc
        .checkpoint(
            &ctx(),
            api::CheckpointTaskRequest {
                id: "c".into(),
                ..Default::default()
            },
        )
        .await
        .expect_err("checkpoint without a path");
    assert_eq!(code(&err), Code::INVALID_ARGUMENT);
    assert!(message(&err).contains("path"));
    // The fake sandbox cannot checkpoint: its refusal comes through.
    let err = h
        .svc
        .checkpoint(
            &ctx(),
            api::CheckpointTaskRequest {
                id: "c".into(),
                path: "/tmp/cp".into(),
                ..Default::default()
            },
        )
        .await
        .expect_err("checkpoint");
    assert_eq!(code(&err), Code::UNIMPLEMENTED);

    let c = h
        .svc
        .connect(
            &ctx(),
            api::ConnectRequest {
                id: "c".into(),
                ..Default::default()
            },
        )
        .await
        .expect("connect");
    assert_eq!(c.shim_pid, std::process::id());
    assert_eq!(c.task_pid, pid);
}

#[tokio::test]
async fn shutdown_waits_for_the_last_container() {
    let h = H::new();
    h.create("c", &["exit", "0"], "", "", false)
        .await
        .expect("create");
    h.svc
        .shutdown(&ctx(), api::ShutdownRequest::default())
        .await
        .expect("shutdown");
    assert!(!h.sb.is_shut_down());
    h.start("c", "").await.expect("start");
    h.wait("c", "").await;
    h.delete("c", "").await.expect("delete");
    h.svc
        .shutdown(&ctx(), api::ShutdownRequest::default())
        .await
        .expect("shutdown");
    assert!(h.sb.is_shut_down());
    tokio::time::timeout(Duration::from_secs(1), h.exit.wait())
        .await
        .expect("exit signalled");
}

#[tokio::test]
async fn delete_of_a_never_started_task() {
    let h = H::new();
    let pid = h
        .create("c", &["sleep"], "", "", false)
        .await
        .expect("create");
    let d = h.delete("c", "").await.expect("delete");
    assert_eq!(d.pid, pid);
    assert!(h.sb.containers().is_empty());
}

/// No RPC may answer with the generated default ("... is not supported").
#[tokio::test]
async fn every_rpc_is_implemented() {
    let h = H::new();
    let c = ctx();
    let s = &h.svc;
    let id = || "missing".to_string();
    let results: Vec<(&str, Result<(), ttrpc::Error>)> = vec![
        (
            "state",
            s.state(
                &c,
                api::StateRequest {
                    id: id(),
                    ..Default::default()
                },
            )
            .await
            .map(drop),
        ),
        (
            "create",
            s.create(
                &c,
                api::CreateTaskRequest {
                    id: id(),
                    ..Default::default()
                },
            )
            .await
            .map(drop),
        ),
        (
            "start",
            s.start(
                &c,
                api::StartRequest {
                    id: id(),
                    ..Default::default()
                },
            )
            .await
            .map(drop),
        ),
        (
            "delete",
            s.delete(
                &c,
                api::DeleteRequest {
                    id: id(),
                    ..Default::default()
                },
            )
            .await
            .map(drop),
        ),
        (
            "pids",
            s.pids(
                &c,
                api::PidsRequest {
                    id: id(),
                    ..Default::default()
                },
            )
            .await
            .map(drop),
        ),
        (
            "pause",
            s.pause(
                &c,
                api::PauseRequest {
                    id: id(),
                    ..Default::default()
                },
            )
            .await
            .map(drop),
        ),
        (
            "resume",
            s.resume(
                &c,
                api::ResumeRequest {
                    id: id(),
                    ..Default::default()
                },
            )
            .await
            .map(drop),
        ),
        (
            "checkpoint",
            s.checkpoint(
                &c,
                api::CheckpointTaskRequest {
                    id: id(),
                    ..Default::default()
                },
            )
            .await
            .map(drop),
        ),
        (
            "kill",
            s.kill(
                &c,
                api::KillRequest {
                    id: id(),
                    signal: 9,
                    ..Default::default()
                },
            )
            .await
            .map(drop),
        ),
        (
            "exec",
            s.exec(
                &c,
                api::ExecProcessRequest {
                    id: id(),
                    exec_id: "e".into(),
                    ..Default::default()
                },
            )
            .await
            .map(drop),
        ),
        (
            "resize_pty",
            s.resize_pty(
                &c,
                api::ResizePtyRequest {
                    id: id(),
                    ..Default::default()
                },
            )
            .await
            .map(drop),
        ),
        (
            "close_io",
            s.close_io(
                &c,
                api::CloseIORequest {
                    id: id(),
                    ..Default::default()
                },
            )
            .await
            .map(drop),
        ),
        (
            "update",
            s.update(
                &c,
                api::UpdateTaskRequest {
                    id: id(),
                    ..Default::default()
                },
            )
            .await
            .map(drop),
        ),
        (
            "wait",
            s.wait(
                &c,
                api::WaitRequest {
                    id: id(),
                    ..Default::default()
                },
            )
            .await
            .map(drop),
        ),
        (
            "stats",
            s.stats(
                &c,
                api::StatsRequest {
                    id: id(),
                    ..Default::default()
                },
            )
            .await
            .map(drop),
        ),
        (
            "connect",
            s.connect(
                &c,
                api::ConnectRequest {
                    id: id(),
                    ..Default::default()
                },
            )
            .await
            .map(drop),
        ),
    ];
    for (name, r) in results {
        if let Err(e) = r {
            let m = message(&e);
            assert!(
                !m.starts_with("/containerd.task.v2.Task/"),
                "{name} fell back to the default: {m}"
            );
        }
    }
    // Shutdown with nothing left ends the shim.
    s.shutdown(&c, api::ShutdownRequest::default())
        .await
        .expect("shutdown");
}
