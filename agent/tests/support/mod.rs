//! Running burrow-agent in its test mode for the tests in this folder.

use std::ffi::OsStr;
use std::path::Path;
use std::process::Child;
use std::time::{Duration, Instant};

use burrow_protocol::ttrpc;
use burrow_protocol::AgentClient;

/// Start `burrow-agent --listen unix:<dir>/agent.sock --state-dir
/// <dir>/state` with `args` added and `RUST_LOG=rust_log`, and connect to
/// it, waiting up to 20 s for it to come up. The caller owns the child.
pub async fn spawn_agent(dir: &Path, args: &[&OsStr], rust_log: &str) -> (Child, AgentClient) {
    let sock = dir.join("agent.sock");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_burrow-agent"))
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .args(args)
        .env("RUST_LOG", rust_log)
        .spawn()
        .expect("spawn burrow-agent");
    let deadline = Instant::now() + Duration::from_secs(20);
    let addr = format!("unix://{}", sock.display());
    let client = loop {
        if sock.exists() {
            if let Ok(c) = ttrpc::r#async::Client::connect(&addr).await {
                break c;
            }
        }
        assert!(Instant::now() < deadline, "agent did not come up on {addr}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    (child, AgentClient::new(client))
}
