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

/// `burrow exec -t ID ARGS...` on a pseudo-terminal of its own (its
/// controlling terminal, `rows`x`cols`), as a user's shell runs it.
struct OnPty {
    child: std::process::Child,
    master: std::fs::File,
    /// The terminal's other end, kept to look at its settings.
    slave: std::os::fd::OwnedFd,
    /// Everything the terminal showed so far.
    seen: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
    /// The terminal's local modes before burrow ran.
    cooked: libc::tcflag_t,
}

fn lflag(fd: &std::os::fd::OwnedFd) -> libc::tcflag_t {
    use std::os::fd::AsRawFd;
    // SAFETY: tcgetattr writes one termios into `t`, which outlives it.
    let mut t: libc::termios = unsafe { std::mem::zeroed() };
    // SAFETY: see above.
    assert_eq!(unsafe { libc::tcgetattr(fd.as_raw_fd(), &mut t) }, 0);
    t.c_lflag
}

impl OnPty {
    fn spawn(c: &Containerd, args: &[&str], rows: u16, cols: u16) -> Self {
        use std::os::fd::{FromRawFd, OwnedFd};
        use std::os::unix::process::CommandExt;
        let (mut m, mut s) = (0, 0);
        let ws = burrow_tests::winsize(rows, cols);
        // SAFETY: openpty writes two new fds into m and s and reads `ws`.
        let rc = unsafe {
            libc::openpty(&mut m, &mut s, std::ptr::null_mut(), std::ptr::null(), &ws)
        };
        assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
        // SAFETY: openpty made them; nothing else owns them.
        let (master, slave) = unsafe { (std::fs::File::from_raw_fd(m), OwnedFd::from_raw_fd(s)) };
        let cooked = lflag(&slave);
        let io = || std::process::Stdio::from(slave.try_clone().unwrap());
        let mut cmd = std::process::Command::new(burrow_tests::workspace_bin("burrow"));
        cmd.args(["exec", "-t", ID])
            .args(args)
            .env("BURROW_CONFIG", c.dir().join("burrow.toml"))
            .env("TERM", "xterm")
            .stdin(io())
            .stdout(io())
            .stderr(io());
        // SAFETY: setsid and ioctl are async-signal-safe; the child makes
        // the terminal (its stdin) its controlling one, so that a resize
        // sends it SIGWINCH as a user's terminal would.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().unwrap();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (mut r, into) = (master.try_clone().unwrap(), seen.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            // Ends with EIO once no one holds the terminal.
            while let Ok(n @ 1..) = std::io::Read::read(&mut r, &mut buf) {
                into.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Self {
            child,
            master,
            slave,
            seen,
            cooked,
        }
    }

    fn seen(&self) -> String {
        String::from_utf8_lossy(&self.seen.lock().unwrap()).into_owned()
    }

    /// Wait until the terminal showed `what` (after `from` bytes of it);
    /// where it ends.
    fn wait_for(&self, what: &str, from: usize, c: &Containerd) -> usize {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
        loop {
            let seen = self.seen();
            if let Some(at) = seen.get(from..).and_then(|s| s.find(what)) {
                return from + at + what.len();
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{what:?} never showed; the terminal showed {seen:?}\n{}",
                c.diagnostics()
            );
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    fn type_in(&mut self, keys: &str) {
        std::io::Write::write_all(&mut self.master, keys.as_bytes()).unwrap();
    }

    fn resize(&self, rows: u16, cols: u16) {
        use std::os::fd::AsRawFd;
        let ws = burrow_tests::winsize(rows, cols);
        // SAFETY: TIOCSWINSZ reads the winsize we pass.
        let rc = unsafe { libc::ioctl(self.master.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
        assert_eq!(rc, 0);
    }

    /// burrow's exit status (within `limit`).
    fn wait(&mut self, limit: std::time::Duration) -> Option<i32> {
        let deadline = std::time::Instant::now() + limit;
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st.code().or_else(|| {
                    std::os::unix::process::ExitStatusExt::signal(&st).map(|s| 128 + s)
                });
            }
            if std::time::Instant::now() >= deadline {
                let _ = self.child.kill();
                panic!("burrow exec -t did not end; the terminal showed {:?}", self.seen());
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    /// The terminal is back as it was before burrow ran (not raw).
    fn assert_restored(&self) {
        let l = lflag(&self.slave);
        assert_eq!(l, self.cooked, "the terminal was left changed");
        assert_ne!(l & libc::ICANON, 0);
        assert_ne!(l & libc::ECHO, 0);
    }
}

/// `burrow exec -t` and `-i` are interactive: an `sh` in the guest typed
/// into from a real terminal here (its echo, its answers, the terminal's
/// size and a resize, its exit status as burrow's, the terminal restored);
/// SIGTERM to burrow restores the terminal and stops the command; piped
/// stdin reaches a pipe (`-i`) or the terminal (`-t`, whose end is ^D).
fn interactive(c: &Containerd) {
    let t0 = std::time::Instant::now();
    let mut t = OnPty::spawn(c, &["--", "sh"], 33, 77);
    // The prompt, then the typed line comes back (echoed by the guest's
    // terminal, not this one, which is raw) with its answer.
    let at = t.wait_for("# ", 0, c);
    let prompt_after = t0.elapsed();
    let typed = std::time::Instant::now();
    t.type_in("echo $((6*7))\r");
    let at = t.wait_for("\r\n42\r\n", at, c);
    let answered = typed.elapsed();
    t.type_in("stty size\r");
    let at = t.wait_for("\r\n33 77\r\n", at, c);
    // A resize of this terminal reaches the guest's (SIGWINCH).
    t.resize(40, 100);
    std::thread::sleep(std::time::Duration::from_millis(500));
    t.type_in("stty size\r");
    let at = t.wait_for("\r\n40 100\r\n", at, c);
    // ^C reaches the guest's terminal as a key: it interrupts the
    // foreground command there, not burrow.
    t.type_in("sleep 1000\r");
    std::thread::sleep(std::time::Duration::from_millis(500));
    t.type_in("\x03");
    t.type_in("echo after-$((1+1))\r");
    let at = t.wait_for("after-2\r\n", at, c);
    t.type_in("exit 3\r");
    assert_eq!(
        t.wait(std::time::Duration::from_secs(120)),
        Some(3),
        "the shell's exit status; the terminal showed {:?}\n{}",
        t.seen(),
        c.diagnostics()
    );
    t.assert_restored();
    eprintln!(
        "interactive sh: prompt after {prompt_after:?}, a typed line answered after {answered:?}, ended after {:?} ({at} bytes shown)",
        t0.elapsed()
    );

    // SIGTERM to burrow: the terminal is restored, burrow exits 128+15,
    // and the command in the guest is stopped.
    let mut t = OnPty::spawn(c, &["--", "sh", "-c", "echo ready; exec sleep 4242"], 24, 80);
    t.wait_for("ready\r\n", 0, c);
    // SAFETY: kill(2) of our own child.
    assert_eq!(unsafe { libc::kill(t.child.id() as i32, libc::SIGTERM) }, 0);
    assert_eq!(t.wait(std::time::Duration::from_secs(60)), Some(143));
    t.assert_restored();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let r = exec(c, &["--", "ps"]);
        ok(c, "ps", &r);
        if !r.stdout.contains("sleep 4242") {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the command outlived its interrupted caller: {r:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(500));
    }

    // -i: piped stdin on a pipe, whose end closes the command's stdin.
    let piped = b"echo hi\n: ghp_0123456789abcdefghijklmnopqrstuvwxyzAB\nexit 5\n";
    let r = c.burrow_with(&["exec", "-i", ID, "--", "sh"], Some(piped));
    assert_eq!(r.code, Some(5), "{r:?}\n{}", c.diagnostics());
    assert_eq!(r.stdout, "hi\n", "{r:?}");
    let r = c.burrow_with(&["exec", "-i", ID, "--", "wc", "-c"], Some(&[b'x'; 100_000]));
    ok(c, "exec -i wc -c", &r);
    assert_eq!(r.stdout.trim(), "100000", "{r:?}");
    // The audit log has what each session was given: what was typed at
    // the terminal, the piped script with its token redacted, and a long
    // input's size with its start.
    let audit = c.burrow(&["audit", ID, "--json"]);
    ok(c, "audit", &audit);
    let inputs: Vec<(u64, String)> = audit
        .stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|e| e["tool"] == "exec" && e["args"]["input_bytes"].is_u64())
        .map(|e| {
            let text = e["args"]["input"].as_str().unwrap_or_default().to_string();
            (e["args"]["input_bytes"].as_u64().unwrap_or_default(), text)
        })
        .collect();
    let typed = inputs
        .iter()
        .any(|(_, t)| t.starts_with("echo $((6*7))\rstty size\rstty size\r"));
    assert!(typed, "the typed session: {inputs:?}");
    let script = inputs.iter().find(|(_, t)| t.starts_with("echo hi\n"));
    assert!(
        script.is_some_and(|(n, t)| *n == piped.len() as u64
            && t.contains("[REDACTED")
            && !t.contains("ghp_0123")
            && t.ends_with("exit 5\n")),
        "the piped script, redacted: {inputs:?}"
    );
    assert!(
        inputs
            .iter()
            .any(|(n, t)| *n == 100_000 && t.starts_with("xxxx") && t.ends_with("[...]")),
        "a long input: its size and its start: {inputs:?}"
    );
    // -t with piped stdin: it goes to the guest's terminal (echoed there),
    // and its end is ^D there: a read of the terminal sees its end.
    let r = c.burrow_with(
        &[
            "exec",
            "-t",
            ID,
            "--",
            "sh",
            "-c",
            "read a; echo got-$a; read b || echo eof-$b",
        ],
        Some(b"one\n"),
    );
    ok(c, "exec -t with piped stdin", &r);
    assert!(
        r.stdout.contains("got-one\r\n") && r.stdout.contains("eof-\r\n"),
        "{r:?}"
    );
}

/// A fresh path in the host's temporary directory.
fn tempfile_path(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("burrow-cp-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// The files in `dir` whose names start with `.` (temporary files).
fn hidden_in(c: &Containerd, dir: &str) -> String {
    let r = exec(c, &["--", "sh", "-c", &format!("ls -A {dir} | grep '^\\.' || true")]);
    ok(c, "ls -A", &r);
    r.stdout
}

/// `sha256sum`'s hash of a host file.
fn sha256_host(p: &std::path::Path) -> String {
    let out = std::process::Command::new("sha256sum").arg(p).output().unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// `burrow cp` both ways: a 5 MiB random binary file up (its hash in the
/// guest is the host's) and back byte for byte, to a file and piped to
/// stdout; an executable script keeps +x and runs; a missing directory or
/// file is a clear error that leaves nothing behind; a replaced file is
/// replaced whole. Returns the blob (left at /tmp/blob.bin in the guest).
fn cp_round_trip(c: &Containerd) -> Vec<u8> {
    // 5 MiB of pseudo-random bytes (every byte value, no UTF-8 shape).
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let blob: Vec<u8> = (0..5 << 20)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect();
    let src = tempfile_path("blob.bin");
    std::fs::write(&src, &blob).unwrap();
    let want = sha256_host(&src);
    let r = c.burrow(&["cp", src.to_str().unwrap(), &format!("{ID}:/tmp/blob.bin")]);
    ok(c, "cp up 5 MiB", &r);
    eprintln!("burrow cp: 5 MiB up in {:?}", r.elapsed);
    assert!(r.stdout.contains("copied 5242880 bytes"), "{r:?}");
    let r = exec(c, &["--", "sha256sum", "/tmp/blob.bin"]);
    ok(c, "sha256sum in the guest", &r);
    assert!(r.stdout.starts_with(&want), "guest {r:?}, host {want}");
    assert_eq!(hidden_in(c, "/tmp"), "", "a temporary file was left");
    // Back, into a local directory (the file keeps its name).
    let down = tempfile_path("down");
    std::fs::create_dir_all(&down).unwrap();
    let r = c.burrow(&["cp", &format!("{ID}:/tmp/blob.bin"), down.to_str().unwrap()]);
    ok(c, "cp down 5 MiB", &r);
    eprintln!("burrow cp: 5 MiB down in {:?}", r.elapsed);
    assert!(std::fs::read(down.join("blob.bin")).unwrap() == blob, "the download differs");
    assert_eq!(std::fs::read_dir(&down).unwrap().count(), 1);
    // Piped to stdout.
    let out = std::process::Command::new(burrow_tests::workspace_bin("burrow"))
        .args(["cp", &format!("{ID}:/tmp/blob.bin"), "-"])
        .env("BURROW_CONFIG", c.dir().join("burrow.toml"))
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(out.status.success(), "cp to stdout: {out:?}");
    assert!(out.stdout == blob, "cp to stdout: {} bytes differ", out.stdout.len());
    // From stdin, replacing the file whole.
    let r = c.burrow_with(&["cp", "-", &format!("{ID}:/tmp/blob.bin")], Some(b"\x00short\xff"));
    ok(c, "cp from stdin", &r);
    let r = exec(c, &["--", "sh", "-c", "wc -c < /tmp/blob.bin"]);
    assert_eq!(r.stdout.trim(), "7", "{r:?}");
    // An executable script keeps +x and runs.
    let script = tempfile_path("hello.sh");
    std::fs::write(&script, "#!/bin/sh\necho hello from $0\n").unwrap();
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let r = c.burrow(&["cp", script.to_str().unwrap(), &format!("{ID}:/tmp/")]);
    ok(c, "cp a script into a directory", &r);
    let r = exec(c, &["--", "/tmp/hello.sh"]);
    ok(c, "run the copied script", &r);
    assert_eq!(r.stdout, "hello from /tmp/hello.sh\n", "{r:?}");
    // Errors: clear, status 1, nothing left behind on either side.
    let r = c.burrow(&["cp", script.to_str().unwrap(), &format!("{ID}:/nowhere/x.sh")]);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(
        r.stderr.starts_with("burrow cp:")
            && r.stderr.contains("no directory /nowhere")
            && r.stderr.lines().count() == 1,
        "{r:?}"
    );
    let r = exec(c, &["--", "sh", "-c", "ls /nowhere 2>&1 || true"]);
    assert!(r.stdout.contains("No such file"), "{r:?}");
    let missing = tempfile_path("missing.bin");
    let r = c.burrow(&["cp", &format!("{ID}:/tmp/nope.bin"), missing.to_str().unwrap()]);
    assert_eq!(r.code, Some(1), "{r:?}");
    assert!(
        r.stderr.starts_with("burrow cp:")
            && r.stderr.contains("/tmp/nope.bin")
            && r.stderr.lines().count() == 1,
        "{r:?}"
    );
    assert!(!missing.exists());
    let leftovers: Vec<_> = std::fs::read_dir(missing.parent().unwrap())
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n.to_string_lossy().starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    assert_eq!(hidden_in(c, "/tmp"), "", "a temporary file was left");
    // Put the blob back for the wake below.
    let r = c.burrow(&["cp", src.to_str().unwrap(), &format!("{ID}:/tmp/blob.bin")]);
    ok(c, "cp up again", &r);
    // An upload cut off (burrow killed after 2 MiB of stdin) leaves the
    // old file whole and no temporary file.
    let mut child = std::process::Command::new(burrow_tests::workspace_bin("burrow"))
        .args(["cp", "-", &format!("{ID}:/tmp/blob.bin")])
        .env("BURROW_CONFIG", c.dir().join("burrow.toml"))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut w = child.stdin.take().unwrap();
        w.write_all(&blob[..2 << 20]).unwrap();
        w.flush().unwrap();
        std::thread::sleep(std::time::Duration::from_secs(2));
        child.kill().unwrap();
        child.wait().unwrap();
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !hidden_in(c, "/tmp").is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the cut-off upload's temporary file stayed: {}",
            hidden_in(c, "/tmp")
        );
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    let r = exec(c, &["--", "sha256sum", "/tmp/blob.bin"]);
    assert!(r.stdout.starts_with(&want), "after a cut-off upload: {r:?}");
    let _ = std::fs::remove_dir_all(src.parent().unwrap());
    blob
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
    interactive(&c);
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

    let blob = cp_round_trip(&c);

    // Hibernated: the next tool call wakes it (a download here), and the
    // container's files are still there.
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
    let back = tempfile_path("woken.bin");
    let r = c.burrow(&["cp", &format!("{ID}:/tmp/blob.bin"), back.to_str().unwrap()]);
    ok(&c, "cp from a hibernated sandbox", &r);
    assert!(std::fs::read(&back).unwrap() == blob, "the download after a wake differs");
    let _ = std::fs::remove_file(&back);
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
