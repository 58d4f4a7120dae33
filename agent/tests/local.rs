//! The agent as an ordinary process on this machine, over a unix socket
//! (`burrow-agent --listen unix:PATH`, its test mode). Needs root, as the
//! agent unshares namespaces and mounts container roots.

use std::time::Duration;

use burrow_protocol::agent::*;
use burrow_protocol::ttrpc;
use burrow_protocol::AgentClient;

mod support;

use support::{
    code_of, create, creq, ctx, make_rootfs, preq, read_all, spec_json, wait, TestAgent,
};

fn process_json(args: &[&str], terminal: bool) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "terminal": terminal,
        "consoleSize": {"height": 24, "width": 80},
        "args": args,
        "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin", "HOME=/root"],
        "cwd": "/",
        "user": {"uid": 0, "gid": 0},
    }))
    .expect("json")
}

async fn exec(
    a: &TestAgent,
    container: &str,
    id: &str,
    args: &[&str],
    stdin: bool,
) -> ttrpc::Result<ExecProcessResponse> {
    let mut req = ExecProcessRequest::new();
    req.container_id = container.into();
    req.exec_id = id.into();
    req.oci_process = process_json(args, false);
    req.stdin = stdin;
    a.client.exec_process(ctx(), &req).await
}

#[tokio::test]
async fn health_reports_version() {
    let a = TestAgent::start().await;
    let h = a
        .client
        .health(ctx(), &HealthRequest::new())
        .await
        .expect("health");
    assert_eq!(h.version, env!("CARGO_PKG_VERSION"));
    assert_eq!(h.protocol_version, burrow_protocol::PROTOCOL_VERSION);
    assert!(!h.pid1);
}

#[tokio::test]
async fn exec_streams_output_and_exit_code() {
    let a = TestAgent::start().await;
    exec(
        &a,
        "",
        "p1",
        &["sh", "-c", "echo out; echo err >&2; exit 7"],
        false,
    )
    .await
    .expect("exec");
    assert_eq!(read_all(&a, "", "p1", false).await, b"out\n");
    assert_eq!(read_all(&a, "", "p1", true).await, b"err\n");
    let w = wait(&a, "", "p1").await;
    assert_eq!((w.exit_code, w.signal), (7, 0));
}

#[tokio::test]
async fn signals_end_a_process_and_are_reported() {
    let a = TestAgent::start().await;
    exec(&a, "", "sleeper", &["sleep", "1000"], false)
        .await
        .expect("exec");
    let mut req = SignalProcessRequest::new();
    req.exec_id = "sleeper".into();
    req.signal = 15;
    a.client.signal_process(ctx(), &req).await.expect("signal");
    let w = wait(&a, "", "sleeper").await;
    assert_eq!(w.signal, 15);
    assert_eq!(w.exit_code, 128 + 15);
    // A finished process can be deleted; a second signal says it is gone.
    let (code, _) = code_of(a.client.signal_process(ctx(), &req).await);
    assert_eq!(code, ttrpc::Code::NOT_FOUND);
    a.client
        .delete_process(ctx(), &preq("", "sleeper"))
        .await
        .expect("delete process");
}

#[tokio::test]
async fn stdin_round_trip_and_close() {
    let a = TestAgent::start().await;
    exec(&a, "", "cat", &["cat"], true).await.expect("exec");
    let mut w = WriteStdinRequest::new();
    w.exec_id = "cat".into();
    w.data = b"hello agent\n".to_vec();
    let r = a.client.write_stdin(ctx(), &w).await.expect("write stdin");
    assert_eq!(r.written, 12);
    let close = preq("", "cat");
    a.client
        .close_stdin(ctx(), &close)
        .await
        .expect("close stdin");
    assert_eq!(read_all(&a, "", "cat", false).await, b"hello agent\n");
    assert_eq!(wait(&a, "", "cat").await.exit_code, 0);
    // Writing after close is a clear error.
    let (code, msg) = code_of(a.client.write_stdin(ctx(), &w).await);
    assert_eq!(code, ttrpc::Code::FAILED_PRECONDITION, "{msg}");
}

