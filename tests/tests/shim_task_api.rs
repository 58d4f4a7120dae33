//! The task API calls the other end-to-end suites do not reach, through
//! containerd 1.6 and `ctr` as a user drives them: Stats (`ctr task
//! metrics`), Update (sent to the shim's ttrpc socket, as ctr 1.6 has no
//! `task update`), ResizePty (a terminal resize seen by `stty size`),
//! CloseIO (stdin EOF reaches `cat`), Connect (containerd restarts and
//! finds its task again), Shutdown (the shim and its VMM go after delete),
//! and a rootfs that is a block device (containerd's devmapper snapshotter
//! on a thin pool over loop devices) passed through to the guest. Run
//! inside hack/testhost (or on a host with hardware KVM).

#![allow(clippy::unwrap_used)]

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use burrow_tests::containerd::{
    process_running, run, wait_output, walk, Containerd, NESTED_CONFIG,
};
use burrow_tests::devmapper::{command, host, ThinPool};
use containerd_shim_protos::protobuf::well_known_types::any::Any;
use containerd_shim_protos::{api, ttrpc, TaskClient};

/// Nested guests boot slowly (QEMU TCG): allow minutes (a container starts
/// in about 15 s there), assert no timings.
const LONG: Duration = Duration::from_secs(300);
const CLEAN: Duration = Duration::from_secs(60);
const MIB: u64 = 1 << 20;

/// Progress on stderr (seen with --nocapture in the test host's log).
fn step(what: &str) {
    eprintln!("shim_task_api: {what}");
}

fn containerd(name: &str) -> Containerd {
    Containerd::nested(name)
}

/// `ctr run -d` with `flags`, and wait until the task runs.
fn run_detached(c: &Containerd, flags: &[&str], id: &str, cmd: &[&str]) {
    step(&format!("start {id}"));
    let mut flags = flags.to_vec();
    flags.push("-d");
    let r = c.ctr_with(&run(&flags, id, cmd), None, LONG);
    assert_eq!(r.code, Some(0), "run {id}: {r:?}\n{}", c.diagnostics());
    c.wait_status(id, "RUNNING", LONG);
}

/// Kill task `id`, delete it and its container, and check nothing is left.
fn kill_and_remove(c: &Containerd, id: &str) {
    assert_eq!(c.ctr(&["task", "kill", "-s", "SIGKILL", id]).code, Some(0));
    c.wait_status(id, "STOPPED", LONG);
    let d = c.ctr(&["task", "delete", id]);
    assert_eq!(d.code, Some(0), "{d:?}\n{}", c.diagnostics());
    assert_eq!(c.ctr(&["containers", "rm", id]).code, Some(0));
    c.assert_clean(CLEAN);
}

/// The cgroup v2 numbers `ctr task metrics` prints for a task.
#[derive(Debug, Clone, Copy)]
struct Metrics {
    pids: u64,
    cpu_usec: u64,
    memory: u64,
    memory_limit: u64,
}

fn metrics(c: &Containerd, id: &str) -> Metrics {
    let r = c.ctr(&["task", "metrics", "--format", "json", id]);
    assert_eq!(
        r.code,
        Some(0),
        "ctr task metrics {id}: {r:?}\n{}",
        c.diagnostics()
    );
    let v: serde_json::Value = serde_json::from_str(&r.stdout)
        .unwrap_or_else(|e| panic!("ctr task metrics --format json printed no JSON ({e}): {r:?}"));
    // Go's encoding/json leaves zero fields out (omitempty).
    let n = |ptr: &str| {
        v.pointer(ptr)
            .and_then(serde_json::Value::as_u64)
            .unwrap_or(0)
    };
    let m = Metrics {
        pids: n("/pids/current"),
        cpu_usec: n("/cpu/usage_usec"),
        memory: n("/memory/usage"),
        memory_limit: n("/memory/usage_limit"),
    };
    eprintln!("metrics of {id}: {m:?}");
    m
}

