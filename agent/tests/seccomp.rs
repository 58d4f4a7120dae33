//! The container's `linux.seccomp` profile in the agent's test mode: it
//! holds for the init and for exec'd processes, with and without
//! no_new_privileges, argument rules included; what burrow cannot apply is
//! refused, never skipped.

use burrow_protocol::agent::*;
use burrow_protocol::ttrpc;
use serde_json::{json, Value};

mod support;

use support::{
    code_of, create_with_spec, creq, ctx, make_rootfs, read_all, spec_json, wait, TestAgent,
};

/// The test spec running `sh -c script`, with `seccomp` as its profile
/// (Null: none) and no_new_privileges as given.
fn spec(script: &str, seccomp: Value, nnp: bool) -> Vec<u8> {
    let mut spec: Value = serde_json::from_slice(&spec_json(&["sh", "-c", script])).expect("json");
    spec["process"]["noNewPrivileges"] = json!(nnp);
    if !seccomp.is_null() {
        spec["linux"]["seccomp"] = seccomp;
    }
    serde_json::to_vec(&spec).expect("json")
}

/// Run `script` in a new container; its stdout, stderr and exit code.
async fn run(a: &TestAgent, id: &str, spec: Vec<u8>) -> (String, String, i32) {
    let rootfs = make_rootfs(&a.path().join(id));
    create_with_spec(a, id, &rootfs, spec, false)
        .await
        .expect("create");
    a.client
        .start_container(ctx(), &creq(id))
        .await
        .expect("start");
    let out = String::from_utf8_lossy(&read_all(a, id, "", false).await).into_owned();
    let err = String::from_utf8_lossy(&read_all(a, id, "", true).await).into_owned();
    let code = wait(a, id, "").await.exit_code;
    a.client
        .delete_container(ctx(), &creq(id))
        .await
        .expect("delete");
    (out, err, code as i32)
}

/// mkdir is denied with EACCES; unknown names are skipped; the rest runs.
fn deny_mkdir() -> Value {
    json!({
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": [
            {"names": ["mkdir", "mkdirat", "no_such_syscall_anywhere"], "action": "SCMP_ACT_ERRNO", "errnoRet": 13}
        ]
    })
}

const MKDIR: &str = "mkdir /tmp/d; echo rc=$?; grep Seccomp: /proc/self/status";

#[tokio::test]
async fn the_profile_holds_with_and_without_no_new_privileges() {
    let a = TestAgent::start().await;
    for nnp in [true, false] {
        let (out, err, code) = run(&a, &format!("nnp-{nnp}"), spec(MKDIR, deny_mkdir(), nnp)).await;
        assert_eq!(code, 0, "nnp {nnp}: {out:?} {err:?}");
        assert!(
            out.contains("rc=1") && out.contains("Seccomp:\t2"),
            "nnp {nnp}: {out:?} {err:?}"
        );
        assert!(err.contains("Permission denied"), "nnp {nnp}: {err:?}");
    }
    // The control: the same container without a profile.
    let (out, err, _) = run(&a, "none", spec(MKDIR, Value::Null, false)).await;
    assert!(
        out.contains("rc=0") && out.contains("Seccomp:\t0"),
        "{out:?} {err:?}"
    );
}