#[tokio::test]
async fn large_stream_arrives_intact_with_bounded_agent_memory() {
    let a = TestAgent::start().await;
    let before = a.peak_rss_kib();
    // 100 MiB of a repeating, checkable pattern.
    const TOTAL: usize = 100 << 20;
    exec(
        &a,
        "",
        "big",
        &[
            "sh",
            "-c",
            "yes 0123456789abcdef0123456789abcde | head -c 104857600",
        ],
        false,
    )
    .await
    .expect("exec");
    // Nobody reads for a while: the writer must block, not the agent grow.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        a.peak_rss_kib() < before + 16 * 1024,
        "agent grew while output was not read"
    );
    let line = b"0123456789abcdef0123456789abcde\n";
    let mut got = 0usize;
    loop {
        let mut req = ReadStreamRequest::new();
        req.exec_id = "big".into();
        req.max_bytes = 256 * 1024;
        let r = a.client.read_stdout(ctx(), &req).await.expect("read");
        if r.eof {
            break;
        }
        assert!(r.data.len() <= 256 * 1024);
        for (i, b) in r.data.iter().enumerate() {
            assert_eq!(
                *b,
                line[(got + i) % line.len()],
                "corrupt byte at {}",
                got + i
            );
        }
        got += r.data.len();
    }
    assert_eq!(got, TOTAL);
    assert_eq!(wait(&a, "", "big").await.exit_code, 0);
    let peak = a.peak_rss_kib();
    assert!(
        peak < before + 32 * 1024,
        "agent peak RSS went from {before} KiB to {peak} KiB"
    );
}

#[tokio::test]
async fn terminal_with_resize() {
    let a = TestAgent::start().await;
    let mut req = ExecProcessRequest::new();
    req.exec_id = "tty".into();
    req.oci_process = process_json(&["sh", "-c", "stty size; read x; stty size; tty"], true);
    a.client.exec_process(ctx(), &req).await.expect("exec");
    let mut rs = ResizePtyRequest::new();
    rs.exec_id = "tty".into();
    // The first `stty size` runs with the spec's console size.
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("24 80") {
        let mut r = ReadStreamRequest::new();
        r.exec_id = "tty".into();
        let chunk = a.client.read_stdout(ctx(), &r).await.expect("read");
        assert!(
            !chunk.eof,
            "eof before size: {:?}",
            String::from_utf8_lossy(&seen)
        );
        seen.extend_from_slice(&chunk.data);
    }
    rs.rows = 40;
    rs.cols = 100;
    a.client.resize_pty(ctx(), &rs).await.expect("resize");
    let mut w = WriteStdinRequest::new();
    w.exec_id = "tty".into();
    w.data = b"go\n".to_vec();
    a.client.write_stdin(ctx(), &w).await.expect("write");
    let rest = String::from_utf8_lossy(&read_all(&a, "", "tty", false).await).into_owned();
    assert!(rest.contains("40 100"), "{rest:?}");
    assert!(rest.contains("/dev/pts/"), "{rest:?}");
    assert_eq!(wait(&a, "", "tty").await.exit_code, 0);
    // No terminal, no resize.
    exec(&a, "", "plain", &["true"], false).await.expect("exec");
    rs.exec_id = "plain".into();
    let (code, _) = code_of(a.client.resize_pty(ctx(), &rs).await);
    assert_eq!(code, ttrpc::Code::FAILED_PRECONDITION);
}

#[tokio::test]
async fn a_process_gets_the_oom_score_its_spec_asks_for() {
    let a = TestAgent::start().await;
    let mut p: serde_json::Value =
        serde_json::from_slice(&process_json(&["cat", "/proc/self/oom_score_adj"], false))
            .expect("json");
    p["oomScoreAdj"] = 500.into();
    let mut req = ExecProcessRequest::new();
    req.exec_id = "oom".into();
    req.oci_process = serde_json::to_vec(&p).expect("json");
    a.client.exec_process(ctx(), &req).await.expect("exec");
    let out = String::from_utf8_lossy(&read_all(&a, "", "oom", false).await).into_owned();
    assert_eq!(out.trim(), "500");
    // The OOM-kill wait answers at once when the kernel's count is past `seen`.
    let kills = std::fs::read_to_string("/proc/vmstat")
        .expect("vmstat")
        .lines()
        .find_map(|l| {
            l.strip_prefix("oom_kill ")
                .and_then(|v| v.trim().parse::<u64>().ok())
        })
        .expect("oom_kill in /proc/vmstat");
    if let Some(seen) = kills.checked_sub(1) {
        let mut w = WaitOomKillRequest::new();
        w.seen = seen;
        assert_eq!(
            a.client
                .wait_oom_kill(ctx(), &w)
                .await
                .expect("wait oom")
                .kills,
            kills
        );
    }
}

