//! `burrow mcp --http` end to end, with rmcp's own Streamable HTTP client:
//! the real binary on a loopback port (port 0, read back from stderr) and
//! on a unix socket, against an empty state directory (no sandbox, so no
//! VM is needed); and the addresses it must refuse.

#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use rmcp::model::{CallToolRequestParams, CallToolResult, ContentBlock};
use rmcp::service::RunningService;
use rmcp::transport::StreamableHttpClientTransport;
use rmcp::{RoleClient, ServiceExt};

/// A running `burrow mcp --http`, killed when dropped.
struct Server {
    child: Child,
    /// What it printed after "listening on ".
    addr: String,
}

impl Server {
    fn start(state: &Path, http: &str) -> Server {
        let mut child = burrow_mcp(state, http)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        // Keeps draining stderr for the server's whole life.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let mut seen = Vec::new();
        let addr = loop {
            match rx.recv_timeout(Duration::from_secs(30)) {
                Ok(line) => match line.split_once("listening on ") {
                    Some((_, a)) => break a.to_string(),
                    None => seen.push(line),
                },
                Err(e) => panic!("no 'listening on' from burrow mcp ({e}); stderr: {seen:?}"),
            }
        };
        Server { child, addr }
    }
}

/// `burrow mcp --http HTTP --state-dir STATE`, stdin closed.
fn burrow_mcp(state: &Path, http: &str) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_burrow"));
    cmd.args(["mcp", "--http", http, "--state-dir"])
        .arg(state)
        .stdin(Stdio::null());
    cmd
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn text(r: &CallToolResult) -> String {
    r.content
        .iter()
        .filter_map(|c| match c {
            ContentBlock::Text(t) => Some(t.text.as_str()),
            _ => None,
        })
        .collect()
}

fn args(v: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
    v.as_object().unwrap().clone()
}

/// The same checks over either transport: the tools are the stdio
/// server's, an empty state directory lists no sandbox (not an error), and
/// a tool on a sandbox that is not there fails naming it.
async fn check_tools(client: &RunningService<RoleClient, ()>) {
    let tools = client.list_all_tools().await.unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    for want in [
        "exec",
        "read_output",
        "read_file",
        "write_file",
        "edit_file",
        "list_dir",
        "checkpoint",
        "sandboxes_list",
        "browser_navigate",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    let exec = tools.iter().find(|t| t.name == "exec").unwrap();
    assert!(
        exec.input_schema
            .get("properties")
            .is_some_and(|p| p.get("command").is_some()),
        "exec's schema has no command: {:?}",
        exec.input_schema
    );

    let listed = client
        .call_tool(
            CallToolRequestParams::new("sandboxes_list")
                .with_arguments(args(serde_json::json!({}))),
        )
        .await
        .unwrap();
    assert_ne!(listed.is_error, Some(true), "{}", text(&listed));
    assert!(
        text(&listed).contains("no sandboxes in namespace \"default\""),
        "{}",
        text(&listed)
    );

    let ran = client
        .call_tool(CallToolRequestParams::new("exec").with_arguments(args(
            serde_json::json!({"sandbox": "no-such-box", "command": "echo hi"}),
        )))
        .await
        .unwrap();
    assert_eq!(ran.is_error, Some(true), "{}", text(&ran));
    assert!(text(&ran).contains("no-such-box"), "{}", text(&ran));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_port_zero_serves_the_tools() {
    let state = tempfile::tempdir().unwrap();
    let server = Server::start(state.path(), "127.0.0.1:0");
    let url = server.addr.clone();
    let port: u16 = url
        .strip_prefix("http://127.0.0.1:")
        .and_then(|r| r.strip_suffix("/mcp"))
        .unwrap_or_else(|| panic!("unexpected address {url}"))
        .parse()
        .unwrap();
    assert_ne!(port, 0, "the real port is printed, not 0");

    let client = ().serve(StreamableHttpClientTransport::from_uri(url)).await.unwrap();
    let info = client.peer_info().unwrap();
    assert_eq!(info.server_info.as_ref().unwrap().name, "burrow");
    check_tools(&client).await;
    client.cancel().await.unwrap();

    // A web page that rebinds a name of its own to 127.0.0.1 sends its own
    // Host: refused; the same request with a loopback Host is served.
    assert_eq!(raw_initialize(port, "evil.example"), 403);
    assert_eq!(raw_initialize(port, &format!("127.0.0.1:{port}")), 200);
}

/// POST an initialize request by hand with `host` as the Host header; the
/// response's status code.
fn raw_initialize(port: u16, host: &str) -> u16 {
    use std::io::{Read, Write};
    let body = r#"{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-06-18","capabilities":{},"clientInfo":{"name":"raw","version":"0"}}}"#;
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    write!(
        s,
        "POST /mcp HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Accept: application/json, text/event-stream\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut head = [0u8; 12];
    s.read_exact(&mut head).unwrap();
    let head = String::from_utf8_lossy(&head);
    head.strip_prefix("HTTP/1.1 ")
        .and_then(|r| r.trim().parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {head:?}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_socket_serves_the_tools_0600_and_is_removed_on_sigterm() {
    let state = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("mcp.sock");
    let mut server = Server::start(state.path(), &format!("unix:{}", sock.display()));
    assert_eq!(server.addr, format!("unix:{}", sock.display()));
    let meta = std::fs::symlink_metadata(&sock).unwrap();
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    // Only the socket is left in its directory (the private one it was
    // bound in is gone).
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("mcp.sock")]);

    let transport = StreamableHttpClientTransport::from_unix_socket(
        sock.to_str().unwrap(),
        "http://localhost/mcp",
    );
    let client = ().serve(transport).await.unwrap();
    check_tools(&client).await;
    client.cancel().await.unwrap();

    // A second server must not take over the live socket.
    let second = burrow_mcp(state.path(), &format!("unix:{}", sock.display()))
        .output()
        .unwrap();
    assert!(!second.status.success());
    assert!(
        String::from_utf8_lossy(&second.stderr).contains("in use"),
        "{second:?}"
    );

    let term = Command::new("kill")
        .args(["-TERM", &server.child.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let status = server.child.wait().unwrap();
    assert!(status.success(), "SIGTERM is a clean stop: {status:?}");
    assert!(!sock.exists(), "the socket is removed on exit");
}

#[test]
fn unix_socket_does_not_clobber_a_file() {
    let state = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("notes.txt");
    std::fs::write(&file, "keep me").unwrap();
    let out = burrow_mcp(state.path(), &format!("unix:{}", file.display()))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a socket"), "{err}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me");
}

#[test]
fn non_loopback_addresses_are_refused() {
    let state = tempfile::tempdir().unwrap();
    for addr in ["0.0.0.0:1234", "[::]:1234", "192.168.1.10:80"] {
        let out = burrow_mcp(state.path(), addr).output().unwrap();
        assert!(!out.status.success(), "{addr} was accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("refusing to listen on"), "{addr}: {err}");
        assert!(err.contains("loopback"), "{addr}: {err}");
    }
}
