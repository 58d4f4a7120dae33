//! containerd → containerd-shim-burrow-v2 → burrow-vmm → guest agent, end to
//! end: each test starts its own containerd (state on scratch space, the
//! locally built busybox image imported) and drives it with `ctr`, as a user
//! would. Run inside hack/testhost (or on a host with hardware KVM). The
//! many-VM tests (repeated runs, five at once) are in shim_load.rs.

#![allow(clippy::unwrap_used)]

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use burrow_tests::containerd::{run, wait_output, Containerd, CLEAN, IMAGE, LONG, RUNTIME};
use burrow_tests::ps::{ps_pid, ps_rows};

fn containerd(name: &str) -> Containerd {
    Containerd::nested(name)
}

#[test]
fn ctr_run_prints_output_and_exit_status_from_a_separate_kernel() {
    let c = containerd("run");
    let host_kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let r = c.ctr(&run(
        &["--rm"],
        "t-run",
        &["sh", "-c", "echo hello from burrow; cat /proc/sys/kernel/osrelease; sleep 1000 & sleep 1; ps -o pid,comm,args; exit 7"],
    ));
    assert_eq!(
        r.code,
        Some(7),
        "exit 7 must come back as 7: {r:?}\n{}",
        c.diagnostics()
    );
    let lines: Vec<&str> = r.stdout.lines().collect();
    assert_eq!(lines.first(), Some(&"hello from burrow"), "{r:?}");
    let guest_kernel = lines.get(1).copied().unwrap_or_default();
    assert!(
        !guest_kernel.is_empty() && guest_kernel != host_kernel.trim(),
        "the container must run on its own kernel: host {host_kernel:?}, container {guest_kernel:?}"
    );
    let procs = ps_rows(&lines[2.min(lines.len())..]);
    for host_only in ["containerd", "containerd-shim", "burrow-vmm", "ctr"] {
        assert!(
            !procs.iter().any(|(_, comm)| comm == host_only),
            "host process {host_only} is visible inside the container:\n{}",
            r.stdout
        );
    }
    // The container's own processes are: its command as PID 1, the
    // backgrounded sleep and ps itself.
    assert!(
        procs.contains(&(1, "sh".to_string())),
        "PID 1 must be the container's sh:\n{}",
        r.stdout
    );
    // busybox's sh runs applets through /proc/self/exe, so the sleep's
    // comm may be "exe": its arguments say what it is.
    assert!(
        lines
            .iter()
            .any(|l| l.contains("sleep 1000") && ps_pid(l).is_some_and(|pid| pid > 1)),
        "the container's backgrounded sleep is not visible inside it:\n{}",
        r.stdout
    );
    assert!(
        procs.iter().any(|(pid, comm)| comm == "ps" && *pid > 1),
        "the container's ps is not visible inside it:\n{}",
        r.stdout
    );
    c.assert_clean(CLEAN);
}

#[test]
fn ctr_run_stdin_terminal_and_signals() {
    let c = containerd("stdio");
    // Interactive stdin (ctr run forwards its stdin unless --null-io).
    let r = c.ctr_with(
        &run(
            &["--rm"],
            "t-stdin",
            &["sh", "-c", "read line; echo got:$line"],
        ),
        Some(b"ping\n"),
        LONG,
    );
    assert_eq!(r.code, Some(0), "{r:?}\n{}", c.diagnostics());
    assert_eq!(r.stdout.trim(), "got:ping", "{r:?}");

    // -t gives the process a terminal (ctr needs one itself: script(1)).
    let inner = format!(
        "ctr --address {} run --rm -t --runtime {RUNTIME} {IMAGE} t-tty tty",
        c.socket.display()
    );
    let child = Command::new("script")
        .args(["-qec", &inner, "/dev/null"])
        .env("COLUMNS", "100")
        .env("LINES", "30")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("script(1) from util-linux/bsdutils");
    let (out, killed) = wait_output(child, LONG);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(!killed, "ctr run -t hung: {text}\n{}", c.diagnostics());
    assert!(
        text.contains("/dev/pts/"),
        "no terminal inside `ctr run -t`: {text:?}\n{}",
        c.diagnostics()
    );

    // A process killed by a signal reports it (128 + 9).
    let child = c.spawn_ctr(&run(&["--rm"], "t-sig", &["sleep", "3600"]));
    c.wait_status("t-sig", "RUNNING", LONG);
    let k = c.ctr(&["task", "kill", "-s", "SIGKILL", "t-sig"]);
    assert_eq!(k.code, Some(0), "{k:?}");
    let (out, killed) = wait_output(child, LONG);
    assert!(
        !killed,
        "ctr run did not end after SIGKILL\n{}",
        c.diagnostics()
    );
    assert_eq!(out.status.code(), Some(137), "{out:?}\n{}", c.diagnostics());
    c.assert_clean(CLEAN);
}