#[test]
fn metrics_are_the_containers_and_update_reaches_its_cgroup() {
    let c = containerd("stats");
    let id = "t-stats";
    run_detached(&c, &[], id, &["sleep", "100000"]);

    step("metrics at start");
    let m0 = metrics(&c, id);
    assert_eq!(
        m0.pids,
        1,
        "only the container's init runs: {m0:?}\n{}",
        c.diagnostics()
    );
    assert!(m0.cpu_usec > 0, "a booted guest has used CPU: {m0:?}");
    assert!(
        m0.memory > 0 && m0.memory < m0.memory_limit && m0.memory_limit <= 256 * MIB,
        "memory use within the 256 MiB VM: {m0:?}"
    );

    step("fill 48 MiB of /dev/shm");
    // 48 MiB into the container's /dev/shm (tmpfs: guest memory that
    // cannot be reclaimed while the file exists).
    let out = c.exec_ok(
        id,
        "fill",
        &[
            "sh",
            "-c",
            "head -c 50331648 /dev/zero > /dev/shm/fill && wc -c < /dev/shm/fill",
        ],
    );
    assert_eq!(out.trim(), "50331648", "the container wrote its 48 MiB");
    let m1 = metrics(&c, id);
    assert!(
        m1.memory >= m0.memory + 40 * MIB,
        "memory use must grow by the 48 MiB the container holds: before {m0:?}, after {m1:?}"
    );

    step("three background processes");
    // Three more processes, detached from the exec's stdio.
    c.exec_ok(
        id,
        "bg",
        &[
            "sh",
            "-c",
            "for i in 1 2 3; do sleep 100000 </dev/null >/dev/null 2>&1 & done",
        ],
    );
    let m2 = metrics(&c, id);
    assert_eq!(
        m2.pids,
        4,
        "init and the three sleeps the exec left behind: {m2:?}\n{}",
        c.diagnostics()
    );

    step("busy loop");
    // A busy loop that runs until the shell itself has used 1.5 s of CPU
    // (utime + stime from its /proc stat, in 1/100 s; builtins only), not
    // for a wall-clock time: on a busy machine the nested guest's vCPU gets
    // only part of each second (once 3 s of wall clock gave 0.99 s of CPU).
    c.exec_ok(
        id,
        "busy",
        &[
            "sh",
            "-c",
            "while :; do read -r s </proc/$$/stat; set -- $s; [ $((${14} + ${15})) -ge 150 ] && break; done",
        ],
    );
    let m3 = metrics(&c, id);
    // The loop's own figure is sampled per tick (a tick in which the vCPU
    // was preempted still counts), the cgroup's is exact runtime: in the
    // nested test host 1.5 s of ticks was 0.91 s of runtime once.
    assert!(
        m3.cpu_usec >= m2.cpu_usec + 500_000,
        "a loop that used 1.5 s of CPU ticks in the guest must add at least 0.5 s to the container's CPU time: before {m2:?}, after {m3:?}"
    );

    update_reaches_the_containers_cgroup(&c, id, m3);
    kill_and_remove(&c, id);
}

/// Send `UpdateTaskRequest { id, resources, annotations }` to the shim of
/// task `task` over its ttrpc socket, as containerd does for `ctr task
/// update` in later versions (containerd 1.6.20's ctr has no `task
/// update`).
fn update(
    c: &Containerd,
    task: &str,
    id: &str,
    resources: Option<(&str, &[u8])>,
    annotations: &[(&str, &str)],
) -> ttrpc::Result<()> {
    let client = ttrpc::Client::connect(&c.shim_address(task)).unwrap();
    let client = TaskClient::new(client);
    let req = api::UpdateTaskRequest {
        id: id.into(),
        resources: resources
            .map(|(type_url, value)| Any {
                type_url: type_url.into(),
                value: value.to_vec(),
                ..Default::default()
            })
            .into(),
        annotations: annotations
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ..Default::default()
    };
    let ctx = ttrpc::context::with_timeout(Duration::from_secs(60).as_nanos() as i64);
    client.update(ctx, &req).map(|_| ())
}

