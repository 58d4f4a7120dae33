//! Snapshot and restore of the `burrow-vmm` binary with tiny hand-written
//! guests, on any /dev/kvm (PVM included): a counter that continues across
//! a restore (twice from one snapshot), incremental snapshots that hold
//! only the pages the guest touched, and state files that are refused.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use burrow_vmm::probe::tiny_elf;
use burrow_vmm_api::{ApiError, ErrorKind};

const ENTRY: u64 = 0x10_0000;

/// 32-bit guest: `incl [0x50000]`; every 0x1000 increments it prints the
/// counter as 8 hex digits and a newline on COM1. The count lives in guest
/// memory and the printing in registers, so a restore that lost either
/// would restart or garble the sequence.
const COUNTER: &[u8] = &[
    0xff, 0x05, 0x00, 0x00, 0x05, 0x00, // incl 0x50000
    0x8b, 0x1d, 0x00, 0x00, 0x05, 0x00, // mov ebx, [0x50000]
    0xf7, 0xc3, 0xff, 0x0f, 0x00, 0x00, // test ebx, 0xfff
    0x75, 0xec, // jnz loop
    0xba, 0xf8, 0x03, 0x00, 0x00, // mov edx, 0x3f8
    0xb9, 0x08, 0x00, 0x00, 0x00, // mov ecx, 8
    0x89, 0xde, // mov esi, ebx
    0xc1, 0xc6, 0x04, // digit: rol esi, 4
    0x89, 0xf0, // mov eax, esi
    0x83, 0xe0, 0x0f, // and eax, 0xf
    0x83, 0xc0, 0x30, // add eax, '0'
    0x83, 0xf8, 0x39, // cmp eax, '9'
    0x76, 0x03, // jbe ok
    0x83, 0xc0, 0x07, // add eax, 7
    0xee, // ok: out dx, al
    0x49, // dec ecx
    0x75, 0xe9, // jnz digit
    0xb0, 0x0a, 0xee, // mov al, '\n'; out dx, al
    0xeb, 0xc4, // jmp loop
];

/// 32-bit guest: prints `A`, spins a while, writes 'XXXX' to the first
/// word of 32 pages from 0x200000, prints `B\n`, then forever prints the
/// byte at 0x21f000 (the last page it wrote) with a pause between.
const PAGES: &[u8] = &[
    0xba, 0xf8, 0x03, 0x00, 0x00, 0xb0, 0x41, 0xee, 0xb9, 0x40, 0x0d, 0x03, 0x00, 0x49, 0x75, 0xfd,
    0xbf, 0x00, 0x00, 0x20, 0x00, 0xb9, 0x20, 0x00, 0x00, 0x00, 0xc7, 0x07, 0x58, 0x58, 0x58, 0x58,
    0x81, 0xc7, 0x00, 0x10, 0x00, 0x00, 0x49, 0x75, 0xf1, 0xb0, 0x42, 0xee, 0xb0, 0x0a, 0xee, 0xb9,
    0xa0, 0x86, 0x01, 0x00, 0x49, 0x75, 0xfd, 0xa0, 0x00, 0xf0, 0x21, 0x00, 0xee, 0xeb, 0xf0,
];
const PAGES_TOUCHED: u64 = 32;

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("burrow-snap-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn kernel(dir: &Path, code: &[u8]) -> PathBuf {
    let k = dir.join("vmlinux");
    std::fs::write(&k, tiny_elf(ENTRY, code, true)).unwrap();
    k
}

/// A running burrow-vmm with its API connection and serial log.
struct Vm {
    child: Child,
    api: BufReader<UnixStream>,
    log: PathBuf,
}

fn spawn(args: &[&str], api: &Path, log: &Path) -> Vm {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_burrow-vmm"));
    cmd.arg("run")
        .args(args)
        .args(["--api", api.to_str().unwrap(), "--serial-log", log.to_str().unwrap()]);
    let child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let start = Instant::now();
    let stream = loop {
        if let Ok(s) = UnixStream::connect(api) {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(20), "API socket {} never appeared", api.display());
        std::thread::sleep(Duration::from_millis(20));
    };
    stream.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    Vm { child, api: BufReader::new(stream), log: log.to_path_buf() }
}