#[test]
fn ctr_task_exec_ps_pause_resume_kill_delete() {
    let c = containerd("task");
    let r = c.ctr(&run(&["-d"], "t-task", &["sleep", "3600"]));
    assert_eq!(r.code, Some(0), "{r:?}\n{}", c.diagnostics());
    c.wait_status("t-task", "RUNNING", LONG);

    let e = c.ctr(&[
        "task",
        "exec",
        "--exec-id",
        "e1",
        "t-task",
        "sh",
        "-c",
        "echo in exec; ps -o comm; exit 3",
    ]);
    assert_eq!(e.code, Some(3), "{e:?}\n{}", c.diagnostics());
    assert!(e.stdout.starts_with("in exec"), "{e:?}");
    assert!(
        e.stdout.lines().any(|l| l.trim() == "sleep"),
        "exec must see the container's processes: {e:?}"
    );

    let ps = c.ctr(&["task", "ps", "t-task"]);
    assert_eq!(ps.code, Some(0), "{ps:?}");
    let pids = ps
        .stdout
        .lines()
        .skip(1)
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|p| p.parse::<u32>().is_ok())
        })
        .count();
    assert!(pids >= 1, "ctr task ps lists no process: {ps:?}");

    assert_eq!(c.ctr(&["task", "pause", "t-task"]).code, Some(0));
    c.wait_status("t-task", "PAUSED", LONG);
    assert_eq!(c.ctr(&["task", "resume", "t-task"]).code, Some(0));
    c.wait_status("t-task", "RUNNING", LONG);
    let e = c.ctr(&[
        "task",
        "exec",
        "--exec-id",
        "e2",
        "t-task",
        "echo",
        "after resume",
    ]);
    assert_eq!(
        (e.code, e.stdout.trim()),
        (Some(0), "after resume"),
        "{e:?}\n{}",
        c.diagnostics()
    );
    // The rootfs image, console, logs and sockets are the host root's only.
    c.assert_private();
    // The VMM containerd's shim started runs in its jail.
    let cgroups = c.assert_jailed();

    assert_eq!(
        c.ctr(&["task", "kill", "-s", "SIGKILL", "t-task"]).code,
        Some(0)
    );
    c.wait_status("t-task", "STOPPED", LONG);
    let d = c.ctr(&["task", "delete", "t-task"]);
    assert_eq!(d.code, Some(0), "{d:?}");
    assert_eq!(c.ctr(&["containers", "rm", "t-task"]).code, Some(0));
    c.assert_clean(CLEAN);
    for cg in cgroups {
        assert!(!cg.exists(), "the VMM's cgroup {} outlived its sandbox", cg.display());
    }
}

#[test]
fn an_oom_kill_in_the_guest_is_a_task_oom_event() {
    let c = containerd("oom");
    let mut events = c.spawn_ctr(&["events"]);
    // A child shell doubles a string until the 256 MiB guest runs out of
    // memory; the OOM killer takes it (the biggest), init reports.
    let r = c.ctr(&run(
        &["--rm"],
        "t-oom",
        &["sh", "-c", "sh -c 'a=0123456789abcdef; while :; do a=$a$a; done'; echo child:$?; grep oom_kill /proc/vmstat; sleep 3"],
    ));
    assert_eq!(r.code, Some(0), "{r:?}\n{}", c.diagnostics());
    assert!(
        r.stdout.contains("child:137"),
        "the OOM killer's SIGKILL must end the hog: {r:?}"
    );
    std::thread::sleep(Duration::from_secs(2));
    let _ = events.kill();
    let out = events.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines()
            .any(|l| l.contains("/tasks/oom") && l.contains("t-oom")),
        "no /tasks/oom event for t-oom in ctr events:\n{text}\ncontainer output: {}\n{}",
        r.stdout,
        c.diagnostics()
    );
    c.assert_clean(CLEAN);
}

#[test]
fn killed_vmm_ends_the_task_with_an_error_and_delete_cleans_up() {
    let c = containerd("vmmkill");
    let child = c.spawn_ctr(&run(&["--rm"], "t-vmm", &["sleep", "3600"]));
    c.wait_status("t-vmm", "RUNNING", LONG);
    let pid = c.vmm_pid("t-vmm");
    // SAFETY: kill(2) has no memory-safety preconditions.
    assert_eq!(
        unsafe { libc::kill(pid, libc::SIGKILL) },
        0,
        "kill -9 burrow-vmm {pid}"
    );
    let (out, killed) = wait_output(child, LONG);
    assert!(
        !killed,
        "ctr run did not end after its VMM was killed\n{}",
        c.diagnostics()
    );
    assert_eq!(
        out.status.code(),
        Some(255),
        "a task whose VM died exits 255: {out:?}\n{}",
        c.diagnostics()
    );
    c.assert_clean(CLEAN);
}