/// What the container sees of its VM's size: `MemTotal: N kB` and `nproc`.
fn guest_size(c: &Containerd, id: &str, exec_id: &str) -> String {
    c.exec_ok(
        id,
        exec_id,
        &["sh", "-c", "grep MemTotal /proc/meminfo; nproc"],
    )
}

/// Update: a VM's vCPUs and memory are fixed when it boots (no hotplug), so
/// an update of resources is refused saying so, a malformed one too, and
/// the guest keeps its size; an update of annotations alone is accepted.
fn update_reaches_the_containers_cgroup(c: &Containerd, id: &str, before: Metrics) {
    const LINUX_RESOURCES: &str =
        "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources";
    step("update through the shim's task API");
    let size = guest_size(c, id, "size-before");
    // Linux resources go to the container's cgroup in the guest.
    update(
        c,
        id,
        id,
        Some((
            LINUX_RESOURCES,
            &br#"{"memory":{"limit":134217728},"cpu":{"shares":512,"quota":50000,"period":100000}}"#[..],
        )),
        &[],
    )
    .expect("a memory limit and CPU shares and quota");
    let refusals = [
        ("malformed resources", (LINUX_RESOURCES, &b"{\"memory\": [not json"[..])),
        ("resources of an unknown type", ("example.com/Nonsense", &b"\x01\x02"[..])),
    ];
    for (what, resources) in refusals {
        let err = update(c, id, id, Some(resources), &[]).expect_err(what);
        let ttrpc::Error::RpcStatus(s) = &err else {
            panic!("{what}: not a status error: {err:?}");
        };
        assert_eq!(s.code(), ttrpc::Code::INVALID_ARGUMENT, "{what}: {s:?}");
    }
    let err = update(c, id, "no-such-task", Some(refusals[0].1), &[]).expect_err("unknown task");
    assert!(
        matches!(&err, ttrpc::Error::RpcStatus(s) if s.code() == ttrpc::Code::NOT_FOUND),
        "an update of an unknown task is NOT_FOUND: {err:?}"
    );
    update(c, id, id, None, &[("io.burrow.test", "annotated")])
        .expect("an update of annotations alone is accepted");

    // The task runs on; the VM keeps its size (it cannot grow), and the
    // container's memory limit is the new one, as `ctr task metrics` sees it.
    assert_eq!(
        c.task_status(id).as_deref(),
        Some("RUNNING"),
        "updates leave the task running"
    );
    assert_eq!(
        guest_size(c, id, "size-after"),
        size,
        "the container sees the VM's size unchanged"
    );
    let after = metrics(c, id);
    assert_eq!(
        after.memory_limit,
        134_217_728,
        "the container's memory limit is the updated one: before {before:?}, after {after:?}"
    );
}

/// `ctr ARGS` on a terminal this test holds the other side of, as a
/// terminal emulator would: ctr is a session leader with the terminal as
/// its controlling tty, so a window-size change sends it SIGWINCH.
struct TerminalCtr {
    child: Child,
    master: OwnedFd,
    output: Arc<Mutex<Vec<u8>>>,
}