#[tokio::test]
async fn orphans_are_reaped() {
    let a = TestAgent::start().await;
    exec(&a, "", "parent", &["sh", "-c", "sleep 0.2 & exit 0"], false)
        .await
        .expect("exec");
    assert_eq!(wait(&a, "", "parent").await.exit_code, 0);
    tokio::time::sleep(Duration::from_millis(800)).await;
    let agent = a.pid().to_string();
    for entry in std::fs::read_dir("/proc").expect("proc") {
        let Ok(entry) = entry else { continue };
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid ...
        let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
        let fields: Vec<&str> = after.split_whitespace().collect();
        if fields.get(1) == Some(&agent.as_str()) {
            assert_ne!(
                fields.first(),
                Some(&"Z"),
                "zombie child of the agent: {stat}"
            );
        }
    }
}

/// A container root on this machine: the host's /usr bound read-only
/// into an otherwise empty directory (with Debian's usr-merge symlinks).
#[tokio::test]
async fn container_runs_its_spec() {
    let a = TestAgent::start().await;
    let rootfs = make_rootfs(a.path());
    let script = "echo in-container; hostname; cat /etc/marker; grep -c . /proc/self/mounts >/dev/null && echo proc-ok; \
                  ulimit -n; grep CapEff /proc/self/status; grep NoNewPrivs /proc/self/status; ls /dev/null; echo pid:$$; \
                  [ -s /proc/kcore ] && echo kcore-visible; touch /proc/sys/kernel/hostname 2>/dev/null || echo sys-ro; \
                  echo /proc/[0-9]*; exit 3";
    let created = create(&a, "c1", &rootfs, &["sh", "-c", script], false)
        .await
        .expect("create");
    assert!(created.pid > 0);
    // Not started yet: no output until StartContainer.
    a.client
        .start_container(ctx(), &creq("c1"))
        .await
        .expect("start");
    let out = String::from_utf8_lossy(&read_all(&a, "c1", "", false).await).into_owned();
    let err = String::from_utf8_lossy(&read_all(&a, "c1", "", true).await).into_owned();
    assert!(
        out.starts_with("in-container\nctr-test\nmarker\nproc-ok\n512\n"),
        "stdout {out:?} stderr {err:?}"
    );
    assert!(out.contains("CapEff:\t00000000000000e1"), "{out:?}");
    assert!(out.contains("NoNewPrivs:\t1"), "{out:?}");
    assert!(out.contains("/dev/null"), "{out:?}");
    // Its own PID namespace and /proc: the shell is PID 1 and, globbing
    // /proc itself (no child that may or may not exist yet, as `ls | grep`
    // had), sees only itself; the spec's masks hold on that /proc.
    assert!(out.contains("pid:1\n"), "{out:?}");
    assert!(!out.contains("kcore-visible"), "{out:?}");
    assert!(out.contains("sys-ro\n"), "{out:?}");
    assert!(
        out.ends_with("sys-ro\n/proc/1\n"),
        "only the container's processes in /proc: {out:?}"
    );
    let w = wait(&a, "c1", "").await;
    assert_eq!(w.exit_code, 3);
    let (code, _) = code_of(a.client.start_container(ctx(), &creq("c1")).await);
    assert_eq!(code, ttrpc::Code::FAILED_PRECONDITION);
    a.client
        .delete_container(ctx(), &creq("c1"))
        .await
        .expect("delete");
    assert!(
        !a.path().join("state/containers/c1").exists(),
        "bundle left behind"
    );
    // The host's view of the rootfs directory is untouched by the mounts.
    assert!(std::fs::read_dir(rootfs.join("usr"))
        .expect("usr")
        .next()
        .is_none());
}

