//! Detached sessions on the agent in test mode (`burrow-agent --listen
//! unix:PATH`): output kept in the agent and read by offset, long after,
//! with the exit status; a timeout kills; a flood keeps its last bytes and
//! says how many were dropped. Needs root, as the agent does.

use burrow_protocol::agent::*;
use burrow_protocol::MAX_SESSION_BUFFER;

mod support;

use support::{ctx, TestAgent};

async fn start(a: &TestAgent, script: &str, timeout_secs: u64) -> StartSessionResponse {
    let req = StartSessionRequest {
        container_id: String::new(),
        oci_process: serde_json::to_vec(&serde_json::json!({
            "args": ["sh", "-c", script],
            "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"],
            "cwd": "/",
            "user": {"uid": 0, "gid": 0},
        }))
        .expect("json"),
        timeout_secs,
        ..Default::default()
    };
    a.client.start_session(ctx(), &req).await.expect("start")
}

async fn read(a: &TestAgent, id: &str, offset: u64, wait_ms: u32) -> ReadSessionResponse {
    let req = ReadSessionRequest {
        session_id: id.into(),
        offset,
        wait_ms,
        ..Default::default()
    };
    a.client.read_session(ctx(), &req).await.expect("read")
}

/// Everything from `offset` until done.
async fn read_to_end(a: &TestAgent, id: &str, mut offset: u64) -> (Vec<u8>, ReadSessionResponse) {
    let mut all = Vec::new();
    loop {
        let r = read(a, id, offset, 10_000).await;
        all.extend_from_slice(&r.data);
        offset = r.start + r.data.len() as u64;
        if r.done {
            return (all, r);
        }
    }
}

#[tokio::test]
async fn a_session_keeps_its_output_for_a_reader_that_comes_back() {
    let a = TestAgent::start().await;
    let s = start(&a, "echo one; echo two >&2; sleep 1; echo three; exit 4", 0).await;
    assert!(s.session_id.starts_with('s'), "{s:?}");
    // The first lines, then the reader goes away (nothing reads the pipes).
    let mut got = Vec::new();
    while got.len() < 8 {
        let r = read(&a, &s.session_id, got.len() as u64, 10_000).await;
        assert!(!r.done, "{r:?}");
        got.extend_from_slice(&r.data);
    }
    let mut lines: Vec<&str> = std::str::from_utf8(&got).unwrap().lines().collect();
    lines.sort();
    assert_eq!(lines, ["one", "two"]);
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    // It read on from its offset: only what came after, and the status.
    let (rest, end) = read_to_end(&a, &s.session_id, 8).await;
    assert_eq!(rest, b"three\n");
    assert_eq!(
        (end.exit_code, end.signal, end.timed_out, end.end),
        (4, 0, false, 14)
    );
    // Read again from 0: all of it is still there.
    let (all, _) = read_to_end(&a, &s.session_id, 0).await;
    assert_eq!(all.len(), 14);
    // No such session: a clear error.
    let req = ReadSessionRequest {
        session_id: "s999".into(),
        ..Default::default()
    };
    let e = a.client.read_session(ctx(), &req).await.unwrap_err();
    assert!(
        format!("{e:?}").contains("s999") && format!("{e:?}").contains("NOT_FOUND"),
        "{e:?}"
    );
}

#[tokio::test]
async fn a_flood_keeps_its_last_bytes_and_a_timeout_kills() {
    let a = TestAgent::start().await;
    let s = start(&a, "head -c 3000000 /dev/zero; echo end", 0).await;
    let (_, end) = read_to_end(&a, &s.session_id, u64::MAX).await;
    assert_eq!(end.end, 3_000_004);
    let r = read(&a, &s.session_id, 0, 0).await;
    assert_eq!(r.dropped, 3_000_004 - MAX_SESSION_BUFFER as u64);
    assert_eq!(r.start, r.dropped);
    let (all, _) = read_to_end(&a, &s.session_id, 0).await;
    assert_eq!(all.len(), MAX_SESSION_BUFFER);
    assert!(all.ends_with(b"\0end\n"));

    let s = start(&a, "echo started; exec sleep 1000", 1).await;
    let (out, end) = read_to_end(&a, &s.session_id, 0).await;
    assert_eq!(out, b"started\n");
    assert_eq!((end.timed_out, end.signal), (true, 9), "{end:?}");
}
