//! The shim under load, through `ctr`: many VMs one after another and
//! several at once. Apart from shim_ctr.rs so that these, the longest and
//! heaviest runs in the nested test host, are one test-host run of their own
//! (a test-host freeze retries only them). Run inside hack/testhost (or on a
//! host with hardware KVM).

#![allow(clippy::unwrap_used)]

use burrow_tests::containerd::{run, wait_output, Containerd, CLEAN, LONG};
use burrow_tests::ps::ps_rows;

fn containerd(name: &str) -> Containerd {
    Containerd::nested(name)
}

/// How many times the repeat test runs each command (BURROW_TEST_REPEAT;
/// 8 by default: at 12, its 24 nested VM starts took most of shim_load's 873 s).
fn repeats() -> usize {
    std::env::var("BURROW_TEST_REPEAT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(8)
}

/// hack/demo's command, many times: `ps`, the container's last command, is
/// its PID 1 and must list itself in every run (hack/demo once printed only
/// the header). And a process's last line before it exits must always
/// arrive, after everything it printed before.
#[test]
fn every_line_arrives_in_repeated_runs() {
    let c = containerd("repeat");
    let n = repeats();
    let mut failures = Vec::new();
    for i in 0..n {
        let id = format!("t-ps-{i}");
        let r = c.ctr(&run(
            &["--rm"],
            &id,
            &["sh", "-c", "echo \"hello: kernel $(uname -r), $(grep -c ^processor /proc/cpuinfo) vCPU\"; echo visible:; ps -o pid,comm"],
        ));
        let lines: Vec<&str> = r.stdout.lines().collect();
        let ok = r.code == Some(0)
            && lines.len() == 4
            && lines[0].starts_with("hello: kernel ")
            && lines[1] == "visible:"
            && ps_rows(&lines[1..]) == [(1, "ps".to_string())];
        if !ok {
            failures.push(format!("ps, run {i}: {r:?}"));
        }
    }
    let expected: String =
        (1..=300).map(|k| format!("{k}\n")).collect::<String>() + "the last line\n";
    for i in 0..n {
        let id = format!("t-last-{i}");
        let r = c.ctr(&run(
            &["--rm"],
            &id,
            &["sh", "-c", "seq 1 300; echo the last line"],
        ));
        if r.code != Some(0) || r.stdout != expected {
            failures.push(format!(
                "last line, run {i}: code {:?}, stdout ends {:?}, stderr {:?}",
                r.code,
                r.stdout.get(r.stdout.len().saturating_sub(40)..),
                r.stderr
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} runs lost output:\n{}\n{}",
        failures.len(),
        2 * n,
        failures.join("\n"),
        c.diagnostics()
    );
    c.assert_clean(CLEAN);
}

#[test]
fn five_containers_at_once() {
    let c = containerd("five");
    let ids: Vec<String> = (0..5).map(|i| format!("t-five-{i}")).collect();
    let children: Vec<_> = ids
        .iter()
        .map(|id| {
            let msg = format!("hello {id}");
            c.spawn_ctr(&run(&["--rm"], id, &["echo", &msg]))
        })
        .collect();
    for (id, child) in ids.iter().zip(children) {
        let (out, killed) = wait_output(child, LONG);
        assert!(!killed, "{id} hung\n{}", c.diagnostics());
        assert_eq!(
            out.status.code(),
            Some(0),
            "{id}: {out:?}\n{}",
            c.diagnostics()
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            format!("hello {id}")
        );
    }
    c.assert_clean(CLEAN);
}