impl TerminalCtr {
    fn spawn(c: &Containerd, args: &[&str], rows: u16, cols: u16) -> Self {
        let (mut master, mut slave) = (-1, -1);
        let ws = burrow_tests::winsize(rows, cols);
        // SAFETY: valid out-pointers; no name buffer; default termios.
        let rc = unsafe {
            libc::openpty(
                &mut master,
                &mut slave,
                std::ptr::null_mut(),
                std::ptr::null(),
                &ws,
            )
        };
        assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
        // SAFETY: openpty just returned these descriptors; nothing else owns them.
        let (master, slave) =
            unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) };
        let mut cmd = Command::new("ctr");
        cmd.arg("--address").arg(&c.socket).args(args);
        cmd.stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave));
        // SAFETY: setsid and ioctl are async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().expect("run ctr on a terminal");
        // Our copies of the terminal go with `cmd`, so the reader sees EIO
        // once ctr is gone.
        drop(cmd);
        let output = Arc::new(Mutex::new(Vec::new()));
        let mut reader = std::fs::File::from(master.try_clone().unwrap());
        let sink = output.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = reader.read(&mut buf) {
                sink.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Self {
            child,
            master,
            output,
        }
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.output.lock().unwrap()).replace('\r', "")
    }

    /// Wait until the terminal has shown a line starting with `prefix`.
    fn line(&mut self, prefix: &str, c: &Containerd) -> String {
        let start = Instant::now();
        loop {
            if let Some(l) = self.text().lines().find(|l| l.starts_with(prefix)) {
                return l.to_string();
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                std::thread::sleep(Duration::from_millis(500));
                panic!(
                    "ctr ended ({status}) before a {prefix:?} line: {:?}\n{}",
                    self.text(),
                    c.diagnostics()
                );
            }
            assert!(
                start.elapsed() < LONG,
                "no {prefix:?} line on the terminal: {:?}\n{}",
                self.text(),
                c.diagnostics()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn resize(&self, rows: u16, cols: u16) {
        let ws = burrow_tests::winsize(rows, cols);
        // SAFETY: TIOCSWINSZ reads one winsize from a valid pointer.
        let rc = unsafe { libc::ioctl(self.master.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
        assert_eq!(rc, 0, "TIOCSWINSZ: {}", std::io::Error::last_os_error());
    }
}

#[test]
fn terminal_resize_and_stdin_eof_reach_the_container() {
    let c = containerd("io");
    let id = "t-io";
    run_detached(&c, &[], id, &["sleep", "100000"]);

    // CloseIO: the data, then EOF, reach an exec'd cat.
    step("exec cat with data");
    let r = c.ctr_with(
        &["task", "exec", "--exec-id", "cat-data", id, "cat"],
        Some(b"hello\n"),
        LONG,
    );
    assert_eq!(
        (r.code, r.stdout.as_str()),
        (Some(0), "hello\n"),
        "{r:?}\n{}",
        c.diagnostics()
    );
    // ...and a stdin that closes with nothing written ends cat (ctr sends
    // CloseIO on its stdin's EOF once the exec has started).
    step("exec cat, its stdin closed while it runs");
    let mut child = c.spawn_ctr_with(
        &["task", "exec", "--exec-id", "cat-closed", id, "cat"],
        Stdio::piped(),
    );
    let start = Instant::now();
    while process_lines(&c, id) < 2 {
        assert!(
            start.elapsed() < LONG,
            "the exec'd cat never ran\n{}",
            c.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    drop(child.stdin.take());
    let (out, killed) = wait_output(child, Duration::from_secs(120));
    assert!(
        !killed,
        "exec'd cat never saw its stdin's EOF: {out:?}\n{}",
        c.diagnostics()
    );
    assert_eq!(
        (out.status.code(), out.stdout.as_slice()),
        (Some(0), &b""[..]),
        "{out:?}"
    );

    // ResizePty: ctr sends its terminal's size when the exec starts and
    // again on SIGWINCH; `stty size` (rows cols) inside sees both.
    let wait_for = |size: &str| {
        format!("i=0; while [ \"$(stty size)\" != \"{size}\" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done")
    };
    let script = format!(
        "{}; echo first:$(stty size); {}; echo second:$(stty size)",
        wait_for("30 100"),
        wait_for("40 120")
    );
    step("exec -t and resize");
    let mut t = TerminalCtr::spawn(
        &c,
        &[
            "task",
            "exec",
            "-t",
            "--exec-id",
            "tty",
            id,
            "sh",
            "-c",
            &script,
        ],
        30,
        100,
    );
    assert_eq!(
        t.line("first:", &c),
        "first:30 100",
        "the starting size reaches the container"
    );
    t.resize(40, 120);
    assert_eq!(
        t.line("second:", &c),
        "second:40 120",
        "a resize reaches the container"
    );
    let text = t.text();
    let (out, killed) = wait_output(t.child, LONG);
    assert!(
        !killed,
        "ctr task exec -t did not end: {text:?}\n{}",
        c.diagnostics()
    );
    assert_eq!(out.status.code(), Some(0), "{text:?}");
    kill_and_remove(&c, id);

    // CloseIO for a container's init: `echo hello | ctr run ... cat`.
    step("echo hello | ctr run cat");
    let r = c.ctr_with(&run(&["--rm"], "t-cat", &["cat"]), Some(b"hello\n"), LONG);
    assert_eq!(
        (r.code, r.stdout.as_str()),
        (Some(0), "hello\n"),
        "{r:?}\n{}",
        c.diagnostics()
    );
    c.assert_clean(CLEAN);
}

/// How many processes `ctr task ps` lists for `id`.
fn process_lines(c: &Containerd, id: &str) -> usize {
    let ps = c.ctr(&["task", "ps", id]);
    ps.stdout
        .lines()
        .skip(1)
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|p| p.parse::<u32>().is_ok())
        })
        .count()
}

/// PID column of `ctr task ls` for `id`.
fn task_pid(c: &Containerd, id: &str) -> Option<u32> {
    let r = c.ctr(&["task", "ls"]);
    r.stdout.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.first() == Some(&id))
            .then(|| f.get(1)?.parse().ok())
            .flatten()
    })
}

