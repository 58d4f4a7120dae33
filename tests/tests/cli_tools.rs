//! `burrow exec|read|write|ls|edit` against a real sandbox started through
//! containerd (`ctr run -d`), as a platform would use them from the host:
//! output and exit status, files round-tripped through the guest, a unique
//! edit and a refused ambiguous one, paged reads, and a hibernated sandbox
//! that wakes for the next tool call. Run inside hack/testhost.

#![allow(clippy::unwrap_used)]

use burrow_tests::containerd::{Containerd, Run, LONG};

const ID: &str = "t-tools";

/// `burrow exec ID ARGS...`.
fn exec(c: &Containerd, args: &[&str]) -> Run {
    let mut all = vec!["exec", ID];
    all.extend_from_slice(args);
    c.burrow(&all)
}

/// `burrow exec ID ARGS...` with its stdout read as it comes: when its
/// first line arrived, its exit status, its stdout, and when it ended.
fn exec_timed(
    c: &Containerd,
    args: &[&str],
) -> (
    std::time::Duration,
    Option<i32>,
    String,
    std::time::Duration,
) {
    use std::io::BufRead;
    let start = std::time::Instant::now();
    let mut child = std::process::Command::new(burrow_tests::workspace_bin("burrow"))
        .args(["exec", ID])
        .args(args)
        .env("BURROW_CONFIG", c.dir().join("burrow.toml"))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut all = String::new();
    out.read_line(&mut all).unwrap();
    let first_at = start.elapsed();
    std::io::Read::read_to_string(&mut out, &mut all).unwrap();
    let status = child.wait().unwrap();
    (first_at, status.code(), all, start.elapsed())
}

fn ok(c: &Containerd, what: &str, r: &Run) {
    assert_eq!(r.code, Some(0), "{what}: {r:?}\n{}", c.diagnostics());
}