#[test]
fn an_agent_that_stops_answering_gives_a_timeout_error() {
    let c = containerd("hung");
    let r = c.ctr(&run(&["-d"], "t-hung", &["sleep", "3600"]));
    assert_eq!(r.code, Some(0), "{r:?}\n{}", c.diagnostics());
    c.wait_status("t-hung", "RUNNING", LONG);
    let pid = c.vmm_pid("t-hung");
    // Freeze the whole VM: the agent stops answering, the sockets stay open.
    // SAFETY: kill(2) has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let start = Instant::now();
    let e = c.ctr_with(
        &["task", "exec", "--exec-id", "e1", "t-hung", "true"],
        None,
        Duration::from_secs(300),
    );
    let waited = start.elapsed();
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    assert_ne!(e.code, Some(0), "exec into a frozen VM must fail: {e:?}");
    let msg = e.stderr.to_lowercase();
    assert!(
        msg.contains("timed out") || msg.contains("timeout") || msg.contains("deadline"),
        "the error must say the agent timed out: {e:?}\n{}",
        c.diagnostics()
    );
    assert!(
        waited < Duration::from_secs(240),
        "exec waited {waited:?} instead of timing out"
    );
    assert_eq!(
        c.ctr(&["task", "kill", "-s", "SIGKILL", "t-hung"]).code,
        Some(0)
    );
    c.wait_status("t-hung", "STOPPED", LONG);
    assert_eq!(c.ctr(&["task", "delete", "t-hung"]).code, Some(0));
    assert_eq!(c.ctr(&["containers", "rm", "t-hung"]).code, Some(0));
    c.assert_clean(CLEAN);
}

#[test]
fn a_malformed_spec_is_refused_and_leaves_nothing_behind() {
    let c = containerd("badspec");
    let spec = c.dir.join("bad-spec.json");
    // Valid JSON, but not a runnable spec: no process arguments.
    std::fs::write(
        &spec,
        r#"{"ociVersion":"1.0.2","process":{"cwd":"/","args":[],"user":{"uid":0,"gid":0}},"root":{"path":"rootfs"}}"#,
    )
    .unwrap();
    let spec_arg = spec.display().to_string();
    // `ctr run --config SPEC ID`: the spec goes to the runtime as given.
    let r = c.ctr(&[
        "run",
        "--runtime",
        RUNTIME,
        "--rm",
        "--config",
        &spec_arg,
        "t-bad",
    ]);
    assert_ne!(
        r.code,
        Some(0),
        "a spec without process args must be refused: {r:?}"
    );
    assert!(
        r.stderr.contains("args"),
        "the error must name the problem: {r:?}\n{}",
        c.diagnostics()
    );
    let _ = c.ctr(&["containers", "rm", "t-bad"]);
    c.assert_clean(CLEAN);
}

/// containerd's default seccomp profile (`ctr run --seccomp`) holds inside
/// the guest: making a user namespace, which that profile denies to a
/// container without CAP_SYS_ADMIN, fails, while the same container without
/// the profile may. runc, the control, gives the same answers.
#[test]
fn containerds_default_seccomp_profile_holds_in_the_guest() {
    let c = containerd("seccomp");
    let script = ["sh", "-c", "grep Seccomp: /proc/self/status; unshare -U true && echo userns-made || echo userns-refused"];
    let runc = ["--runtime", "io.containerd.runc.v2"];
    let cases: [(&str, Vec<&str>, &str, &str); 3] = [
        (
            "burrow, --seccomp",
            vec!["--rm", "--seccomp"],
            "Seccomp:\t2",
            "userns-refused",
        ),
        (
            "burrow, no profile",
            vec!["--rm"],
            "Seccomp:\t0",
            "userns-made",
        ),
        (
            "runc, --seccomp",
            [&["--rm", "--seccomp"][..], &runc[..]].concat(),
            "Seccomp:\t2",
            "userns-refused",
        ),
    ];
    for (i, (what, flags, seccomp, userns)) in cases.iter().enumerate() {
        let id = format!("t-seccomp-{i}");
        let r = c.ctr(&run(flags, &id, &script));
        assert_eq!(r.code, Some(0), "{what}: {r:?}\n{}", c.diagnostics());
        assert!(
            r.stdout.contains(seccomp) && r.stdout.contains(userns),
            "{what}: {r:?}"
        );
    }
    c.assert_clean(CLEAN);
}
