//! Processes through their lifecycle: output, exits, exec, stdin, pause,
//! OOM events, restore, a sandbox crash.

use super::*;

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
    assert_eq!(h.status("c1", "").await, Status::CREATED);
    assert_eq!(h.start("c1", "").await.expect("start"), pid);
    assert_eq!(h.wait("c1", "").await, 0);
    let st = h.state("c1", "").await.expect("state");
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
    assert_eq!(refused(h.delete("c1", "").await), Code::NOT_FOUND);
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

/// An init whose exec fails in the guest: Start says why, and the task has
/// ended (as runc's does), so a wait returns, a kill finds nothing to kill
/// and a delete (CRI's cleanup after a failed StartContainer) goes through.
#[tokio::test]
async fn an_init_that_cannot_start_has_ended() {
    let h = H::new();
    h.create_plain("m", &["missing"]).await;
    let err = h.start("m", "").await.expect_err("exec of a missing program");
    assert_eq!(code(&err), Code::NOT_FOUND, "{}", message(&err));
    assert!(message(&err).contains("\"missing\""), "{}", message(&err));
    assert_eq!(h.status("m", "").await, Status::STOPPED);
    assert_eq!(h.wait("m", "").await, 127);
    assert_eq!(refused(h.kill("m", "", 9).await), Code::NOT_FOUND);
    h.delete("m", "").await.expect("delete after a failed start");
    assert!(h.sb.containers().is_empty(), "{:?}", h.sb.containers());
}

#[tokio::test]
async fn exit_codes_and_signals() {
    let h = H::new();
    h.run("c7", &["exit", "7"]).await;
    assert_eq!(h.wait("c7", "").await, 7);
    let err = h.kill("c7", "", 9).await.expect_err("kill after exit");
    assert_eq!(code(&err), Code::NOT_FOUND, "{}", message(&err));

    h.run("s", &["sleep"]).await;
    assert_eq!(h.status("s", "").await, Status::RUNNING);
    assert_eq!(refused(h.delete("s", "").await), Code::FAILED_PRECONDITION);
    assert_eq!(refused(h.kill("s", "", 0).await), Code::INVALID_ARGUMENT);
    h.kill("s", "", 15).await.expect("kill");
    assert_eq!(h.wait("s", "").await, 128 + 15);
    assert_eq!(h.delete("s", "").await.expect("delete").exit_status, 143);
}

#[tokio::test]
async fn exec_pids_and_exec_events() {
    let h = H::new();
    h.create_plain("c", &["sleep"]).await;
    assert_eq!(
        refused(h.exec("c", "e1", &["echo", "x"], "", false).await),
        Code::FAILED_PRECONDITION
    );
    let init = h.start("c", "").await.expect("start");
    let out = h.path("exec.log");
    h.exec("c", "e1", &["echo", "from", "exec"], &file_uri(&out), false)
        .await
        .expect("exec");
    assert_eq!(
        refused(h.exec("c", "e1", &["echo"], "", false).await),
        Code::ALREADY_EXISTS
    );
    assert_eq!(h.status("c", "e1").await, Status::CREATED);
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
    let pids = h.svc.pids(&ctx(), naming("c")).await.expect("pids");
    let listed: Vec<u32> = pids.processes.iter().map(|p| p.pid).collect();
    assert!(
        listed.contains(&init) && listed.contains(&pid2),
        "{listed:?}"
    );
    assert!(pids.processes.iter().any(|p| p.info.is_some()));

    assert_eq!(refused(h.delete("c", "").await), Code::FAILED_PRECONDITION);
    h.kill("c", "e2", 9).await.expect("kill exec");
    assert_eq!(h.wait("c", "e2").await, 137);
    assert_eq!(h.delete("c", "e1").await.expect("delete e1").pid, pid);
    h.delete("c", "e2").await.expect("delete e2");
    assert_eq!(refused(h.state("c", "e1").await), Code::NOT_FOUND);
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
    h.close_stdin("cat").await.expect("close io");
    assert_eq!(h.wait("cat", "").await, 0);
    assert_eq!(
        std::fs::read_to_string(&out).expect("out"),
        "hello through stdin\n"
    );
}

#[tokio::test]
async fn close_io_without_stdin_pump_closes_directly() {
    let h = H::new();
    h.run("cat", &["cat"]).await;
    h.close_stdin("cat").await.expect("close io");
    assert_eq!(h.wait("cat", "").await, 0);
}

#[tokio::test]
async fn pause_and_resume() {
    let h = H::new();
    h.create_plain("p", &["sleep"]).await;
    assert_eq!(
        refused(h.svc.pause(&ctx(), naming("p")).await),
        Code::FAILED_PRECONDITION
    );
    h.start("p", "").await.expect("start");
    h.svc.pause(&ctx(), naming("p")).await.expect("pause");
    assert!(h.sb.paused());
    assert_eq!(h.status("p", "").await, Status::PAUSED);
    h.svc.resume(&ctx(), naming("p")).await.expect("resume");
    assert!(!h.sb.paused());
    assert_eq!(h.status("p", "").await, Status::RUNNING);
    assert_eq!(
        refused(h.svc.resume(&ctx(), naming("p")).await),
        Code::FAILED_PRECONDITION
    );
    let topics = h.ev.topics();
    assert!(
        topics.contains(&"/tasks/paused".to_string())
            && topics.contains(&"/tasks/resumed".to_string())
    );
}

#[tokio::test]
async fn guest_oom_kills_become_task_oom_events() {
    let h = H::new();
    h.run("c", &["sleep"]).await;
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
        bundle: h.bundle("r", &["sleep"]),
        checkpoint: h.path("cp").display().to_string(),
        ..naming("r")
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
        bundle: b,
        ..naming("n")
    };
    h.svc.create(&ctx(), req).await.expect("restore by name");
    assert!(
        h.sb.calls()
            .contains(&"restore n from /named/cp1".to_string()),
        "{:?}",
        h.sb.calls()
    );
}

#[tokio::test]
async fn sandbox_crash_reports_exit_and_delete_cleans_up() {
    let h = H::new();
    h.run("c", &["sleep"]).await;
    h.sb.crash();
    assert_eq!(h.wait("c", "").await, 255);
    assert!(h.ev.topics().contains(&"/tasks/exit".to_string()));
    h.delete("c", "").await.expect("delete after crash");
    assert_eq!(h.svc.container_count(), 0);
}