#[test]
fn cli_tools_exec_files_edit_paging_and_wake_from_hibernation() {
    let c = Containerd::nested("cli-tools");
    let r = c.ctr(&Containerd::run_args(&["-d"], ID, &["sleep", "100000"]));
    ok(&c, "ctr run -d", &r);
    c.wait_status(ID, "RUNNING", LONG);

    // exec: both streams, and the command's own exit status.
    let r = exec(&c, &["--", "sh", "-c", "echo hi; echo oops >&2; exit 3"]);
    assert_eq!(
        r.code,
        Some(3),
        "exit 3 must come back as 3: {r:?}\n{}",
        c.diagnostics()
    );
    assert_eq!(r.stdout, "hi\n", "{r:?}");
    assert!(r.stderr.starts_with("oops\n"), "{r:?}");
    // --cwd and --env reach the command.
    let r = exec(
        &c,
        &[
            "--cwd",
            "/tmp",
            "-e",
            "GREETING=hello",
            "--",
            "sh",
            "-c",
            "echo $GREETING from $(pwd)",
        ],
    );
    ok(&c, "exec with --cwd and --env", &r);
    assert_eq!(r.stdout, "hello from /tmp\n", "{r:?}");

    // A flood streams through whole (nothing of it is kept on the way:
    // the shim passes each piece on as it comes, its pipe filling while
    // the caller is slow), and nothing is said about a cut.
    let r = exec(
        &c,
        &["--", "sh", "-c", "head -c 1000000 /dev/zero | tr '\\0' a"],
    );
    ok(&c, "exec a flood", &r);
    assert_eq!(r.stdout.len(), 1_000_000, "{}", r.stderr);
    assert!(r.stdout.bytes().all(|b| b == b'a'));
    assert!(!r.stderr.contains("cut"), "{}", r.stderr);

    // Output arrives as the command writes it, long before it ends, and
    // the exit status is the command's.
    let (first_at, code, out, took) = exec_timed(
        &c,
        &[
            "--",
            "sh",
            "-c",
            "echo first; sleep 5; echo second >&2; exit 7",
        ],
    );
    assert_eq!(code, Some(7), "{out:?}\n{}", c.diagnostics());
    assert_eq!(out, "first\n");
    assert!(
        took.saturating_sub(first_at) >= std::time::Duration::from_secs(3),
        "\"first\" came {first_at:?} after the start, the command ended after {took:?}"
    );

    // -t: the command runs on a terminal in the guest (both streams on it,
    // with its line endings), and its status is still its own.
    let r = exec(
        &c,
        &[
            "-t",
            "--",
            "sh",
            "-c",
            "tty; [ -t 1 ] && echo on-a-tty; echo err >&2; exit 4",
        ],
    );
    assert_eq!(r.code, Some(4), "{r:?}\n{}", c.diagnostics());
    assert!(r.stdout.starts_with("/dev/pts/"), "{r:?}");
    assert!(
        r.stdout.contains("on-a-tty\r\n") && r.stdout.contains("err\r\n"),
        "{r:?}"
    );
    let r = exec(&c, &["--", "sh", "-c", "tty || true"]);
    assert_eq!(r.stdout, "not a tty\n", "without -t no terminal: {r:?}");
    // A command past its timeout is killed: status 124, its output so far.
    let r = exec(
        &c,
        &[
            "--timeout",
            "10",
            "--",
            "sh",
            "-c",
            "echo started; exec sleep 1000",
        ],
    );
    assert_eq!(r.code, Some(124), "{r:?}\n{}", c.diagnostics());
    assert_eq!(r.stdout, "started\n", "{r:?}");
    assert!(r.stderr.contains("killed after 10 s"), "{r:?}");
    // A sandbox that does not exist: one clear line, burrow's own status.
    let r = c.burrow(&["exec", "t-nosuch", "--", "true"]);
    assert_eq!(r.code, Some(125), "{r:?}");
    assert!(
        r.stderr.starts_with("burrow exec:")
            && r.stderr.contains("t-nosuch")
            && r.stderr.lines().count() == 1,
        "{r:?}"
    );

    // write + read round trip; the file is in the container for its own
    // processes too.
    let text = "one\ntwo\nthree\n";
    let r = c.burrow_with(&["write", ID, "/tmp/notes/a.txt"], Some(text.as_bytes()));
    ok(&c, "write", &r);
    let r = c.burrow(&["read", ID, "/tmp/notes/a.txt"]);
    ok(&c, "read", &r);
    assert_eq!(r.stdout, text, "{r:?}");
    assert!(r.stderr.contains("lines 1-3 of 3, 0 remain"), "{r:?}");
    let r = c.burrow(&["exec", ID, "--", "cat", "/tmp/notes/a.txt"]);
    ok(&c, "cat the written file", &r);
    assert_eq!(r.stdout, text, "{r:?}");

    // ls lists it with its size.
    let r = c.burrow(&["ls", ID, "/tmp/notes"]);
    ok(&c, "ls", &r);
    let line = r
        .stdout
        .lines()
        .find(|l| l.ends_with(" a.txt"))
        .unwrap_or_else(|| panic!("no a.txt in {r:?}"));
    assert!(
        line.starts_with("-rw-r--r--") && line.contains(" 14 "),
        "{line:?}"
    );

    // edit: a unique match is replaced; an ambiguous one changes nothing.
    let r = c.burrow(&[
        "edit",
        ID,
        "/tmp/notes/a.txt",
        "--old",
        "two",
        "--new",
        "TWO",
    ]);
    ok(&c, "edit", &r);
    assert!(r.stdout.contains("line 2"), "{r:?}");
    let r = c.burrow(&["edit", ID, "/tmp/notes/a.txt", "--old", "e", "--new", "E"]);
    assert_eq!(
        r.code,
        Some(1),
        "an edit of a text that occurs 3 times must fail: {r:?}"
    );
    assert!(
        r.stderr.contains("3 times") && r.stderr.lines().count() == 1,
        "{r:?}"
    );
    let r = c.burrow(&["exec", ID, "--", "cat", "/tmp/notes/a.txt"]);
    assert_eq!(r.stdout, "one\nTWO\nthree\n", "{r:?}");

    // read pages 500 lines at a time and says how many remain.
    let lines: String = (1..=1200).map(|i| format!("line {i}\n")).collect();
    let r = c.burrow_with(&["write", ID, "/tmp/n.txt"], Some(lines.as_bytes()));
    ok(&c, "write 1200 lines", &r);
    let r = c.burrow(&["read", ID, "/tmp/n.txt"]);
    ok(&c, "read page 1", &r);
    let got: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(
        (got.len(), got.first(), got.last()),
        (500, Some(&"line 1"), Some(&"line 500")),
        "{}",
        r.stderr
    );
    assert!(
        r.stderr
            .contains("of 1200, 700 remain; next: --lines 501:1000"),
        "{r:?}"
    );
    let r = c.burrow(&["read", ID, "/tmp/n.txt", "--lines", "1001:"]);
    ok(&c, "read the last page", &r);
    let got: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(
        (got.len(), got.first(), got.last()),
        (200, Some(&"line 1001"), Some(&"line 1200"))
    );
    assert!(
        r.stderr.contains("lines 1001-1200 of 1200, 0 remain"),
        "{r:?}"
    );
    let r = c.burrow(&["read", ID, "/tmp/nope"]);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(
        r.stderr.starts_with("burrow read:") && r.stderr.contains("/tmp/nope"),
        "{r:?}"
    );
    // A path outside the container's root: `..` and an absolute symlink
    // stop at that root, so nothing of the host is read (a file planted
    // there is not found) and the error is one clear line.
    let host_file = std::env::temp_dir().join("burrow-cli-tools-host-only");
    std::fs::write(&host_file, "host only\n").unwrap();
    ok(
        &c,
        "ln -s",
        &exec(&c, &["--", "ln", "-s", "/../../../..", "/tmp/up"]),
    );
    for p in [
        format!("/../../../..{}", host_file.display()),
        format!("/tmp/up{}", host_file.display()),
    ] {
        let r = c.burrow(&["read", ID, &p]);
        assert_eq!(r.code, Some(1), "{p}: {r:?}");
        assert!(
            !r.stdout.contains("host only") && r.stderr.lines().count() == 1,
            "{p}: {r:?}"
        );
    }
    let _ = std::fs::remove_file(&host_file);

    // Hibernated: the next tool call wakes it, and the container's files
    // are still there.
    let r = c.burrow(&["sandbox", "hibernate", ID]);
    ok(&c, "hibernate", &r);
    assert!(r.stdout.contains("asleep"), "{r:?}");
    let r = c.burrow(&["sandbox", "ls"]);
    assert!(
        r.stdout
            .lines()
            .any(|l| l.contains(ID) && l.contains("asleep")),
        "{r:?}"
    );
    let r = c.burrow(&["exec", ID, "--", "sh", "-c", "cat /tmp/notes/a.txt; exit 5"]);
    assert_eq!(
        r.code,
        Some(5),
        "exec after hibernate: {r:?}\n{}",
        c.diagnostics()
    );
    assert_eq!(r.stdout, "one\nTWO\nthree\n", "{r:?}");
    // The audit log has the calls from before the hibernation and the one
    // that woke it.
    let audit = c.burrow(&["audit", ID, "--json"]);
    let execs: Vec<&str> = audit
        .stdout
        .lines()
        .filter(|l| l.contains("\"tool\":\"exec\""))
        .collect();
    assert!(
        execs.iter().any(|l| l.contains("\"exit_status\":3"))
            && execs
                .last()
                .is_some_and(|l| l.contains("\"exit_status\":5")),
        "{audit:?}"
    );
    let r = c.burrow(&["sandbox", "ls"]);
    assert!(
        r.stdout
            .lines()
            .any(|l| l.contains(ID) && l.contains("running")),
        "{r:?}"
    );

    ok(&c, "kill", &c.ctr(&["task", "kill", "-s", "SIGKILL", ID]));
    c.wait_status(ID, "STOPPED", LONG);
    ok(&c, "task delete", &c.ctr(&["task", "delete", ID]));
    ok(&c, "container rm", &c.ctr(&["containers", "rm", ID]));
}

