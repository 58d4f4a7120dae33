//! burrow-agent as PID 1 in a real VM: burrow-vmm boots the guest kernel
//! (guest-kernel/build) with the agent initramfs (rootfs/build), and the test
//! talks ttrpc to the agent over the VMM's hybrid vsock socket. A container
//! runs from an ext4 block device holding busybox. Run inside hack/testhost
//! (or on a host with hardware KVM).

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use burrow_protocol::agent::*;
use burrow_protocol::ttrpc::{self, context};
use burrow_protocol::AgentClient;
use burrow_tests::agent_vm::{self, Disk, Vm};

/// Guest code runs 10-20x slower in the nested test host.
const BOOT_TIMEOUT: Duration = Duration::from_secs(400);

/// An ext4 image with busybox and a few files for the container.
fn make_disk(dir: &Path) -> PathBuf {
    let tree = dir.join("tree");
    for d in ["bin", "etc", "tmp", "proc", "sys", "dev", "root"] {
        std::fs::create_dir_all(tree.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", tree.join("bin/busybox"))
        .expect("/bin/busybox (busybox-static) on the test host");
    let list = Command::new("/bin/busybox").arg("--list").output().unwrap();
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        if applet != "busybox" {
            let _ = std::os::unix::fs::symlink("busybox", tree.join("bin").join(applet));
        }
    }
    std::fs::write(tree.join("etc/marker"), "from the disk\n").unwrap();
    std::os::unix::fs::symlink("/../../../../init", tree.join("escape")).unwrap();
    let img = dir.join("rootfs.ext4");
    let st = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-d"])
        .arg(&tree)
        .arg(&img)
        .arg("64M")
        .status()
        .expect("mkfs.ext4 (e2fsprogs)");
    assert!(st.success(), "mkfs.ext4 failed");
    img
}

fn boot(dir: &Path, disk: &Path) -> Vm {
    agent_vm::boot(
        dir,
        512,
        &[Disk {
            path: disk,
            read_only: false,
        }],
        "quiet",
    )
}

fn ctx() -> context::Context {
    context::with_duration(Duration::from_secs(300))
}

/// Create and start container `id` from `spec` with the busybox disk
/// (/dev/vda) as its root; returns the request naming it, for Delete.
async fn run_container(c: &AgentClient, id: &str, spec: &serde_json::Value) -> ContainerRequest {
    let mut req = CreateContainerRequest::new();
    req.container_id = id.into();
    req.oci_spec = serde_json::to_vec(spec).unwrap();
    let mut rootfs = Rootfs::new();
    rootfs.source = "/dev/vda".into();
    rootfs.fstype = "ext4".into();
    req.rootfs = Some(rootfs).into();
    c.create_container(ctx(), &req).await.unwrap();
    let mut start = ContainerRequest::new();
    start.container_id = id.into();
    c.start_container(ctx(), &start).await.unwrap();
    start
}

fn process_json(args: &[&str]) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "args": args, "env": ["PATH=/bin:/usr/bin"], "cwd": "/", "user": {"uid": 0, "gid": 0},
    }))
    .unwrap()
}

async fn exec(
    c: &AgentClient,
    container: &str,
    id: &str,
    args: &[&str],
) -> ttrpc::Result<ExecProcessResponse> {
    let mut req = ExecProcessRequest::new();
    req.container_id = container.into();
    req.exec_id = id.into();
    req.oci_process = process_json(args);
    c.exec_process(ctx(), &req).await
}

async fn read_all(c: &AgentClient, container: &str, id: &str) -> Vec<u8> {
    let mut out = Vec::new();
    loop {
        let mut req = ReadStreamRequest::new();
        req.container_id = container.into();
        req.exec_id = id.into();
        let r = c.read_stdout(ctx(), &req).await.unwrap();
        if r.eof {
            return out;
        }
        out.extend_from_slice(&r.data);
    }
}

async fn wait(c: &AgentClient, container: &str, id: &str) -> WaitProcessResponse {
    let mut req = ProcessRequest::new();
    req.container_id = container.into();
    req.exec_id = id.into();
    c.wait_process(ctx(), &req).await.unwrap()
}

fn code_of<T: std::fmt::Debug>(r: ttrpc::Result<T>) -> ttrpc::Code {
    match r {
        Err(ttrpc::Error::RpcStatus(s)) => s.code(),
        other => panic!("expected an RPC status error, got {other:?}"),
    }
}

