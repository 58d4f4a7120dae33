//! The shim's agent client (`burrow_shim::vm::agent`) against a real
//! `burrow-agent` in its test mode (`--listen unix:`), with a busybox root
//! filesystem bound from a directory. No VM: this checks the shim↔agent
//! wiring (spec forwarding, stdio chunks, exit status, process list,
//! delete) that every VM test builds on. Needs root (the agent unshares).

use std::time::Duration;

use burrow_protocol::agent as pb;
use burrow_shim::sandbox::{ExitStatus, Stream};
use burrow_shim::vm::agent::{Agent, AgentAddr};

async fn read_all(a: &Agent, id: &str, stream: Stream) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let c = a.read(id, "", stream, 65536).await.expect("read");
        out.extend(c.data);
        if c.eof || out.len() > 1 << 20 {
            return out;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shim_agent_client_runs_a_container() {
    let busybox = std::path::Path::new("/bin/busybox");
    assert!(
        busybox.is_file(),
        "needs a static /bin/busybox (package busybox-static)"
    );
    let d = std::env::temp_dir().join(format!("burrow-shim-agent-{}", std::process::id()));
    let root = d.join("rootfs");
    for sub in ["bin", "proc", "sys", "dev", "tmp"] {
        std::fs::create_dir_all(root.join(sub)).expect("mkdir");
    }
    std::fs::copy(busybox, root.join("bin/busybox")).expect("copy busybox");
    std::os::unix::fs::symlink("busybox", root.join("bin/sh")).expect("symlink");
    let sock = d.join("agent.sock");
    let mut agent = tokio::process::Command::new(burrow_tests::workspace_bin("burrow-agent"))
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .arg("--state-dir")
        .arg(d.join("state"))
        .kill_on_drop(true)
        .spawn()
        .expect("start burrow-agent");

    let a = Agent::connect(
        &AgentAddr::Unix(sock),
        Duration::from_secs(10),
        Duration::from_secs(20),
    )
    .await
    .expect("connect to the agent");
    let spec = serde_json::json!({
        "ociVersion": "1.0.2",
        "process": {
            "args": ["/bin/sh", "-c", "echo hi; echo oops >&2; exit 3"],
            "cwd": "/",
            "user": {"uid": 0, "gid": 0},
            "env": ["PATH=/bin"],
        },
        "root": {"path": "/host/path/that/the/guest/never/sees"},
        "hooks": {"prestart": [{"path": "/usr/bin/false"}]},
    });
    let (guest, stripped) = burrow_shim::spec::for_guest(&spec);
    assert!(!stripped.items.is_empty());
    let rootfs = pb::Rootfs {
        source: root.display().to_string(),
        fstype: "bind".into(),
        ..Default::default()
    };
    let json = serde_json::to_vec(&guest).expect("json");
    let pid = a
        .create_container("c1", &json, rootfs, false)
        .await
        .expect("create");
    assert!(pid > 0);
    a.start_container("c1").await.expect("start");
    let out = read_all(&a, "c1", Stream::Stdout).await;
    let err = read_all(&a, "c1", Stream::Stderr).await;
    assert_eq!(a.wait("c1", "").await.expect("wait"), ExitStatus::Code(3));
    assert_eq!(String::from_utf8_lossy(&out), "hi\n");
    assert_eq!(String::from_utf8_lossy(&err), "oops\n");
    let procs = a.processes("c1").await.expect("processes");
    assert!(
        procs.iter().any(|p| p.pid == pid && !p.running),
        "{procs:?}"
    );
    a.delete_container("c1").await.expect("delete");
    let gone = a
        .start_container("c1")
        .await
        .expect_err("deleted container");
    assert!(
        gone.to_string().contains("not found") || gone.to_string().contains("no container"),
        "{gone}"
    );

    let _ = agent.kill().await;
    let _ = std::fs::remove_dir_all(&d);
}
