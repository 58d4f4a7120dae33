//! The jailed `burrow-vmm` (issue 15), with tiny hand-written guests on
//! any /dev/kvm (PVM included). Run as root, as the shim runs it: the
//! process is inspected from outside through /proc.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use burrow_vmm::probe::tiny_elf;

const UID: &str = "64123";
const GID: &str = "64124";

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("burrow-jail-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A guest that prints `text` on COM1, then spins (`jmp $`) or resets.
fn kernel(dir: &Path, text: &[u8], then_reset: bool) -> PathBuf {
    let mut code = vec![0x66, 0xba, 0xf8, 0x03]; // mov dx, 0x3f8
    for &b in text {
        code.extend_from_slice(&[0xb0, b, 0xee]); // mov al, b; out dx, al
    }
    if then_reset {
        code.extend_from_slice(&[0xb0, 0xfe, 0xe6, 0x64]); // i8042 reset
    } else {
        code.extend_from_slice(&[0xeb, 0xfe]);
    }
    let k = dir.join("vmlinux");
    std::fs::write(&k, tiny_elf(0x10_0000, &code, true)).unwrap();
    k
}

fn vmm(k: &Path, dir: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_burrow-vmm"));
    c.arg("run")
        .args(["--kernel", k.to_str().unwrap(), "--mem", "32"])
        .args(["--api", dir.join("api.sock").to_str().unwrap()])
        .args(["--serial-log", dir.join("console.log").to_str().unwrap()])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c
}

struct Running(Child);

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Wait until the guest printed `text` (it runs only once the VMM is
/// confined).
fn wait_console(dir: &Path, text: &str, child: &mut Child) {
    let start = Instant::now();
    loop {
        let log = std::fs::read_to_string(dir.join("console.log")).unwrap_or_default();
        if log.contains(text) {
            return;
        }
        if let Some(st) = child.try_wait().unwrap() {
            let mut err = String::new();
            let _ = std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err);
            panic!("burrow-vmm exited ({st}) before the guest printed {text:?}: {err}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "no {text:?} on the console: {log:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn status_field(status: &str, name: &str) -> String {
    status
        .lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(':')))
        .unwrap_or_else(|| panic!("no {name} in {status}"))
        .trim()
        .to_string()
}

fn ns(pid: &str, kind: &str) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).unwrap()
}

/// A cgroup v2 mount on this host.
fn cgroup2_root() -> PathBuf {
    let mi = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    mi.lines()
        .find_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            post.starts_with("cgroup2 ")
                .then(|| pre.split(' ').nth(4).map(PathBuf::from))
                .flatten()
        })
        .expect("a cgroup v2 hierarchy is mounted")
}

fn api_status(dir: &Path) -> String {
    let s = UnixStream::connect(dir.join("api.sock")).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    (&s).write_all(b"{\"cmd\":\"status\"}\n").unwrap();
    let mut line = String::new();
    BufReader::new(&s).read_line(&mut line).unwrap();
    line
}