#[test]
fn containerd_restart_reconnects_and_delete_shuts_the_shim_down() {
    let mut c = containerd("connect");
    let id = "t-conn";
    run_detached(&c, &[], id, &["sleep", "100000"]);
    let pid = task_pid(&c, id).expect("ctr task ls shows a pid");
    assert!(pid > 0, "the task has a guest pid");
    let shims = c.shim_pids(id);
    assert_eq!(shims.len(), 1, "one shim serves {id}: {shims:?}");
    let vmm = c.vmm_pid(id);

    // containerd restarts; its new instance connects to the running shim.
    step("restart containerd");
    c.restart();
    assert_eq!(
        c.task_status(id).as_deref(),
        Some("RUNNING"),
        "after a restart\n{}",
        c.diagnostics()
    );
    assert_eq!(task_pid(&c, id), Some(pid), "same task pid after a restart");
    assert_eq!(c.shim_pids(id), shims, "the same shim serves the task");
    assert_eq!(c.vmm_pid(id), vmm, "the same VM runs the task");
    assert!(process_running(vmm), "burrow-vmm {vmm} still runs");
    assert_eq!(
        c.exec_ok(id, "after-restart", &["echo", "still here"])
            .trim(),
        "still here"
    );

    // Kill works, and the exit reaches the new containerd as an event.
    step("kill after the restart");
    let mut events = c.spawn_ctr(&["events"]);
    std::thread::sleep(Duration::from_secs(1));
    assert_eq!(c.ctr(&["task", "kill", "-s", "SIGKILL", id]).code, Some(0));
    c.wait_status(id, "STOPPED", LONG);
    std::thread::sleep(Duration::from_secs(1));
    let _ = events.kill();
    let out = events.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.lines()
            .any(|l| l.contains("/tasks/exit") && l.contains(id)),
        "no /tasks/exit for {id} after the restart:\n{text}\n{}",
        c.diagnostics()
    );

    // Delete → Shutdown: the shim and its VMM exit, the state dir goes.
    step("delete");
    assert_eq!(c.ctr(&["task", "delete", id]).code, Some(0));
    assert_eq!(c.ctr(&["containers", "rm", id]).code, Some(0));
    let start = Instant::now();
    while !c.shim_pids(id).is_empty() || process_running(vmm) {
        assert!(
            start.elapsed() < CLEAN,
            "after delete: shim {:?} and burrow-vmm {vmm} (alive: {}) must exit\n{}",
            c.shim_pids(id),
            process_running(vmm),
            c.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    let state = c.burrow_state().join("default").join(id);
    assert!(
        !state.exists(),
        "{} must be removed on Shutdown",
        state.display()
    );
    c.assert_clean(CLEAN);
}

#[test]
fn a_block_device_snapshot_is_the_containers_disk() {
    let pool = ThinPool::create(&format!("burrow-test-pool-{}", std::process::id()));
    step("thin pool ready");
    let c = Containerd::start_with("devmapper", NESTED_CONFIG, &pool.containerd_config());
    let id = "t-dm";
    run_detached(
        &c,
        &["--snapshotter", "devmapper"],
        id,
        &[
            "sh",
            "-c",
            "echo written-in-the-guest > /persisted && sync && sleep 100000",
        ],
    );
    // The VMM holds the snapshot's device itself, not an image copy: one
    // of its open files is a thin device of this pool's snapshots (on a
    // cold boot the device came as `--disk`, from a template into block
    // slot 0 through the control API).
    step("devmapper container runs");
    let vmm = c.vmm_pid(id);
    let held = pool.held_by(vmm);
    let disk = held
        .first()
        .unwrap_or_else(|| panic!("burrow-vmm (pid {vmm}) must hold a devmapper snapshot's device"))
        .display()
        .to_string();
    let images: Vec<_> = walk(&c.burrow_state())
        .into_iter()
        .chain(walk(c.image_dir()))
        .filter(|f| f.display().to_string().ends_with(".rootfs.img"))
        .collect();
    assert!(
        images.is_empty(),
        "no rootfs image is built for a block-device snapshot: {images:?}"
    );

    // The container sees the image's files and its own write, on its disk.
    let out = c.exec_ok(
        id,
        "look",
        &[
            "sh",
            "-c",
            "cat /persisted; ls /bin/busybox; grep ' / ' /proc/mounts",
        ],
    );
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.first(), Some(&"written-in-the-guest"), "{out}");
    assert_eq!(
        lines.get(1),
        Some(&"/bin/busybox"),
        "the image's files are there: {out}"
    );
    assert!(
        lines
            .get(2)
            .is_some_and(|l| l.starts_with("/dev/vda / ext4 rw")),
        "the root is the passed-through ext4 disk, writable: {out}"
    );
    assert_eq!(c.ctr(&["task", "kill", "-s", "SIGKILL", id]).code, Some(0));
    c.wait_status(id, "STOPPED", LONG);
    assert_eq!(c.ctr(&["task", "delete", id]).code, Some(0));

    // The write landed in the container's snapshot, the very device the VMM
    // had: mount it on the host and look.
    step("mount the snapshot on the host");
    let target = c.dir.join("snapshot-mount");
    std::fs::create_dir_all(&target).unwrap();
    let target_s = target.display().to_string();
    let m = c.ctr(&[
        "snapshots",
        "--snapshotter",
        "devmapper",
        "mounts",
        &target_s,
        id,
    ]);
    assert_eq!(m.code, Some(0), "{m:?}");
    // "mount -t ext4 /dev/mapper/NAME TARGET -o ..."
    let words: Vec<&str> = m.stdout.split_whitespace().collect();
    assert_eq!(
        words
            .get(3)
            .and_then(|w| std::fs::canonicalize(w).ok())
            .map(|p| p.display().to_string()),
        Some(disk.clone()),
        "the container's snapshot is the device burrow-vmm had: {m:?}"
    );
    host(command(&[
        "mount", "-o", "ro", "-t", "ext4", &disk, &target_s,
    ]));
    let persisted = std::fs::read_to_string(target.join("persisted"));
    host(command(&["umount", &target_s]));
    assert_eq!(
        persisted.ok().as_deref(),
        Some("written-in-the-guest\n"),
        "the guest's write must be in the snapshot after the task is gone"
    );
    assert_eq!(c.ctr(&["containers", "rm", id]).code, Some(0));
    c.assert_clean(CLEAN);
    drop(c);
    drop(pool);
}