/// The offset a stopped `burrow exec --attach` says to read on from.
fn read_on_from(r: &Run) -> u64 {
    let at = r
        .stderr
        .rfind("--from ")
        .unwrap_or_else(|| panic!("no --from in {r:?}"));
    r.stderr[at + 7..]
        .split_whitespace()
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("bad --from in {r:?}"))
}

#[test]
fn cli_tools_a_detached_exec_survives_hibernation_and_checkpoint_restore() {
    const SRC: &str = "t-sess";
    const RESTORED: &str = "t-sess-r";
    let c = Containerd::nested("cli-sessions");
    let r = c.ctr(&Containerd::run_args(&["-d"], SRC, &["sleep", "100000"]));
    ok(&c, "ctr run -d", &r);
    c.wait_status(SRC, "RUNNING", LONG);
    let burrow = |args: &[&str]| c.burrow(args);

    // Each step waits for a file the test makes, so what was printed when
    // is certain.
    let script = "echo one; echo err >&2; \
        while [ ! -e /tmp/go1 ]; do sleep 1; done; echo two; \
        while [ ! -e /tmp/go2 ]; do sleep 1; done; echo three; exit 7";
    let r = burrow(&["exec", SRC, "--detach", "--", "sh", "-c", script]);
    ok(&c, "exec --detach", &r);
    let session = r.stdout.trim().to_string();
    assert!(
        session.starts_with('s') && r.stderr.contains("--attach"),
        "{r:?}"
    );

    // The output so far; the caller stops there and keeps its offset.
    let mut got = String::new();
    let mut from = 0;
    while !got.contains("one\n") || !got.contains("err\n") {
        let r = burrow(&[
            "exec",
            SRC,
            "--attach",
            &session,
            "--from",
            &from.to_string(),
            "--wait",
            "60",
        ]);
        ok(&c, "attach", &r);
        assert!(r.stderr.contains("is running; read on with"), "{r:?}");
        got.push_str(&r.stdout);
        from = read_on_from(&r);
    }
    assert_eq!(from, 8, "{got:?}");

    // Hibernated: the next attach wakes it and reads on from the offset,
    // and the command went on from where it was.
    ok(
        &c,
        "touch go1",
        &burrow(&["exec", SRC, "--", "touch", "/tmp/go1"]),
    );
    ok(&c, "hibernate", &burrow(&["sandbox", "hibernate", SRC]));
    let r = burrow(&[
        "exec", SRC, "--attach", &session, "--from", "8", "--wait", "120",
    ]);
    ok(&c, "attach after hibernation", &r);
    assert_eq!(r.stdout, "two\n", "{r:?}\n{}", c.diagnostics());
    assert_eq!(read_on_from(&r), 12, "{r:?}");
    let audit = burrow(&["audit", SRC, "--json"]);
    assert!(
        audit
            .stdout
            .lines()
            .filter(|l| l.contains("\"tool\":\"attach\""))
            .count()
            >= 2,
        "{audit:?}"
    );

    // A checkpoint, restored as another container: the session is there,
    // with its output, and finishes there.
    let cp = c.ctr(&["containers", "checkpoint", "--task", "--rw", SRC, "cp-sess"]);
    ok(&c, "ctr c checkpoint", &cp);
    c.wait_status(SRC, "RUNNING", LONG);
    let r = c.ctr(&["containers", "restore", "--live", RESTORED, "cp-sess"]);
    ok(&c, "ctr c restore", &r);
    c.wait_status(RESTORED, "RUNNING", LONG);
    ok(
        &c,
        "touch go2",
        &burrow(&["exec", RESTORED, "--", "touch", "/tmp/go2"]),
    );
    let r = burrow(&["exec", RESTORED, "--attach", &session, "--from", "12"]);
    assert_eq!(
        (r.code, r.stdout.as_str()),
        (Some(7), "three\n"),
        "attach after restore follows to the end, with the command's status: {r:?}\n{}",
        c.diagnostics()
    );
    // All of it is still there from 0; the source's own copy runs on
    // (its go2 was never made).
    let r = burrow(&["exec", RESTORED, "--attach", &session]);
    assert_eq!(r.code, Some(7), "{r:?}");
    let mut lines: Vec<&str> = r.stdout.lines().collect();
    lines.sort();
    assert_eq!(lines, ["err", "one", "three", "two"], "{r:?}");
    let r = burrow(&[
        "exec", SRC, "--attach", &session, "--from", "12", "--wait", "0",
    ]);
    ok(&c, "the source's session", &r);
    assert!(
        r.stdout.is_empty() && r.stderr.contains("is running"),
        "{r:?}"
    );

    // No such session, or an offset past the end: a clear error; the
    // sandbox keeps working.
    let r = burrow(&["exec", SRC, "--attach", "s999"]);
    assert_eq!(r.code, Some(125), "{r:?}");
    assert!(r.stderr.contains("no session \"s999\""), "{r:?}");
    let r = burrow(&[
        "exec", SRC, "--attach", &session, "--from", "999999", "--wait", "0",
    ]);
    assert_eq!(r.code, Some(125), "{r:?}");
    assert!(r.stderr.contains("past the end"), "{r:?}");
    let r = burrow(&["exec", SRC, "--", "echo", "still here"]);
    assert_eq!(
        (r.code, r.stdout.as_str()),
        (Some(0), "still here\n"),
        "{r:?}"
    );

    for id in [SRC, RESTORED] {
        ok(&c, "kill", &c.ctr(&["task", "kill", "-s", "SIGKILL", id]));
        c.wait_status(id, "STOPPED", LONG);
        ok(&c, "task delete", &c.ctr(&["task", "delete", id]));
        ok(&c, "container rm", &c.ctr(&["containers", "rm", id]));
    }
}
