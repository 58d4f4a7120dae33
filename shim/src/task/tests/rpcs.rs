//! Refused requests and the remaining RPCs (resize, update, stats,
//! checkpoint, connect, shutdown, every RPC implemented).

use super::*;

#[tokio::test]
async fn bad_requests_leave_nothing_behind() {
    let h = H::new();
    // Malformed spec.
    let b = h.path("bad");
    std::fs::create_dir_all(&b).expect("dir");
    std::fs::write(b.join("config.json"), r#"{"process": {"args": "sh"}}"#).expect("write");
    let req = api::CreateTaskRequest {
        bundle: b.display().to_string(),
        ..naming("bad")
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
        assert_eq!(
            refused(h.svc.create(&ctx(), req).await),
            Code::INVALID_ARGUMENT,
            "{id:?}"
        );
    }
    assert_eq!(
        refused(
            h.create("c", &["true"], "binary:///usr/bin/logger", "", false)
                .await
        ),
        Code::INVALID_ARGUMENT
    );
    let req = api::CreateTaskRequest {
        bundle: h.bundle("cp", &["true"]),
        checkpoint: "/tmp/cp".into(),
        ..naming("cp")
    };
    assert_eq!(
        refused(h.svc.create(&ctx(), req).await),
        Code::UNIMPLEMENTED
    );
    assert!(h.sb.calls().is_empty(), "{:?}", h.sb.calls());
    assert_eq!(h.svc.container_count(), 0);
    assert!(h.ev.topics().is_empty());
    // Duplicate ids.
    h.create_plain("c", &["sleep"]).await;
    assert_eq!(
        refused(h.create("c", &["sleep"], "", "", false).await),
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
        refused(h.svc.exec(&ctx(), req).await),
        Code::INVALID_ARGUMENT
    );
}

#[tokio::test]
async fn terminal_resize() {
    let h = H::new();
    h.run("plain", &["sleep"]).await;
    let req = api::ResizePtyRequest {
        width: 80,
        height: 24,
        ..naming("plain")
    };
    assert_eq!(
        refused(h.svc.resize_pty(&ctx(), req).await),
        Code::FAILED_PRECONDITION
    );
    h.create("tty", &["sleep"], "", "", true)
        .await
        .expect("create");
    h.start("tty", "").await.expect("start");
    let req = api::ResizePtyRequest {
        width: 100,
        height: 30,
        ..naming("tty")
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
        exec_id: "t".into(),
        width: 10,
        height: 5,
        ..naming("tty")
    };
    h.svc.resize_pty(&ctx(), req).await.expect("resize exec");
}

#[tokio::test]
async fn update_stats_checkpoint_connect() {
    let h = H::new();
    let pid = h.run("c", &["sleep"]).await;
    let update = |type_url: &str| api::UpdateTaskRequest {
        id: "c".into(),
        resources: MessageField::some(Any {
            type_url: type_url.into(),
            value: br#"{"memory":{"limit":1048576}}"#.to_vec(),
            ..Default::default()
        }),
        ..Default::default()
    };
    let err = h
        .svc
        .update(&ctx(), update("types.containerd.io/WindowsResources"))
        .await
        .expect_err("update with other resources");
    assert_eq!(code(&err), Code::INVALID_ARGUMENT);
    h.svc
        .update(
            &ctx(),
            update("types.containerd.io/opencontainers/runtime-spec/1/LinuxResources"),
        )
        .await
        .expect("update Linux resources");
    assert!(
        h.sb.calls()
            .contains(&r#"update c {"memory":{"limit":1048576}}"#.to_string()),
        "{:?}",
        h.sb.calls()
    );
    let mut ann = HashMap::new();
    ann.insert("a".to_string(), "b".to_string());
    h.svc
        .update(
            &ctx(),
            api::UpdateTaskRequest {
                annotations: ann,
                ..naming("c")
            },
        )
        .await
        .expect("update annotations");

    let s = h.svc.stats(&ctx(), naming("c")).await.expect("stats");
    assert_eq!(s.stats.type_url, "io.containerd.cgroups.v2.Metrics");

    let err = h
        .svc
        .checkpoint(&ctx(), naming("c"))
        .await
        .expect_err("checkpoint without a path");
    assert_eq!(code(&err), Code::INVALID_ARGUMENT);
    assert!(message(&err).contains("path"));
    // The fake sandbox cannot checkpoint: its refusal comes through.
    assert_eq!(
        refused(
            h.svc
                .checkpoint(
                    &ctx(),
                    api::CheckpointTaskRequest {
                        path: "/tmp/cp".into(),
                        ..naming("c")
                    },
                )
                .await
        ),
        Code::UNIMPLEMENTED
    );

    let c = h.svc.connect(&ctx(), naming("c")).await.expect("connect");
    assert_eq!(c.shim_pid, std::process::id());
    assert_eq!(c.task_pid, pid);
}

#[tokio::test]
async fn checkpoint_options_say_whether_the_task_exits() {
    use containerd_shim::protos::protobuf::Message;
    use containerd_shim::protos::shim::oci::CheckpointOptions;
    let h = H::new();
    h.sb.allow_restore();
    let out = file_uri(&h.path("out"));
    h.create("c", &["sleep"], &out, "", false)
        .await
        .expect("create");
    h.start("c", "").await.expect("start");
    let options = |url: &str, exit: bool| Any {
        type_url: url.into(),
        value: CheckpointOptions {
            exit,
            open_tcp: true,
            ..Default::default()
        }
        .write_to_bytes()
        .expect("encode"),
        ..Default::default()
    };
    let c = ctx();
    let checkpoint = |options: Option<Any>| {
        h.svc.checkpoint(
            &c,
            api::CheckpointTaskRequest {
                path: "/tmp/cp".into(),
                options: options.into(),
                ..naming("c")
            },
        )
    };
    // containerd 1.6 names the type bare; newer ones with the usual prefix.
    checkpoint(Some(options("containerd.runc.v1.CheckpointOptions", true)))
        .await
        .expect("checkpoint --exit");
    checkpoint(Some(options(
        "type.googleapis.com/containerd.runc.v1.CheckpointOptions",
        false,
    )))
    .await
    .expect("checkpoint");
    checkpoint(None).await.expect("checkpoint without options");
    assert_eq!(
        refused(checkpoint(Some(options("example.Other", true))).await),
        Code::INVALID_ARGUMENT
    );
    assert_eq!(
        refused(
            checkpoint(Some(Any {
                type_url: "containerd.runc.v1.CheckpointOptions".into(),
                value: vec![0x08],
                ..Default::default()
            }))
            .await
        ),
        Code::INVALID_ARGUMENT
    );
    let done: Vec<String> =
        h.sb.calls()
            .into_iter()
            .filter(|c| c.starts_with("checkpoint"))
            .collect();
    assert_eq!(
        done,
        [
            "checkpoint to /tmp/cp then Exit",
            "checkpoint to /tmp/cp then Resume",
            "checkpoint to /tmp/cp then Resume",
        ]
    );
}

#[tokio::test]
async fn the_last_delete_stops_the_sandbox_and_shutdown_ends_the_shim() {
    let h = H::new();
    h.create_plain("c", &["exit", "0"]).await;
    h.svc
        .shutdown(&ctx(), api::ShutdownRequest::default())
        .await
        .expect("shutdown");
    assert!(!h.sb.is_shut_down());
    h.start("c", "").await.expect("start");
    h.wait("c", "").await;
    h.delete("c", "").await.expect("delete");
    // The last Delete stops the sandbox: Shutdown has only 3 s.
    assert!(h.sb.is_shut_down());
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
    let pid = h.create_plain("c", &["sleep"]).await;
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
    let id = "missing";
    let kill = api::KillRequest {
        signal: 9,
        ..naming(id)
    };
    let exec = api::ExecProcessRequest {
        exec_id: "e".into(),
        ..naming(id)
    };
    let results: Vec<(&str, Result<(), ttrpc::Error>)> = vec![
        ("state", s.state(&c, naming(id)).await.map(drop)),
        ("create", s.create(&c, naming(id)).await.map(drop)),
        ("start", s.start(&c, naming(id)).await.map(drop)),
        ("delete", s.delete(&c, naming(id)).await.map(drop)),
        ("pids", s.pids(&c, naming(id)).await.map(drop)),
        ("pause", s.pause(&c, naming(id)).await.map(drop)),
        ("resume", s.resume(&c, naming(id)).await.map(drop)),
        ("checkpoint", s.checkpoint(&c, naming(id)).await.map(drop)),
        ("resize_pty", s.resize_pty(&c, naming(id)).await.map(drop)),
        ("close_io", s.close_io(&c, naming(id)).await.map(drop)),
        ("update", s.update(&c, naming(id)).await.map(drop)),
        ("wait", s.wait(&c, naming(id)).await.map(drop)),
        ("stats", s.stats(&c, naming(id)).await.map(drop)),
        ("connect", s.connect(&c, naming(id)).await.map(drop)),
        // These two carry what a valid request has besides the id.
        ("kill", s.kill(&c, kill).await.map(drop)),
        ("exec", s.exec(&c, exec).await.map(drop)),
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