/// A jailed VMM: the jail's uid and gid, no capabilities, no_new_privs,
/// every thread filtered, its own mount/network/IPC/UTS namespaces, a root
/// with nothing but its own directory, the rlimits, the cgroup and OOM
/// score it was given; its API still answers and its guest still prints.
/// The same VMM without `--jail` (the control) runs as root in ours.
#[test]
fn a_jailed_vmm_is_unprivileged_filtered_and_alone() {
    let d = tmpdir("confined");
    let k = kernel(&d, b"spinning\n", false);
    let cg = cgroup2_root().join(format!("burrow-jail-test-{}", std::process::id()));
    let _ = std::fs::remove_dir(&cg);
    std::fs::create_dir(&cg).unwrap();
    let me = std::process::id().to_string();
    {
        let extra = [
            "--jail",
            "--jail-uid",
            UID,
            "--jail-gid",
            GID,
            "--exit-with-parent",
            "--cgroup",
            cg.to_str().unwrap(),
            "--oom-score-adj",
            "345",
        ];
        let mut vm = Running(vmm(&k, &d, &extra).spawn().unwrap());
        wait_console(&d, "spinning", &mut vm.0);
        let pid = vm.0.id().to_string();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        assert_eq!(
            status_field(&status, "Uid"),
            format!("{UID}\t{UID}\t{UID}\t{UID}")
        );
        assert_eq!(
            status_field(&status, "Gid"),
            format!("{GID}\t{GID}\t{GID}\t{GID}")
        );
        assert_eq!(status_field(&status, "Groups"), "");
        for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
            assert_eq!(status_field(&status, cap), "0000000000000000", "{cap}");
        }
        assert_eq!(status_field(&status, "NoNewPrivs"), "1");
        let mut names = Vec::new();
        for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
            let t = t.unwrap().path();
            let name = std::fs::read_to_string(t.join("comm"))
                .unwrap()
                .trim()
                .to_string();
            let st = std::fs::read_to_string(t.join("status")).unwrap();
            if !name.starts_with("kvm") {
                // KVM's own kernel threads (kvm-nx-lpage-recovery) join the
                // thread group; they run no user code.
                assert_eq!(
                    status_field(&st, "Seccomp"),
                    "2",
                    "thread {name} is filtered"
                );
            }
            names.push(name);
        }
        for t in ["burrow-vmm", "vcpu0", "parent-watch"] {
            assert!(names.iter().any(|n| n == t), "thread {t} in {names:?}");
        }
        for kind in ["mnt", "net", "ipc", "uts"] {
            assert_ne!(ns(&pid, kind), ns(&me, kind), "own {kind} namespace");
        }
        let root: Vec<_> = std::fs::read_dir(format!("/proc/{pid}/root"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        let first = d
            .components()
            .nth(1)
            .unwrap()
            .as_os_str()
            .to_str()
            .unwrap()
            .to_string();
        assert_eq!(
            root,
            vec![first],
            "the jail's root holds only the way to its directory"
        );
        let inside = PathBuf::from(format!("/proc/{pid}/root{}", d.display()));
        assert!(
            inside.join("console.log").exists(),
            "its directory is there"
        );
        let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
        for (what, value) in [
            ("Max open files", "4096"),
            ("Max locked memory", "0"),
            ("Max core file size", "0"),
        ] {
            let line = limits.lines().find(|l| l.starts_with(what)).unwrap();
            let v: Vec<&str> = line[what.len()..].split_whitespace().take(2).collect();
            assert_eq!(v, [value, value], "{line}");
        }
        assert_eq!(
            std::fs::read_to_string(format!("/proc/{pid}/oom_score_adj"))
                .unwrap()
                .trim(),
            "345"
        );
        let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        let want = format!("0::/{}", cg.file_name().unwrap().to_str().unwrap());
        assert!(
            cgroup.lines().any(|l| l.ends_with(&want)),
            "in {want}: {cgroup}"
        );
        assert!(api_status(&d).contains("\"running\""), "the API answers");
    }
    let _ = std::fs::remove_dir(&cg);

    // The control: no --jail.
    let d = tmpdir("control");
    let k = kernel(&d, b"spinning\n", false);
    let mut vm = Running(vmm(&k, &d, &[]).spawn().unwrap());
    wait_console(&d, "spinning", &mut vm.0);
    let pid = vm.0.id().to_string();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert_eq!(status_field(&status, "Uid"), "0\t0\t0\t0");
    assert_eq!(ns(&pid, "mnt"), ns(&me, "mnt"));
    assert_eq!(
        status_field(&status, "Seccomp"),
        "2",
        "the filters apply without the jail too"
    );
}

/// A syscall outside the filters (an AF_INET socket) kills the VMM with
/// SIGSYS; with `--no-seccomp` (the control) the same VMM lives on and its
/// guest runs to its reset.
#[test]
fn a_syscall_outside_the_filters_kills_the_vmm() {
    let d = tmpdir("sigsys");
    let k = kernel(&d, b"hello\n", true);
    for seccomp in [true, false] {
        let mut extra = vec![
            "--jail",
            "--jail-uid",
            UID,
            "--jail-gid",
            GID,
            "--test-forbidden-syscall",
        ];
        if !seccomp {
            extra.push("--no-seccomp");
        }
        let mut child = vmm(&k, &d, &extra).spawn().unwrap();
        let start = Instant::now();
        let st = loop {
            if let Some(st) = child.try_wait().unwrap() {
                break st;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "burrow-vmm did not exit"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        let _ = std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err);
        if seccomp {
            assert_eq!(st.signal(), Some(libc::SIGSYS), "{st}: {err}");
        } else {
            assert_eq!(st.code(), Some(0), "{err}");
            assert!(err.contains("the forbidden syscall was allowed"), "{err}");
            let log = std::fs::read_to_string(d.join("console.log")).unwrap();
            assert!(log.contains("hello"), "{log}");
        }
    }
}

/// Killing the jailed VMM's parent (the shim, in production) ends the VMM.
#[test]
fn a_jailed_vmm_ends_with_its_parent() {
    let d = tmpdir("parent");
    let k = kernel(&d, b"spinning\n", false);
    let bin = env!("CARGO_BIN_EXE_burrow-vmm");
    let mut parent = Command::new("sh")
        .args([
            "-c",
            &format!(
                "{bin} run --kernel {} --mem 32 --serial-log {}/console.log --jail --exit-with-parent 2>{}/stderr & echo $!; exec sleep 60",
                k.display(),
                d.display(),
                d.display()
            ),
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(parent.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let pid: u32 = line.trim().parse().unwrap();
    let alive = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit(')')
                    .next()
                    .map(|r| !r.trim_start().starts_with('Z'))
            })
            .unwrap_or(false)
    };
    let start = Instant::now();
    while !std::fs::read_to_string(d.join("console.log"))
        .unwrap_or_default()
        .contains("spinning")
    {
        assert!(
            start.elapsed() < Duration::from_secs(20) && alive(),
            "the jailed VMM did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert_ne!(status_field(&status, "Uid"), "0\t0\t0\t0", "jailed");
    parent.kill().unwrap();
    parent.wait().unwrap();
    let killed = Instant::now();
    while alive() && killed.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let stderr = std::fs::read_to_string(d.join("stderr")).unwrap_or_default();
    assert!(
        !alive(),
        "the VMM still runs {:?} after its parent died: {stderr}",
        killed.elapsed()
    );
    assert!(stderr.contains("exited; stopping the VM"), "{stderr}");
}
