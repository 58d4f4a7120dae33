//! The shim binary's two helper roles, run for real (as root, as the
//! shim runs): the network-namespace holder whose pid is a `ctr run`
//! task's, and `check-network` (`burrow check`'s network part).

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use burrow_shim::vm::netns::Holder;

const SHIM: &str = env!("CARGO_BIN_EXE_containerd-shim-burrow-v2");

fn netns_of(pid: &str) -> std::path::PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/net")).unwrap()
}

/// 'Z' once the process has exited (nobody reaps it here), or gone.
fn ended(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| {
            s.rsplit(')')
                .next()
                .unwrap_or("")
                .trim_start()
                .starts_with('Z')
        })
        .unwrap_or(true)
}

#[test]
fn the_holder_lives_in_a_namespace_of_its_own_until_dropped() {
    let holder = Holder::spawn_from(Path::new(SHIM)).unwrap();
    let pid = holder.pid();
    let theirs = netns_of(&pid.to_string());
    assert_ne!(theirs, netns_of("self"), "the holder is in a new namespace");
    assert_eq!(
        std::fs::read_link(holder.path()).unwrap(),
        theirs,
        "the shim's handle names the holder's namespace"
    );
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    assert!(String::from_utf8_lossy(&cmdline).contains("netns-holder"));
    std::thread::sleep(Duration::from_millis(200));
    assert!(!ended(pid), "the holder waits while its shim holds it");
    drop(holder);
    let t = Instant::now();
    while !ended(pid) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "holder {pid} outlived its handle"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn check_network_says_what_works_and_what_does_not() {
    let ok = Command::new(SHIM).arg("check-network").output().unwrap();
    let text = String::from_utf8_lossy(&ok.stdout);
    assert!(ok.status.success(), "{ok:?}");
    for part in ["tap", "tap up", "nftables netdev table"] {
        assert!(
            text.lines()
                .any(|l| l.starts_with(part) && l.ends_with(": ok")),
            "{part}: {text}"
        );
    }
    // Without nft on PATH the egress table cannot be loaded: said, and the
    // exit status says so too.
    let no_nft = Command::new(SHIM)
        .arg("check-network")
        .env("PATH", "/nonexistent")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&no_nft.stdout);
    assert_eq!(no_nft.status.code(), Some(1), "{no_nft:?}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("nftables netdev table") && l.contains(": no: ")),
        "{text}"
    );
    assert!(text
        .lines()
        .any(|l| l.starts_with("tap") && l.ends_with(": ok")));
}