#[tokio::test]
async fn argument_rules_and_a_default_deny() {
    let a = TestAgent::start().await;
    // IPv4 sockets get EAFNOSUPPORT (97), everything else is allowed; a
    // masked compare on socket's type: SOCK_DGRAM (2) gets EPROTONOSUPPORT (93).
    let profile = json!({
        "defaultAction": "SCMP_ACT_ALLOW",
        "syscalls": [
            {"names": ["socket"], "action": "SCMP_ACT_ERRNO", "errnoRet": 97,
             "args": [{"index": 0, "value": 2, "op": "SCMP_CMP_EQ"}]},
            {"names": ["socket"], "action": "SCMP_ACT_ERRNO", "errnoRet": 93,
             "args": [{"index": 0, "value": 1, "op": "SCMP_CMP_EQ"},
                      {"index": 1, "value": 15, "valueTwo": 2, "op": "SCMP_CMP_MASKED_EQ"}]}
        ]
    });
    let py = "import socket, errno\n\
              def t(f, k):\n\
              \x20   try:\n\
              \x20       socket.socket(f, k).close(); return 'ok'\n\
              \x20   except OSError as e:\n\
              \x20       return errno.errorcode[e.errno]\n\
              print(t(socket.AF_INET, socket.SOCK_STREAM), t(socket.AF_UNIX, socket.SOCK_STREAM), t(socket.AF_UNIX, socket.SOCK_DGRAM))";
    let script = format!(
        "python3 -c \"$(printf '%s' '{}')\"",
        py.replace('\'', "'\\''")
    );
    let (out, err, code) = run(&a, "args", spec(&script, profile, true)).await;
    assert_eq!(code, 0, "{out:?} {err:?}");
    assert_eq!(out.trim(), "EAFNOSUPPORT ok EPROTONOSUPPORT", "{err:?}");

    // A default that denies, with more specific denials stacked on it:
    // nothing is allowed, so the init cannot even exec, and says so.
    let profile = json!({
        "defaultAction": "SCMP_ACT_ERRNO",
        "syscalls": [
            {"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO", "errnoRet": 13},
            {"names": ["rmdir"], "action": "SCMP_ACT_ERRNO"}
        ]
    });
    let rootfs = make_rootfs(&a.path().join("deny-all"));
    create_with_spec(
        &a,
        "deny-all",
        &rootfs,
        spec("echo ran", profile, true),
        false,
    )
    .await
    .expect("create");
    // The start succeeds or fails; either way the shell never runs.
    let started = a.client.start_container(ctx(), &creq("deny-all")).await;
    if started.is_ok() {
        let out = read_all(&a, "deny-all", "", false).await;
        assert!(out.is_empty(), "{:?}", String::from_utf8_lossy(&out));
        assert_ne!(wait(&a, "deny-all", "").await.exit_code, 0);
    }
}

#[tokio::test]
async fn exec_gets_the_containers_profile() {
    let a = TestAgent::start().await;
    let rootfs = make_rootfs(&a.path().join("e"));
    create_with_spec(
        &a,
        "e",
        &rootfs,
        spec("sleep 30", deny_mkdir(), false),
        false,
    )
    .await
    .expect("create");
    a.client
        .start_container(ctx(), &creq("e"))
        .await
        .expect("start");
    let mut req = ExecProcessRequest::new();
    req.container_id = "e".into();
    req.exec_id = "x".into();
    req.oci_process = serde_json::to_vec(&json!({
        "args": ["sh", "-c", MKDIR], "cwd": "/", "user": {"uid": 0, "gid": 0},
        "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]
    }))
    .expect("json");
    a.client.exec_process(ctx(), &req).await.expect("exec");
    let out = String::from_utf8_lossy(&read_all(&a, "e", "x", false).await).into_owned();
    assert!(
        out.contains("rc=1") && out.contains("Seccomp:\t2"),
        "{out:?}"
    );
    a.client
        .delete_container(ctx(), &creq("e"))
        .await
        .expect("delete");
}

#[tokio::test]
async fn what_burrow_cannot_apply_is_refused_clearly() {
    let a = TestAgent::start().await;
    let cases = [
        (
            json!({"defaultAction": "SCMP_ACT_ALLOW", "listenerPath": "/run/agent.sock",
                "syscalls": [{"names": ["mkdir"], "action": "SCMP_ACT_NOTIFY"}]}),
            "listener",
        ),
        (
            json!({"defaultAction": "SCMP_ACT_ALLOW",
                "syscalls": [{"names": ["mkdir"], "action": "SCMP_ACT_NOTIFY"}]}),
            "SCMP_ACT_NOTIFY",
        ),
        (
            json!({"defaultAction": "SCMP_ACT_ALLOW",
                "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ERRNO",
                              "args": [{"index": 6, "value": 1, "op": "SCMP_CMP_EQ"}]}]}),
            "argument index 6",
        ),
    ];
    for (i, (profile, want)) in cases.into_iter().enumerate() {
        let id = format!("bad{i}");
        let rootfs = make_rootfs(&a.path().join(&id));
        let (code, msg) =
            code_of(create_with_spec(&a, &id, &rootfs, spec("true", profile, true), false).await);
        assert_eq!(code, ttrpc::Code::INVALID_ARGUMENT, "{msg}");
        assert!(
            msg.contains(want) && msg.contains("seccomp"),
            "{want}: {msg}"
        );
        assert!(
            !a.path().join("state/containers").join(&id).exists(),
            "{id}: bundle left behind"
        );
    }
}