impl Vm {
    /// Send a request line; return its response line (events skipped).
    fn request(&mut self, line: &str) -> serde_json::Value {
        self.api.get_mut().write_all(format!("{line}\n").as_bytes()).unwrap();
        loop {
            let mut l = String::new();
            assert!(self.api.read_line(&mut l).unwrap() > 0, "API closed while waiting for an answer to {line}");
            if l.starts_with("{\"ok\"") {
                return serde_json::from_str(&l).unwrap();
            }
        }
    }

    fn snapshot(&mut self, dir: &Path, incremental: bool) -> serde_json::Value {
        let r = self.request(&format!(
            "{{\"cmd\":\"snapshot\",\"dir\":{},\"incremental\":{incremental}}}",
            serde_json::to_string(dir.to_str().unwrap()).unwrap()
        ));
        assert_eq!(r["ok"], true, "snapshot failed: {r}");
        assert!(r["state"] == "paused" || r["state"] == "created", "VM is left paused (or not yet started): {r}");
        r["snapshot"].clone()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Wait until the serial log satisfies `ok`.
    fn wait_log(&mut self, what: &str, ok: impl Fn(&str) -> bool) -> String {
        let start = Instant::now();
        loop {
            let l = self.log();
            if ok(&l) {
                return l;
            }
            if let Some(st) = self.child.try_wait().unwrap() {
                let mut err = String::new();
                let _ = std::io::Read::read_to_string(self.child.stderr.as_mut().unwrap(), &mut err);
                panic!("burrow-vmm exited ({st}) before {what}; log {l:?}; stderr {err}");
            }
            assert!(start.elapsed() < Duration::from_secs(90), "timed out waiting for {what}; log {l:?}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Stop through the API and check the exit status is 0.
    fn stop(mut self) {
        let _ = self.api.get_mut().write_all(b"{\"cmd\":\"stop\"}\n");
        let start = Instant::now();
        while self.child.try_wait().unwrap().is_none() {
            if start.elapsed() > Duration::from_secs(20) {
                self.child.kill().unwrap();
                panic!("burrow-vmm did not stop");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let out = self.child.wait_with_output().unwrap();
        assert_eq!(out.status.code(), Some(0), "stderr {}", String::from_utf8_lossy(&out.stderr));
    }
}

/// Complete lines of the counter's output as numbers.
fn counter_values(log: &str) -> Vec<u64> {
    let mut lines: Vec<&str> = log.split('\n').collect();
    lines.pop(); // partial or empty last line
    lines
        .iter()
        .map(|l| u64::from_str_radix(l, 16).unwrap_or_else(|_| panic!("bad counter line {l:?} in {log:?}")))
        .collect()
}

/// The values must be 0x1000, 0x2000, ... with no gap, repeat or restart.
fn assert_continuous(values: &[u64], what: &str) {
    for (i, v) in values.iter().enumerate() {
        assert_eq!(*v, (i as u64 + 1) * 0x1000, "{what}: value {i} of {values:x?}");
    }
}

fn lines(s: &str) -> usize {
    s.matches('\n').count()
}

#[test]
fn counter_continues_after_restore_twice_from_one_snapshot() {
    let d = tmpdir("counter");
    let k = kernel(&d, COUNTER);
    let snap = d.join("snap");
    let mut vm = spawn(&["--kernel", k.to_str().unwrap(), "--mem", "32"], &d.join("api0"), &d.join("log0"));
    vm.wait_log("3 counter lines", |l| lines(l) >= 3);
    let info = vm.snapshot(&snap, false);
    assert_eq!(info["memory_bytes"], 32u64 << 20, "{info}");
    let pages = info["memory_pages"].as_u64().unwrap();
    assert!(pages > 0 && pages < 64, "a tiny guest has few non-zero pages: {info}");
    let used = std::fs::metadata(snap.join("memory")).map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512).unwrap();
    assert!(used < 1 << 20, "memory file is sparse: {used} bytes allocated");
    // Paused: the log does not grow.
    let before = vm.log();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(vm.log(), before, "VM stays paused after the snapshot");
    vm.stop();
    let original = std::fs::read_to_string(d.join("log0")).unwrap();
    assert_eq!(original, before, "a paused VM runs no more guest code when stopped");
    assert_continuous(&counter_values(&original), "before the snapshot");

    // Two VMs from the one snapshot at the same time (the memory file is
    // mapped MAP_PRIVATE by both), then a third afterwards.
    let restore = |round: u32| spawn(&["--restore", snap.to_str().unwrap()], &d.join(format!("api{round}")), &d.join(format!("log{round}")));
    let check = |round: u32, mut vm: Vm| {
        vm.wait_log("3 more counter lines", |l| lines(l) >= 3);
        vm.stop();
        let after = std::fs::read_to_string(d.join(format!("log{round}"))).unwrap();
        let values = counter_values(&format!("{original}{after}"));
        assert!(values.len() >= counter_values(&original).len() + 3);
        assert_continuous(&values, &format!("restore {round}: before + after"));
    };
    let (a, b) = (restore(1), restore(2));
    check(1, a);
    check(2, b);
    check(3, restore(3));
    let unchanged = std::fs::read(snap.join("memory")).unwrap();
    assert_eq!(unchanged.len(), 32 << 20, "restored guests never write the snapshot's memory file");
    assert!(unchanged.get(0x50000..0x50004).is_some_and(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u64 <= (counter_values(&original).len() as u64 + 1) * 0x1000));
}

#[test]
fn incremental_snapshot_holds_the_touched_pages() {
    let d = tmpdir("incr");
    let k = kernel(&d, PAGES);
    let (full, inc) = (d.join("full"), d.join("inc"));
    let mut vm = spawn(&["--kernel", k.to_str().unwrap(), "--mem", "32", "--paused"], &d.join("api0"), &d.join("log0"));
    let r = vm.request(&format!("{{\"cmd\":\"snapshot\",\"dir\":\"{}\",\"incremental\":true}}", inc.display()));
    assert_eq!(r["ok"], false, "an incremental snapshot needs a base: {r}");
    assert!(r["error"]["message"].as_str().unwrap().contains("needs a full snapshot"), "{r}");
    assert_eq!(r["error"]["kind"], "invalid_state", "{r}");
    let info = vm.snapshot(&full, false);
    assert_eq!(info["incremental"], false);
    let r = vm.request("{\"cmd\":\"start\"}");
    assert_eq!(r["state"], "running", "{r}");
    vm.wait_log("the pages written", |l| l.contains("B\n"));
    let info = vm.snapshot(&inc, true);
    let pages = info["memory_pages"].as_u64().unwrap();
    assert!(
        (PAGES_TOUCHED..PAGES_TOUCHED + 4).contains(&pages),
        "guest touched {PAGES_TOUCHED} pages, incremental snapshot has {pages}: {info}"
    );
    assert_eq!(std::fs::metadata(inc.join("memory")).unwrap().len(), pages * 4096);
    // The snapshotted VM resumes where it was.
    let seen = vm.log().len();
    assert_eq!(vm.request("{\"cmd\":\"resume\"}")["state"], "running");
    vm.wait_log("output after resume", |l| l.len() > seen + 1);
    vm.stop();

    // base + overlay: the guest continues printing the byte it wrote.
    let mut vm = spawn(&["--restore", inc.to_str().unwrap()], &d.join("api1"), &d.join("log1"));
    let l = vm.wait_log("the written byte", |l| l.len() >= 3);
    vm.stop();
    assert!(!l.contains('A'), "restored guest continues, does not restart: {l:?}");
    assert!(l.bytes().take(3).all(|b| b == b'X'), "overlay page restored: {l:?}");

    // The base alone starts over from the beginning.
    let mut vm = spawn(&["--restore", full.to_str().unwrap()], &d.join("api2"), &d.join("log2"));
    let l = vm.wait_log("the first output", |l| l.contains("B\n"));
    vm.stop();
    assert!(l.starts_with("AB\n"), "{l:?}");
}

/// Restore must refuse a bad snapshot with status 2 before creating
/// anything (no API socket, no serial log).
fn assert_refused(snap: &Path, d: &Path, extra: &[&str], expect: &str) -> ErrorKind {
    let log = d.join("refused.log");
    let kind = refused(snap, d, extra, expect);
    assert!(!log.exists(), "{expect}: nothing created");
    kind
}

/// A snapshot refused while the VM is being rebuilt (a device state that
/// does not fit): status 2, and the API socket it had bound is gone.
fn assert_refused_late(snap: &Path, d: &Path, expect: &str) {
    refused(snap, d, &[], expect);
    let _ = std::fs::remove_file(d.join("refused.log"));
}

/// Runs a refused restore; returns the kind of its typed failure line.
fn refused(snap: &Path, d: &Path, extra: &[&str], expect: &str) -> ErrorKind {
    let api = d.join("refused.sock");
    let log = d.join("refused.log");
    let out = Command::new(env!("CARGO_BIN_EXE_burrow-vmm"))
        .args(["run", "--restore", snap.to_str().unwrap(), "--api", api.to_str().unwrap()])
        .args(["--serial-log", log.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{expect}: {stderr}");
    assert!(stderr.contains(expect), "expected {expect:?} in {stderr}");
    assert!(!api.exists(), "{expect}: API socket not left behind");
    let last = stderr.lines().last().unwrap_or_default();
    let typed = ApiError::from_failure_line(last).unwrap_or_else(|| panic!("no typed failure line in {stderr}"));
    assert!(typed.message.contains(expect), "expected {expect:?} in {typed:?}");
    typed.kind
}

#[test]
fn bad_snapshots_are_refused_with_status_2() {
    let d = tmpdir("bad");
    let k = kernel(&d, COUNTER);
    let snap = d.join("snap");
    let disk = d.join("disk.img");
    std::fs::write(&disk, vec![0u8; 8192]).unwrap();
    let mut vm = spawn(
        &["--kernel", k.to_str().unwrap(), "--mem", "32", "--paused", "--disk", disk.to_str().unwrap()],
        &d.join("api0"),
        &d.join("log0"),
    );
    vm.snapshot(&snap, false);
    vm.stop();
    // Disks: the snapshot recorded one of 8 KiB.
    let small = d.join("small.img");
    std::fs::write(&small, vec![0u8; 4096]).unwrap();
    let kind = assert_refused(&snap, &d, &["--disk", small.to_str().unwrap()], "is 4096 bytes, the snapshot's disk was 8192 bytes");
    assert_eq!(kind, ErrorKind::InvalidRequest);
    assert_refused(&snap, &d, &["--disk", small.to_str().unwrap(), "--disk", small.to_str().unwrap()], "2 disk paths given, the snapshot has 1 disks");
    let good = std::fs::read(snap.join("state")).unwrap();
    let mem = std::fs::read(snap.join("memory")).unwrap();
    let bad = d.join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    let with_state = |state: &[u8], memory: &[u8]| {
        std::fs::write(bad.join("state"), state).unwrap();
        std::fs::write(bad.join("memory"), memory).unwrap();
    };

    let mut corrupt = good.clone();
    let n = corrupt.len();
    corrupt[n / 2] ^= 0x01;
    with_state(&corrupt, &mem);
    assert_eq!(assert_refused(&bad, &d, &[], "checksum"), ErrorKind::Corrupt);

    with_state(&good[..good.len() - 10], &mem);
    assert_refused(&bad, &d, &[], "truncated");

    let mut version = good.clone();
    version[8] = 99;
    with_state(&version, &mem);
    assert_eq!(assert_refused(&bad, &d, &[], "version 99 is not supported"), ErrorKind::Unsupported);

    let mut huge = good.clone();
    huge[16..24].copy_from_slice(&(1u64 << 40).to_le_bytes());
    with_state(&huge, &mem);
    assert_refused(&bad, &d, &[], "over the limit");

    with_state(&good, &mem[..4096]);
    assert_refused(&bad, &d, &[], "expected 33554432");

    with_state(b"", &mem);
    assert_refused(&bad, &d, &[], "truncated");

    // Well-formed files whose contents do not fit the VM they describe.
    let edited = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut v: serde_json::Value = burrow_vmm::snapshot::format::decode(&good).unwrap();
        edit(&mut v);
        burrow_vmm::snapshot::format::encode(&v).unwrap()
    };
    with_state(&edited(&|v| v["vcpu_count"] = 2.into()), &mem);
    assert_refused(&bad, &d, &[], "1 vCPU states for 2 vCPUs");
    with_state(&edited(&|v| v["mem_mib"] = 64.into()), &mem);
    assert_refused(&bad, &d, &[], "memory regions do not match");
    with_state(&edited(&|v| v["vcpus"][0]["regs"] = serde_json::json!([0, 255])), &mem);
    assert_refused(&bad, &d, &[], "kvm_regs is 144 bytes, state has 2");
    // kvm_msr_entry's bytes: index (little endian), reserved, data.
    let msr = |v: &mut serde_json::Value| {
        let mut bytes = vec![0u8; 16];
        bytes[..4].copy_from_slice(&0x1234_5678u32.to_le_bytes());
        v["vcpus"][0]["msrs"][0] = serde_json::json!(bytes);
    };
    with_state(&edited(&msr), &mem);
    assert_refused(&bad, &d, &[], "MSR 0x12345678 is not one KVM lists");
    with_state(&edited(&|v| v["devices"][0]["queues"][0]["max_size"] = 1024.into()), &mem);
    assert_refused_late(&bad, &d, "max size 1024 but the device offers 256");

    // An untrusted snapshot (--self-contained) may not name a base
    // snapshot: refused before that directory is read.
    let elsewhere = d.join("elsewhere");
    with_state(
        &edited(&|v| {
            v["memory"]["kind"] = serde_json::json!({
                "kind": "incremental", "base_dir": elsewhere, "base_id": 1, "runs": []
            })
        }),
        &[],
    );
    assert_refused(&bad, &d, &["--self-contained"], "names a base snapshot");
    // Its size must be the one the caller checked.
    with_state(&good, &mem);
    assert_refused(&bad, &d, &["--expect-mem", "64"], "the state has 32 MiB of memory, the checkpoint says 64 MiB");
    assert_refused(&bad, &d, &["--expect-vcpus", "2"], "the state has 1 vCPUs");

    // Untouched, the copy restores (the checks above refused for their reason only).
    with_state(&good, &mem);
    let mut vm = spawn(
        &["--restore", bad.to_str().unwrap(), "--paused", "--self-contained", "--expect-mem", "32", "--expect-vcpus", "1"],
        &d.join("api1"),
        &d.join("log1"),
    );
    assert_eq!(vm.request("{\"cmd\":\"status\"}")["state"], "created");
    vm.stop();
}

impl Vm {
    /// Snapshot into `dir` the way the shim does for a jailed VMM: this
    /// process makes the directory and two empty files and passes them
    /// (memory, state) with the request.
    fn snapshot_into_files(&mut self, dir: &Path) -> serde_json::Value {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        use vmm_sys_util::sock_ctrl_msg::ScmSocket;
        std::fs::DirBuilder::new().mode(0o700).create(dir).unwrap();
        let new = |name: &str| std::fs::File::options().read(true).write(true).create_new(true).mode(0o600).open(dir.join(name)).unwrap();
        let (memory, state) = (new("memory"), new("state"));
        let line = format!("{{\"cmd\":\"snapshot\",\"dir\":{}}}\n", serde_json::to_string(dir.to_str().unwrap()).unwrap());
        self.api.get_ref().send_with_fds(&[line.as_bytes()], &[memory.as_raw_fd(), state.as_raw_fd()]).unwrap();
        loop {
            let mut l = String::new();
            assert!(self.api.read_line(&mut l).unwrap() > 0, "API closed while waiting for the snapshot");
            if l.starts_with("{\"ok\"") {
                return serde_json::from_str(&l).unwrap();
            }
        }
    }

    fn uid(&self) -> String {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        status.lines().find_map(|l| l.strip_prefix("Uid:")).unwrap_or_default().trim().to_string()
    }
}

/// A jailed VMM sees no snapshot directory: it writes a snapshot into the
/// files its controller passes over the API socket (as the shim does), and
/// a jailed VMM restores from them. A snapshot by path to a host directory
/// outside its jail fails: that path does not exist in its root.
#[test]
fn a_jailed_vmm_snapshots_into_passed_files_and_restores_jailed() {
    let d = tmpdir("jailed");
    let k = kernel(&d, COUNTER);
    let snap = d.join("snap");
    let jail = ["--jail", "--jail-uid", "64123", "--jail-gid", "64123"];
    let mut args = vec!["--kernel", k.to_str().unwrap(), "--mem", "32"];
    args.extend(jail);
    let mut vm = spawn(&args, &d.join("api0"), &d.join("log0"));
    // The guest runs once the jail is entered.
    vm.wait_log("3 counter lines", |l| lines(l) >= 3);
    assert_eq!(vm.uid(), "64123\t64123\t64123\t64123", "the VMM runs as the jail's uid");

    let outside = PathBuf::from(format!("/var/tmp/burrow-jail-test-{}", std::process::id()));
    let r = vm.request(&format!("{{\"cmd\":\"snapshot\",\"dir\":{}}}", serde_json::to_string(outside.to_str().unwrap()).unwrap()));
    assert_eq!(r["ok"], false, "a jailed VMM cannot reach {}: {r}", outside.display());
    assert!(!outside.exists(), "nothing was written on the host");
    let r = vm.request("{\"cmd\":\"resume\"}");
    assert_eq!(r["ok"], true, "{r}");

    let r = vm.snapshot_into_files(&snap);
    assert_eq!(r["ok"], true, "snapshot into passed files: {r}");
    assert_eq!(r["snapshot"]["dir"], snap.to_str().unwrap(), "{r}");
    assert_eq!(std::fs::metadata(snap.join("memory")).unwrap().len(), 32 << 20);
    assert!(std::fs::metadata(snap.join("state")).unwrap().len() > 0);
    vm.stop();
    let original = std::fs::read_to_string(d.join("log0")).unwrap();

    let mut args = vec!["--restore", snap.to_str().unwrap()];
    args.extend(jail);
    let mut vm = spawn(&args, &d.join("api1"), &d.join("log1"));
    vm.wait_log("3 more counter lines", |l| lines(l) >= 3);
    assert_eq!(vm.uid(), "64123\t64123\t64123\t64123");
    vm.stop();
    let after = std::fs::read_to_string(d.join("log1")).unwrap();
    let values = counter_values(&format!("{original}{after}"));
    assert!(values.len() >= counter_values(&original).len() + 3);
    assert_continuous(&values, "jailed restore: before + after");
}

/// A VM with `--mem-max` (its virtio-mem region unplugged: a tiny guest
/// has no driver) snapshots, restores with its requested size, and takes
/// an incremental snapshot after the restore; its memory file covers RAM
/// and the region but stores nothing of the unplugged region. A state
/// whose virtio-mem part is tampered with is refused.
#[test]
fn a_vm_with_hotplug_memory_snapshots_and_restores() {
    let d = tmpdir("hotplug");
    let k = kernel(&d, COUNTER);
    let (snap, inc) = (d.join("snap"), d.join("inc"));
    let mut vm = spawn(&["--kernel", k.to_str().unwrap(), "--mem", "32", "--mem-max", "288"], &d.join("api0"), &d.join("log0"));
    let r = vm.request(r#"{"cmd":"resize_memory","mib":160}"#);
    assert_eq!(r["ok"], true, "{r}");
    vm.wait_log("3 counter lines", |l| lines(l) >= 3);
    let info = vm.snapshot(&snap, false);
    assert_eq!(info["memory_bytes"], (32u64 + 256) << 20, "RAM and the region: {info}");
    let used = std::fs::metadata(snap.join("memory")).map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512).unwrap();
    assert!(used < 1 << 20, "the unplugged region is a hole: {used} bytes allocated");
    vm.stop();
    let original = std::fs::read_to_string(d.join("log0")).unwrap();

    let mut vm = spawn(&["--restore", snap.to_str().unwrap()], &d.join("api1"), &d.join("log1"));
    let m = vm.request(r#"{"cmd":"status"}"#)["memory"].clone();
    assert_eq!(m, serde_json::json!({"base_mib": 32, "max_mib": 288, "requested_mib": 160, "plugged_mib": 32}));
    vm.wait_log("3 more counter lines", |l| lines(l) >= 3);
    let info = vm.snapshot(&inc, true);
    assert!(info["memory_pages"].as_u64().unwrap() < 64, "{info}");
    vm.stop();
    let after = std::fs::read_to_string(d.join("log1")).unwrap();
    assert_continuous(&counter_values(&format!("{original}{after}")), "restored VM with hotplug memory");
    let mut vm = spawn(&["--restore", inc.to_str().unwrap()], &d.join("api2"), &d.join("log2"));
    assert_eq!(vm.request(r#"{"cmd":"status"}"#)["memory"]["requested_mib"], 160);
    vm.stop();

    // An untrusted restore checking sizes must name the same --mem-max.
    assert_refused(&snap, &d, &["--expect-mem", "32"], "may grow to Some(288) MiB");
    assert_refused(&snap, &d, &["--expect-mem", "32", "--expect-mem-max", "1024"], "may grow to Some(288) MiB");
    let vm = spawn(&["--restore", snap.to_str().unwrap(), "--paused", "--expect-mem", "32", "--expect-mem-max", "288"], &d.join("api3"), &d.join("log3"));
    vm.stop();

    // Tampered states: refused before anything is built.
    let good = std::fs::read(snap.join("state")).unwrap();
    let mem = std::fs::File::open(snap.join("memory")).unwrap();
    let bad = d.join("bad");
    std::fs::create_dir_all(&bad).unwrap();
    let edited = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut v: serde_json::Value = burrow_vmm::snapshot::format::decode(&good).unwrap();
        edit(&mut v);
        std::fs::write(bad.join("state"), burrow_vmm::snapshot::format::encode(&v).unwrap()).unwrap();
        let m = std::fs::File::create(bad.join("memory")).unwrap();
        m.set_len(mem.metadata().unwrap().len()).unwrap();
    };
    let mem_dev = |v: &mut serde_json::Value| -> usize {
        v["devices"].as_array().unwrap().iter().position(|d| d["device"].get("mem").is_some()).unwrap()
    };
    edited(&|v| {
        let i = mem_dev(v);
        v["devices"][i]["device"]["mem"]["plugged_size"] = (2u64 << 20).into();
    });
    assert_refused(&bad, &d, &[], "does not match the 0 blocks");
    edited(&|v| {
        let i = mem_dev(v);
        v["devices"][i]["device"]["mem"]["bitmap"] = serde_json::json!([0]);
    });
    assert_refused(&bad, &d, &[], "bitmap has 1 words");
    edited(&|v| {
        let i = mem_dev(v);
        v["devices"][i]["device"]["mem"]["addr"] = (8u64 << 30).into();
    });
    assert_refused(&bad, &d, &[], "is not the VM's hotplug region");
    edited(&|v| {
        let i = mem_dev(v);
        v["devices"][i]["device"]["mem"]["requested_size"] = (1u64 << 30).into();
    });
    assert_refused(&bad, &d, &[], "requested size");
    edited(&|v| v["mem_max_mib"] = serde_json::Value::Null);
    assert_refused(&bad, &d, &[], "memory regions do not match");
    edited(&|v| v["mem_max_mib"] = 16.into());
    assert_refused(&bad, &d, &[], "does not fit 32 MiB");
}