#[tokio::test]
async fn container_init_gets_a_terminal_from_its_own_devpts() {
    let a = TestAgent::start().await;
    let rootfs = make_rootfs(a.path());
    let mut spec: serde_json::Value =
        serde_json::from_slice(&spec_json(&["sh", "-c", "tty; stty size"])).expect("spec");
    spec["process"]["terminal"] = true.into();
    spec["process"]["consoleSize"] = serde_json::json!({"height": 30, "width": 100});
    let mut req = CreateContainerRequest::new();
    req.container_id = "tty".into();
    req.oci_spec = serde_json::to_vec(&spec).expect("json");
    let mut r = Rootfs::new();
    r.source = rootfs.display().to_string();
    r.fstype = "bind".into();
    req.rootfs = Some(r).into();
    a.client
        .create_container(ctx(), &req)
        .await
        .expect("create");
    a.client
        .start_container(ctx(), &creq("tty"))
        .await
        .expect("start");
    let out = String::from_utf8_lossy(&read_all(&a, "tty", "", false).await).into_owned();
    assert_eq!(out.replace('\r', ""), "/dev/pts/0\n30 100\n");
    assert_eq!(wait(&a, "tty", "").await.exit_code, 0);
}

#[tokio::test]
async fn exec_joins_a_running_container() {
    let a = TestAgent::start().await;
    let rootfs = make_rootfs(a.path());
    create(
        &a,
        "c2",
        &rootfs,
        &["sh", "-c", "echo $$ > /tmp/init-pid; exec sleep 1000"],
        false,
    )
    .await
    .expect("create");
    a.client
        .start_container(ctx(), &creq("c2"))
        .await
        .expect("start");
    let mut out = String::new();
    for _ in 0..100 {
        exec(
            &a,
            "c2",
            "e1",
            &["sh", "-c", "hostname; cat /tmp/init-pid 2>/dev/null"],
            false,
        )
        .await
        .expect("exec");
        out = String::from_utf8_lossy(&read_all(&a, "c2", "e1", false).await).into_owned();
        wait(&a, "c2", "e1").await;
        let del = preq("c2", "e1");
        a.client
            .delete_process(ctx(), &del)
            .await
            .expect("delete process");
        if out.lines().count() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The exec joined the container's PID namespace: init is PID 1 there.
    assert_eq!(out, "ctr-test\n1\n");
    // A terminal comes from the container's own devpts: `tty` names it.
    let mut req = ExecProcessRequest::new();
    req.container_id = "c2".into();
    req.exec_id = "tty".into();
    req.oci_process = process_json(&["tty"], true);
    a.client
        .exec_process(ctx(), &req)
        .await
        .expect("exec with a terminal");
    let out = String::from_utf8_lossy(&read_all(&a, "c2", "tty", false).await).into_owned();
    assert_eq!(out.trim(), "/dev/pts/0", "{out:?}");
    assert_eq!(wait(&a, "c2", "tty").await.exit_code, 0);
    a.client
        .delete_process(ctx(), &preq("c2", "tty"))
        .await
        .expect("delete process");
    let list = a
        .client
        .list_processes(ctx(), &creq("c2"))
        .await
        .expect("ps");
    assert_eq!(list.processes.len(), 1);
    assert!(list.processes.first().is_some_and(|p| p.running));
    let mut kill = SignalProcessRequest::new();
    kill.container_id = "c2".into();
    kill.signal = 9;
    kill.all = true;
    a.client
        .signal_process(ctx(), &kill)
        .await
        .expect("kill all");
    assert_eq!(wait(&a, "c2", "").await.signal, 9);
    let (code, msg) = code_of(exec(&a, "c2", "late", &["true"], false).await);
    assert_eq!(code, ttrpc::Code::FAILED_PRECONDITION, "{msg}");
    a.client
        .delete_container(ctx(), &creq("c2"))
        .await
        .expect("delete");
}

#[tokio::test]
async fn malformed_requests_get_clear_errors_and_the_agent_keeps_serving() {
    let a = TestAgent::start().await;
    let (code, msg) = code_of(exec(&a, "nope", "x", &["true"], false).await);
    assert_eq!(code, ttrpc::Code::NOT_FOUND);
    assert!(msg.contains("nope"), "{msg}");

    let mut bad = CreateContainerRequest::new();
    bad.container_id = "bad".into();
    bad.oci_spec = b"{not json".to_vec();
    let (code, msg) = code_of(a.client.create_container(ctx(), &bad).await);
    assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT);
    assert!(msg.contains("bad OCI spec"), "{msg}");
    bad.oci_spec = spec_json(&["true"]);
    let (code, msg) = code_of(a.client.create_container(ctx(), &bad).await);
    assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT, "missing rootfs: {msg}");
    bad.container_id = "../evil".into();
    let (code, _) = code_of(a.client.create_container(ctx(), &bad).await);
    assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT);
    let mut r = Rootfs::new();
    r.source = "/does/not/exist".into();
    r.fstype = "ext4".into();
    bad.container_id = "nodev".into();
    bad.rootfs = Some(r).into();
    let (code, msg) = code_of(a.client.create_container(ctx(), &bad).await);
    assert_eq!(code, ttrpc::Code::FAILED_PRECONDITION, "{msg}");
    assert!(
        !a.path().join("state/containers/nodev").exists(),
        "failed create left its bundle"
    );

    let (code, _) = code_of(exec(&a, "", "empty", &[], false).await);
    assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT);
    let (code, msg) = code_of(exec(&a, "", "missing", &["/no/such/binary"], false).await);
    assert_eq!(code, ttrpc::Code::NOT_FOUND, "{msg}");
    assert!(msg.contains("exec \"/no/such/binary\""), "{msg}");
    exec(&a, "", "dup", &["sleep", "100"], false)
        .await
        .expect("exec");
    let (code, _) = code_of(exec(&a, "", "dup", &["true"], false).await);
    assert_eq!(code, ttrpc::Code::ALREADY_EXISTS);
    let del = preq("", "dup");
    let (code, _) = code_of(a.client.delete_process(ctx(), &del).await);
    assert_eq!(code, ttrpc::Code::FAILED_PRECONDITION);

    // Over the agent's chunk limit but within ttrpc's message limit.
    let mut w = WriteFileRequest::new();
    w.path = a.path().join("big").display().to_string();
    w.data = vec![0u8; burrow_protocol::MAX_CHUNK + 1];
    let (code, _) = code_of(a.client.write_file(ctx(), &w).await);
    assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT);
    // Over ttrpc's own 4 MiB message limit: refused, connection or not.
    w.data = vec![0u8; 5 << 20];
    assert!(a.client.write_file(ctx(), &w).await.is_err());
    let mut sig = SignalProcessRequest::new();
    sig.exec_id = "dup".into();
    sig.signal = 1000;
    let (code, _) = code_of(a.client.signal_process(ctx(), &sig).await);
    assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT);
    let mut long = PathRequest::new();
    long.path = "a/".repeat(5000);
    let (code, _) = code_of(a.client.stat(ctx(), &long).await);
    assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT);
    let (code, _) = code_of(a.client.power_off(ctx(), &PowerOffRequest::new()).await);
    assert_eq!(code, ttrpc::Code::FAILED_PRECONDITION);

    // Still serving, on this connection and on a new one.
    a.client
        .health(ctx(), &HealthRequest::new())
        .await
        .expect("health after errors");
    let addr = format!("unix://{}", a.path().join("agent.sock").display());
    let fresh = AgentClient::new(
        ttrpc::r#async::Client::connect(&addr)
            .await
            .expect("reconnect"),
    );
    fresh
        .health(ctx(), &HealthRequest::new())
        .await
        .expect("health on a new connection");
    let mut h = SetHostnameRequest::new();
    h.hostname = "agent-test".into();
    fresh
        .set_hostname(ctx(), &h)
        .await
        .expect("hostname (own UTS namespace in test mode)");
    let mut e = AddEntropyRequest::new();
    e.data = vec![7u8; 64];
    fresh.add_entropy(ctx(), &e).await.expect("entropy");
}