/// Voluntary context switches (each one a sleep that ended: a wakeup) of
/// every thread of `pid` so far, summed per thread name.
fn wakeups(pid: i32) -> std::collections::BTreeMap<String, u64> {
    let mut by_name = std::collections::BTreeMap::new();
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("the process runs");
    for t in tasks.flatten() {
        let Ok(status) = std::fs::read_to_string(t.path().join("status")) else {
            continue;
        };
        let field = |k: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .map(str::trim)
        };
        let name = field("Name:").unwrap_or("?").to_string();
        let n: u64 = field("voluntary_ctxt_switches:")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        *by_name.entry(name).or_insert(0) += n;
    }
    by_name
}

fn wakeups_since(
    before: &std::collections::BTreeMap<String, u64>,
    pid: i32,
) -> std::collections::BTreeMap<String, u64> {
    wakeups(pid)
        .into_iter()
        .map(|(k, v)| {
            let was = before.get(&k).copied().unwrap_or(0);
            (k, v.saturating_sub(was))
        })
        .collect()
}

/// Nothing polls while a sandbox idles: over 30 s with only `sleep` in the
/// container, the VMM's event loop and the shim are not woken at all (no
/// tick, no health check, no agent poll reaching the host), and the guest's
/// vCPU sleeps most of the time.
#[test]
fn an_idle_sandbox_wakes_nothing_on_the_host() {
    let c = containerd("idle");
    let id = "t-idle";
    run_detached(&c, &[], id, &["sleep", "100000"]);
    let vmm = c.vmm_pid(id);
    let shims = c.shim_pids(id);
    assert_eq!(shims.len(), 1, "one shim serves {id}: {shims:?}");
    let shim = shims[0];
    // The guest's interrupts around the window, for the record: which of
    // the guest kernel's own timers wake its vCPU.
    let irqs = |n: &str| c.exec_ok(id, n, &["cat", "/proc/interrupts"]);
    let irqs_before = irqs("irq0");
    // Let the start settle (the first agent calls, the guest's late boot work).
    std::thread::sleep(Duration::from_secs(10));
    step("measure 30 s of idling");
    let (vmm0, shim0) = (wakeups(vmm), wakeups(shim));
    std::thread::sleep(Duration::from_secs(30));
    let (vmm1, shim1) = (wakeups_since(&vmm0, vmm), wakeups_since(&shim0, shim));
    eprintln!("wakeups in 30 s idle: burrow-vmm {vmm1:?}; shim {shim1:?}");
    eprintln!("guest /proc/interrupts about 42 s apart:\n{irqs_before}\n{}", irqs("irq1"));
    let event_loop = vmm1.get("burrow-vmm").copied().unwrap_or(0);
    let vcpus: u64 = vmm1.iter().filter(|(k, _)| k.starts_with("vcpu")).map(|(_, v)| v).sum();
    let shim_total: u64 = shim1.values().sum();
    // Before this test existed: a 200 ms tick (150 wakeups of the event loop
    // in 30 s) and the vsock traffic of a 500 ms OOM poll in the agent.
    assert!(event_loop <= 3, "burrow-vmm's event loop woke {event_loop} times in 30 s idle: {vmm1:?}");
    assert!(shim_total <= 10, "the shim woke {shim_total} times in 30 s idle: {shim1:?}");
    // The guest kernel's own timers wake its vCPU (about 30 times a second
    // in the nested test host); a busy guest would wake it thousands of times.
    assert!(vcpus <= 3000, "the guest's vCPUs woke {vcpus} times in 30 s idle: {vmm1:?}");
    kill_and_remove(&c, id);
}
