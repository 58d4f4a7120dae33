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

/// Containers of one image get copies of one image built once for its
/// layers (the shim's layer cache): the second create copies instead of
/// building, and it sees the image's files but none of what the first
/// container wrote.
#[test]
fn containers_of_one_image_share_a_build_and_nothing_else() {
    let c = containerd("layers");
    let cache = c.layer_cache_dir().to_path_buf();
    let first = c.ctr(&run(
        &["--rm"],
        "t-l1",
        &["sh", "-c", "echo mine > /written-by-one; cat /written-by-one"],
    ));
    assert_eq!(first.code, Some(0), "{first:?}\n{}", c.diagnostics());
    assert_eq!(first.stdout.trim(), "mine", "{first:?}");
    assert_eq!(c.log_count("root filesystem built into the layer cache"), 1);
    assert_eq!(c.log_count("root filesystem copied from the layer cache"), 0);
    let images = |dir: &std::path::Path| -> Vec<String> {
        std::fs::read_dir(dir)
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default()
    };
    let cached = images(&cache);
    assert_eq!(cached.len(), 1, "one image for busybox's layers: {cached:?}");
    assert!(cached[0].ends_with(".img"), "{cached:?}");

    let second = c.ctr(&run(
        &["--rm"],
        "t-l2",
        &["sh", "-c", "ls /written-by-one 2>&1; echo busybox $(ls /bin | wc -l)"],
    ));
    assert_eq!(second.code, Some(0), "{second:?}\n{}", c.diagnostics());
    assert_eq!(
        c.log_count("root filesystem copied from the layer cache"),
        1,
        "{}",
        c.diagnostics()
    );
    assert!(
        second.stdout.contains("No such file"),
        "the first container's write reached the second: {second:?}"
    );
    let applets: usize = second
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("busybox "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    assert!(applets > 100, "the image's files are in the copy: {second:?}");
    assert_eq!(images(&cache), cached, "the cache still holds its one image");
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
    // The VMM containerd's shim started runs in its jail; with a second
    // sandbox running beside it, each VMM has a uid of its own.
    let r = c.ctr(&run(&["-d"], "t-task2", &["sleep", "3600"]));
    assert_eq!(r.code, Some(0), "{r:?}\n{}", c.diagnostics());
    c.wait_status("t-task2", "RUNNING", LONG);
    let cgroups = c.assert_jailed();
    assert_eq!(cgroups.len(), 2, "two VMMs: {cgroups:?}");
    assert_eq!(c.ctr(&["task", "kill", "-s", "SIGKILL", "t-task2"]).code, Some(0));
    c.wait_status("t-task2", "STOPPED", LONG);
    assert_eq!(c.ctr(&["task", "delete", "t-task2"]).code, Some(0));
    assert_eq!(c.ctr(&["container", "delete", "t-task2"]).code, Some(0));
    let cgroups: Vec<_> = cgroups.into_iter().filter(|g| g.ends_with("t-task")).collect();

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

/// Where a refused vsock connect may end, by errno name: the VMM answers
/// a connection to any CID but the host's with a reset, the guest kernel
/// refuses its own CID (no loopback transport), and one to a host port
/// nobody listens on is reset too.
const VSOCK_REFUSED: [&str; 5] = [
    "ECONNRESET",
    "ECONNREFUSED",
    "ENODEV",
    "ENETUNREACH",
    "EHOSTUNREACH",
];

/// The guest CID burrow-vmm `pid` was started with (`--cid`, default 3).
fn guest_cid(pid: i32) -> u32 {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap();
    let args: Vec<String> = cmdline
        .split(|&b| b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    args.windows(2)
        .find(|w| w[0] == "--cid")
        .map_or(3, |w| w[1].parse().unwrap())
}

/// Code in a container cannot reach the agent over vsock (issue 15). A
/// static probe, streamed into a running busybox container through its
/// exec's stdin, connects to the agent's port on the local CID 1, on the
/// guest's own CID (as the VMM was given it, and as /dev/vsock says if the
/// container has one), on the hypervisor's CID 0 and on the host's CID 2
/// (the host side has nothing on that port: the shim reaches the agent,
/// never the other way round). Each is refused with a clear errno. The
/// control: the same binary's socket and connect work, and a listener the
/// test puts on the host side of the VM's vsock (a host port, as the VMM
/// maps guest-initiated connections) gets its line and answers it.
#[test]
fn a_container_cannot_reach_the_agent_over_vsock() {
    use std::io::{BufRead, BufReader, Write};
    use std::os::unix::fs::PermissionsExt;

    let probe = burrow_tests::asset_from_env("BURROW_VSOCK_PROBE", "tests/images/vsock-probe");
    let probe = std::fs::read(&probe).unwrap();
    let c = containerd("vsock");
    let id = "t-vsock";
    let r = c.ctr(&run(&["-d"], id, &["sleep", "3600"]));
    assert_eq!(r.code, Some(0), "{r:?}\n{}", c.diagnostics());
    c.wait_status(id, "RUNNING", LONG);
    let state = c.burrow_state().join("default").join(id);
    assert!(
        state.join("vsock.sock").exists(),
        "no vsock socket in {}",
        state.display()
    );
    let agent_port = burrow_protocol::AGENT_VSOCK_PORT;
    let control_port = 5000;
    let control = state.join(format!("vsock.sock_{control_port}"));
    let listener = std::os::unix::net::UnixListener::bind(&control).unwrap();
    // The jailed VMM (its own uid) connects to it.
    let vmm_uid = burrow_tests::jailed::uid_of(c.vmm_pid(id));
    std::os::unix::fs::chown(&control, Some(vmm_uid), Some(burrow_tests::jailed::JAIL_ID)).unwrap();
    std::fs::set_permissions(&control, std::fs::Permissions::from_mode(0o600)).unwrap();
    listener.set_nonblocking(true).unwrap();
    let host_side = std::thread::spawn(move || {
        let start = Instant::now();
        let (s, _) = loop {
            match listener.accept() {
                Ok(c) => break c,
                Err(_) if start.elapsed() < LONG => std::thread::sleep(Duration::from_millis(50)),
                Err(e) => return Err(format!("nobody connected: {e}")),
            }
        };
        s.set_nonblocking(false).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let mut line = String::new();
        BufReader::new(&s)
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        (&s).write_all(b"pong from the host\n").unwrap();
        Ok(line)
    });

    let cid = guest_cid(c.vmm_pid(id));
    assert!(cid > 2, "guest CID {cid}");
    let own = format!("{cid}:{agent_port}");
    let local = format!("1:{agent_port}");
    let hypervisor = format!("0:{agent_port}");
    let host = format!("2:{agent_port}");
    let self_cid = format!("self:{agent_port}");
    let ok_target = format!("2:{control_port}");
    let e = c.ctr_with(
        &[
            "task",
            "exec",
            "--exec-id",
            "probe",
            id,
            "sh",
            "-c",
            "cat >/tmp/vsock-probe && chmod 755 /tmp/vsock-probe && exec /tmp/vsock-probe \"$@\"",
            "sh",
            &local,
            &own,
            &self_cid,
            &hypervisor,
            &host,
            &ok_target,
        ],
        Some(&probe),
        LONG,
    );
    let _ = std::fs::remove_file(&control);
    assert_eq!(e.code, Some(0), "{e:?}\n{}", c.diagnostics());
    let out = &e.stdout;
    let line = |prefix: &str| {
        out.lines()
            .find(|l| l.starts_with(prefix))
            .unwrap_or_else(|| panic!("no {prefix:?} line from the probe:\n{out}"))
            .to_string()
    };
    // The control: vsock is there and the probe can connect where it may.
    assert_eq!(line("socket "), "socket ok", "{out}");
    assert_eq!(
        line(&format!("connect {ok_target} ")),
        format!("connect {ok_target} ok"),
        "{out}"
    );
    assert_eq!(line("reply "), "reply pong from the host", "{out}");
    let heard = host_side.join().unwrap();
    assert_eq!(heard.as_deref(), Ok("ping from the container\n"));

    let mut refused = vec![local, own, hypervisor, host];
    // The guest's own CID as its kernel reports it, if the container can
    // ask (containers usually have no /dev/vsock).
    let local_cid = line("local_cid ");
    if let Some(n) = local_cid
        .strip_prefix("local_cid ")
        .and_then(|n| n.parse::<u32>().ok())
    {
        assert_eq!(n, cid, "{out}");
        refused.push(format!("{n}:{agent_port}"));
    } else {
        assert!(
            out.contains(&format!("connect {self_cid} skipped")),
            "{out}"
        );
    }
    for target in &refused {
        let l = line(&format!("connect {target} "));
        let errno = l.rsplit(' ').next().unwrap_or_default();
        assert!(
            l.contains("errno=") && VSOCK_REFUSED.contains(&errno),
            "a container's connect to vsock {target} must be refused: {l:?}\n{out}"
        );
    }
    // Only the control's connection got a reply.
    assert_eq!(out.matches("reply ").count(), 1, "{out}");
    println!("the probe in the container:\n{out}");

    assert_eq!(c.ctr(&["task", "kill", "-s", "SIGKILL", id]).code, Some(0));
    c.wait_status(id, "STOPPED", LONG);
    assert_eq!(c.ctr(&["task", "delete", id]).code, Some(0));
    assert_eq!(c.ctr(&["containers", "rm", id]).code, Some(0));
    c.assert_clean(CLEAN);
}