/// Peak RSS of the agent (PID 1 in the guest), KiB, read through the agent.
async fn agent_peak_kib(c: &AgentClient) -> u64 {
    let mut r = ReadFileRequest::new();
    r.path = "/proc/1/status".into();
    let st = c.read_file(ctx(), &r).await.unwrap();
    String::from_utf8_lossy(&st.data)
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[test]
fn agent_in_a_vm_runs_a_busybox_container() {
    let dir = burrow_tests::scratch_dir("agent-vm");
    let disk = make_disk(&dir);
    let mut vm = boot(&dir, &disk);
    let st = agent_vm::drive(&mut vm, BOOT_TIMEOUT, |c| async move {
        let h = c.health(ctx(), &HealthRequest::new()).await.unwrap();
        assert!(h.pid1, "agent is not PID 1");
        let mut t = SetTimeRequest::new();
        t.unix_seconds = 1_900_000_000;
        c.set_time(ctx(), &t).await.unwrap();
        let mut e = AddEntropyRequest::new();
        e.data = vec![42u8; 256];
        c.add_entropy(ctx(), &e).await.unwrap();

        // A container from the busybox disk.
        let spec = serde_json::json!({
            "ociVersion": "1.0.2",
            "process": {"args": ["sh", "-c", "echo hello from busybox; cat /etc/marker; hostname; exec sleep 1000"],
                        "env": ["PATH=/bin"], "cwd": "/", "user": {"uid": 0, "gid": 0}},
            "root": {"path": "rootfs"},
            "hostname": "bb",
        });
        let start = run_container(&c, "bb", &spec).await;
        let mut seen = Vec::new();
        while !String::from_utf8_lossy(&seen).contains("\nbb\n") {
            let mut r = ReadStreamRequest::new();
            r.container_id = "bb".into();
            let chunk = c.read_stdout(ctx(), &r).await.unwrap();
            assert!(!chunk.eof, "{:?}", String::from_utf8_lossy(&seen));
            seen.extend_from_slice(&chunk.data);
        }
        assert_eq!(
            String::from_utf8_lossy(&seen),
            "hello from busybox\nfrom the disk\nbb\n"
        );

        // Exit codes and signals.
        exec(&c, "bb", "seven", &["sh", "-c", "exit 7"])
            .await
            .unwrap();
        assert_eq!(wait(&c, "bb", "seven").await.exit_code, 7);
        exec(&c, "bb", "sleeper", &["sleep", "1000"]).await.unwrap();
        let mut kill = SignalProcessRequest::new();
        kill.container_id = "bb".into();
        kill.exec_id = "sleeper".into();
        kill.signal = 9;
        c.signal_process(ctx(), &kill).await.unwrap();
        assert_eq!(wait(&c, "bb", "sleeper").await.signal, 9);

        // A 100 MB stream of output arrives intact, and the agent's memory
        // stays bounded (BURROW_TEST_STREAM_BYTES overrides the size).
        let before = agent_peak_kib(&c).await;
        let total: usize = std::env::var("BURROW_TEST_STREAM_BYTES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(100_000_000);
        let cmd = format!("yes 0123456789abcdef0123456789abcde | head -c {total}");
        exec(&c, "bb", "big", &["sh", "-c", &cmd]).await.unwrap();
        let line = b"0123456789abcdef0123456789abcde\n";
        // The expected bytes from any offset: the line repeated, compared a
        // slice at a time (byte-wise asserts are slow in the nested host).
        let window = 1 << 20;
        let expected: Vec<u8> = line
            .iter()
            .copied()
            .cycle()
            .take(window + line.len())
            .collect();
        let mut got = 0usize;
        loop {
            let mut r = ReadStreamRequest::new();
            r.container_id = "bb".into();
            r.exec_id = "big".into();
            let chunk = c.read_stdout(ctx(), &r).await.unwrap();
            if chunk.eof {
                break;
            }
            for piece in chunk.data.chunks(window) {
                let off = got % line.len();
                assert!(
                    piece == &expected[off..off + piece.len()],
                    "corrupt data in bytes {got}..{}",
                    got + piece.len()
                );
                got += piece.len();
            }
        }
        assert_eq!(got, total);
        assert_eq!(wait(&c, "bb", "big").await.exit_code, 0);
        let after = agent_peak_kib(&c).await;
        assert!(
            after < before + 32 * 1024,
            "agent peak RSS {before} KiB -> {after} KiB"
        );

        // Files round-trip; escapes are refused.
        let mut w = WriteFileRequest::new();
        w.container_id = "bb".into();
        w.path = "/root/notes/a.txt".into();
        w.data = b"written by the test".to_vec();
        w.make_parents = true;
        c.write_file(ctx(), &w).await.unwrap();
        let mut r = ReadFileRequest::new();
        r.container_id = "bb".into();
        r.path = "/root/notes/a.txt".into();
        assert_eq!(
            c.read_file(ctx(), &r).await.unwrap().data,
            b"written by the test"
        );
        let mut ls = ListDirRequest::new();
        ls.container_id = "bb".into();
        ls.path = "/root/notes".into();
        let names: Vec<String> = c
            .list_dir(ctx(), &ls)
            .await
            .unwrap()
            .entries
            .into_iter()
            .map(|e| e.name)
            .collect();
        assert_eq!(names, vec!["a.txt".to_string()]);
        exec(&c, "bb", "cat", &["cat", "/root/notes/a.txt"])
            .await
            .unwrap();
        assert_eq!(read_all(&c, "bb", "cat").await, b"written by the test");
        for escape in ["../../../../init", "escape"] {
            r.path = escape.into();
            assert_eq!(
                code_of(c.read_file(ctx(), &r).await),
                ttrpc::Code::NOT_FOUND,
                "{escape}"
            );
        }
        // Malformed requests: clear errors, agent still serving.
        assert_eq!(
            code_of(exec(&c, "nope", "x", &["true"]).await),
            ttrpc::Code::NOT_FOUND
        );
        let mut bad = CreateContainerRequest::new();
        bad.container_id = "bad".into();
        bad.oci_spec = b"{".to_vec();
        assert_eq!(
            code_of(c.create_container(ctx(), &bad).await),
            ttrpc::Code::INVALID_ARGUMENT
        );

        c.delete_container(ctx(), &start).await.unwrap();
        c.power_off(ctx(), &PowerOffRequest::new()).await.unwrap();
    });
    assert_eq!(st.code(), Some(0), "{}", vm.diagnostics());
    let _ = std::fs::remove_dir_all(&dir);
}

/// hack/demo's command without containerd, many times in one guest (cheap:
/// about 1 s a container in the nested test host): each container has
/// containerd's default mounts, masks and a PID namespace, and `ps`, its
/// PID 1, must always list itself. Every other run also prints what its
/// /proc is, for the failure message. BURROW_TEST_REPEAT sets the count.
#[test]
fn ps_as_pid_1_lists_itself_in_every_container() {
    let dir = burrow_tests::scratch_dir("agent-vm-ps");
    let disk = make_disk(&dir);
    let mut vm = boot(&dir, &disk);
    let n: usize = std::env::var("BURROW_TEST_REPEAT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    let _ = agent_vm::drive(&mut vm, BOOT_TIMEOUT, |c| async move {
        let mut bad = Vec::new();
        let started = std::time::Instant::now();
        for i in 0..n {
            let diag = i % 2 == 1;
            let script = if diag {
                "echo \"hello $(uname -r) $(grep -c ^processor /proc/cpuinfo)\"; echo visible:; ps -o pid,comm; echo DIAG; readlink /proc/self; ls /proc | grep -c '^[0-9]'; grep proc /proc/self/mountinfo"
            } else {
                "echo \"hello $(uname -r) $(grep -c ^processor /proc/cpuinfo)\"; echo visible:; ps -o pid,comm"
            };
            let spec = serde_json::json!({
                "ociVersion": "1.0.2",
                "process": {"args": ["sh", "-c", script], "env": ["PATH=/bin"], "cwd": "/", "user": {"uid": 0, "gid": 0},
                            "noNewPrivileges": true,
                            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
                            "capabilities": {"bounding": ["CAP_CHOWN", "CAP_KILL", "CAP_SETUID", "CAP_SETGID", "CAP_DAC_OVERRIDE"],
                                             "effective": ["CAP_CHOWN", "CAP_KILL", "CAP_SETUID", "CAP_SETGID", "CAP_DAC_OVERRIDE"],
                                             "permitted": ["CAP_CHOWN", "CAP_KILL", "CAP_SETUID", "CAP_SETGID", "CAP_DAC_OVERRIDE"]}},
                "root": {"path": "rootfs"},
                "hostname": "bb",
                "mounts": [
                    {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
                    {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
                    {"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
                    {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
                    {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
                    {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
                    {"destination": "/run", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}
                ],
                "linux": {
                    "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network"}],
                    "maskedPaths": ["/proc/acpi", "/proc/asound", "/proc/kcore", "/proc/keys", "/proc/latency_stats", "/proc/timer_list",
                                    "/proc/timer_stats", "/proc/sched_debug", "/sys/firmware", "/proc/scsi"],
                    "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"]
                }
            });
            let id = format!("s{i}");
            let start = run_container(&c, &id, &spec).await;
            let out = String::from_utf8_lossy(&read_all(&c, &id, "").await).into_owned();
            let w = wait(&c, &id, "").await;
            let ok = out.contains("visible:\nPID   COMMAND\n    1 ") && w.exit_code == 0;
            if !ok {
                bad.push(format!(
                    "run {i} ({}): exit {}, stdout {out:?}",
                    if diag { "with /proc details" } else { "plain" },
                    w.exit_code
                ));
            }
            c.delete_container(ctx(), &start).await.unwrap();
        }
        eprintln!("{n} containers in {:?}", started.elapsed());
        c.power_off(ctx(), &PowerOffRequest::new()).await.unwrap();
        assert!(
            bad.is_empty(),
            "{} of {n} listings lost ps's own row:\n{}",
            bad.len(),
            bad.join("\n")
        );
    });
    let _ = std::fs::remove_dir_all(&dir);
}

/// The system calls the VMM's thread named `name` is seen blocked in,
/// ten looks 20 ms apart (numbers, from `/proc/PID/task/TID/syscall`): a
/// vCPU in the guest is mostly in `ioctl` (KVM_RUN, 16), one the VMM holds
/// waits on its condvar in `futex` (202), but for a moment's look when
/// the condvar is notified.
fn thread_syscalls(pid: u32, name: &str) -> Vec<String> {
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let task = task.unwrap().path();
        let comm = std::fs::read_to_string(task.join("comm")).unwrap_or_default();
        if comm.trim() != name {
            continue;
        }
        let mut seen = Vec::new();
        for _ in 0..10 {
            let sc = std::fs::read_to_string(task.join("syscall")).unwrap();
            // A thread caught running says "running".
            seen.push(sc.split_whitespace().next().unwrap_or_default().to_string());
            std::thread::sleep(Duration::from_millis(20));
        }
        return seen;
    }
    panic!("burrow-vmm {pid} has no thread {name}");
}

/// One request on the VMM's control socket; its response line.
fn api(path: &Path, line: &str) -> serde_json::Value {
    use std::io::{BufRead, Write};
    let mut s = std::os::unix::net::UnixStream::connect(path).unwrap();
    s.write_all(format!("{line}\n").as_bytes()).unwrap();
    let mut r = std::io::BufReader::new(s);
    loop {
        let mut l = String::new();
        assert!(r.read_line(&mut l).unwrap() > 0, "the VMM closed the API socket");
        let v: serde_json::Value = serde_json::from_str(&l).unwrap();
        if v.get("ok").is_some() {
            return v;
        }
    }
}

/// A VM with room for 3 vCPUs of which 1 runs (a pod's VM before its
/// containers arrive): the guest sees three present and one online; a
/// guest root that tries to bring the third up itself gets an error and
/// the VMM never runs that vCPU (its thread waits in `futex`, where a
/// running vCPU's is in KVM_RUN's `ioctl`); once the VMM lets two run
/// (`set_vcpus`), the agent's OnlineCpus brings the second online, and
/// the third is still held. Then it shrinks back (the agent takes the
/// second offline, the VMM holds it again) and grows once more: a held
/// vCPU that ran before comes back online.
#[test]
fn a_vcpu_runs_only_once_the_vmm_lets_it() {
    const FUTEX: &str = "202";
    const IOCTL: &str = "16";
    let dir = burrow_tests::scratch_dir("agent-vm-vcpus");
    let disk = make_disk(&dir);
    let api_sock = dir.join("api");
    let mut vm = agent_vm::boot_with(
        &dir,
        512,
        &[Disk {
            path: &disk,
            read_only: false,
        }],
        "quiet",
        &["--vcpus", "1", "--max-vcpus", "3", "--api", api_sock.to_str().unwrap()],
    );
    let pid = vm.child.id();
    let api_sock = api_sock.clone();
    let st = agent_vm::drive(&mut vm, BOOT_TIMEOUT, |c| async move {
        let caps = ["CAP_SYS_ADMIN", "CAP_DAC_OVERRIDE"];
        let spec = serde_json::json!({
            "ociVersion": "1.0.2",
            "process": {"args": ["sh", "-c", "cat /sys/devices/system/cpu/present /sys/devices/system/cpu/online; echo 1 > /sys/devices/system/cpu/cpu2/online; echo rc=$?; cat /sys/devices/system/cpu/online"],
                        "env": ["PATH=/bin"], "cwd": "/", "user": {"uid": 0, "gid": 0},
                        "capabilities": {"bounding": caps, "effective": caps, "permitted": caps}},
            "root": {"path": "rootfs"},
            "mounts": [{"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["rw", "nosuid", "noexec", "nodev"]}],
        });
        // A held vCPU never enters KVM_RUN's ioctl and waits in futex.
        // It shares the VMM's condition variable with the others, so a
        // grant or a pause wakes it for a moment to look again: a sample
        // may catch it "running" on the way back to futex, never in KVM_RUN.
        let held_vcpu = |name: &str, what: &str| {
            let seen = thread_syscalls(pid, name);
            let parked = seen.iter().filter(|s| *s == FUTEX).count();
            assert!(
                !seen.iter().any(|s| s == IOCTL) && parked * 2 > seen.len(),
                "{what}: {name} in {seen:?}"
            );
        };
        let held = |what: &str| held_vcpu("vcpu2", what);
        // A vCPU let run is in KVM_RUN's ioctl, or on a CPU right now
        // ("running": a busy guest, as at boot in CI); never parked in
        // futex the whole time the way a held one is.
        let in_guest = |name: &str| {
            let seen = thread_syscalls(pid, name);
            assert!(
                seen.iter().any(|s| s == IOCTL || s == "running"),
                "{name} never in KVM_RUN: {seen:?}"
            );
        };
        held("at boot");
        in_guest("vcpu0");
        run_container(&c, "root", &spec).await;
        let out = String::from_utf8_lossy(&read_all(&c, "root", "").await).into_owned();
        assert_eq!(wait(&c, "root", "").await.exit_code, 0, "{out}");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.first(), Some(&"0-2"), "three vCPUs present: {out}");
        assert_eq!(lines.get(1), Some(&"0"), "one online at boot: {out}");
        assert!(
            lines.get(2).is_some_and(|l| l.starts_with("rc=") && *l != "rc=0"),
            "the guest cannot start a vCPU the VMM holds: {out}"
        );
        assert_eq!(lines.get(3), Some(&"0"), "still one online: {out}");
        held("after the guest tried to start it");

        let r = api(&api_sock, r#"{"cmd":"set_vcpus","count":2}"#);
        assert_eq!(r["ok"], true, "{r}");
        let r = api(&api_sock, r#"{"cmd":"set_vcpus","count":4}"#);
        assert_eq!(r["ok"], false, "more vCPUs than the VM has: {r}");
        let mut req = OnlineCpusRequest::new();
        req.count = 2;
        let online = c.online_cpus(ctx(), &req).await.unwrap();
        assert_eq!(online.online, 2);
        let mut f = ReadFileRequest::new();
        f.path = "/sys/devices/system/cpu/online".into();
        let seen = c.read_file(ctx(), &f).await.unwrap();
        assert_eq!(String::from_utf8_lossy(&seen.data).trim(), "0-1");
        req.count = 4;
        assert_eq!(code_of(c.online_cpus(ctx(), &req).await), ttrpc::Code::INVALID_ARGUMENT);
        in_guest("vcpu1");
        held("after vCPU 1 was let run");

        // Back to one: offline in the guest first, then held by the VMM.
        req.count = 1;
        assert_eq!(c.online_cpus(ctx(), &req).await.unwrap().online, 1);
        let seen = c.read_file(ctx(), &f).await.unwrap();
        assert_eq!(String::from_utf8_lossy(&seen.data).trim(), "0", "vCPU 1 offline");
        let r = api(&api_sock, r#"{"cmd":"set_vcpus","count":1}"#);
        assert_eq!(r["ok"], true, "{r}");
        // The kick is sent before the answer; give the thread its moment.
        std::thread::sleep(Duration::from_millis(200));
        held_vcpu("vcpu1", "after the VMM held vCPU 1 again");
        held("after vCPU 1 was held");
        in_guest("vcpu0");

        // And two again: the vCPU that ran and was held comes back.
        let r = api(&api_sock, r#"{"cmd":"set_vcpus","count":2}"#);
        assert_eq!(r["ok"], true, "{r}");
        req.count = 2;
        assert_eq!(c.online_cpus(ctx(), &req).await.unwrap().online, 2);
        let seen = c.read_file(ctx(), &f).await.unwrap();
        assert_eq!(String::from_utf8_lossy(&seen.data).trim(), "0-1", "vCPU 1 online again");
        in_guest("vcpu1");
        held("after vCPU 1 came back");
        c.power_off(ctx(), &PowerOffRequest::new()).await.unwrap();
    });
    assert!(st.success(), "{st}");
}
