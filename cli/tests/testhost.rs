//! hack/testhost's contract, tested from this machine: a command's stdout,
//! stderr and exit status come back; a hung test host is killed at its
//! timeout; a missing kernel is refused with a message that says what to do.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

fn testhost() -> Command {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut cmd = Command::new(root.join("hack/testhost"));
    cmd.current_dir(root);
    cmd
}

#[test]
fn command_output_and_status_come_back() {
    let out = testhost()
        .args(["--", "sh", "-c", "echo out; echo err >&2; test -c /dev/kvm && grep -qw svm /proc/cpuinfo && exit 7"])
        .output()
        .expect("run hack/testhost");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "stdout: {stdout}\nstderr: {stderr}");
    assert_eq!(stdout, "out\n");
    assert!(stderr.starts_with("err\n"), "stderr: {stderr}");
}

#[test]
fn a_hung_test_host_is_killed_at_its_timeout() {
    let start = Instant::now();
    let out = testhost()
        .args(["--timeout", "20", "--", "sleep", "600"])
        .output()
        .expect("run hack/testhost");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(124), "stderr: {stderr}");
    assert!(stderr.contains("timed out after 20s"), "stderr: {stderr}");
    assert!(start.elapsed() < Duration::from_secs(60), "took {:?}", start.elapsed());
}

#[test]
fn a_missing_kernel_is_refused_with_what_to_do() {
    let out = testhost()
        .env("BURROW_CACHE", "/nonexistent/burrow-cache")
        .args(["--", "true"])
        .output()
        .expect("run hack/testhost");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains("hack/testhost --prepare"), "stderr: {stderr}");
}
