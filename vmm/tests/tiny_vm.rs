//! End-to-end tests of the `burrow-vmm` binary with tiny hand-written
//! guests. They need a /dev/kvm that runs guest code, which includes our
//! PVM development machines (no Linux guest needed).

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use burrow_vmm::devices::virtio::mmio;
use burrow_vmm::probe::tiny_elf;
use burrow_vmm::x86_64::layout::{VIRTIO_MMIO_SIZE, VIRTIO_MMIO_START};

const ENTRY: u64 = 0x10_0000;

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("burrow-tiny-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// 32-bit code: write `text` to COM1.
fn print32(text: &[u8]) -> Vec<u8> {
    let mut c = vec![0x66, 0xba, 0xf8, 0x03]; // mov dx, 0x3f8
    for &b in text {
        c.extend_from_slice(&[0xb0, b, 0xee]); // mov al, b; out dx, al
    }
    c
}

/// 32-bit code: reset the CPU through the i8042.
const RESET: [u8; 4] = [0xb0, 0xfe, 0xe6, 0x64]; // mov al, 0xfe; out 0x64, al

fn kernel(dir: &Path, code: &[u8], pvh: bool) -> PathBuf {
    let k = dir.join("vmlinux");
    std::fs::write(&k, tiny_elf(ENTRY, code, pvh)).unwrap();
    k
}

fn vmm(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_burrow-vmm"));
    c.arg("run").args(args).args(["--mem", "32"]);
    c
}

fn run_with_timeout(mut cmd: Command, timeout: Duration) -> Output {
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    run_with_timeout_child(child, timeout)
}

fn run_with_timeout_child(mut child: std::process::Child, timeout: Duration) -> Output {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > timeout {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!(
                "burrow-vmm did not exit in {timeout:?}; stdout {:?} stderr {:?}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn pvh_guest_prints_and_reboots_with_status_0() {
    let d = tmpdir("reboot");
    let mut code = print32(b"hello from tiny guest\n");
    code.extend_from_slice(&RESET);
    code.push(0xf4);
    let k = kernel(&d, &code, true);
    let out = run_with_timeout(vmm(&["--kernel", k.to_str().unwrap()]), Duration::from_secs(20));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stdout.contains("hello from tiny guest"), "stdout {stdout:?} stderr {stderr:?}");
    assert_eq!(out.status.code(), Some(0), "stderr {stderr:?}");
    assert!(stderr.contains("rebooted"), "{stderr}");
}

#[test]
fn long_mode_guest_without_pvh_note() {
    let d = tmpdir("long");
    // The same port I/O encodes identically in 64-bit mode.
    let mut code = print32(b"long mode\n");
    code.extend_from_slice(&RESET);
    let k = kernel(&d, &code, false);
    let out = run_with_timeout(vmm(&["--kernel", k.to_str().unwrap(), "--vcpus", "2"]), Duration::from_secs(20));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("long mode"), "{stdout:?} {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0));
}

#[test]
fn serial_log_file() {
    let d = tmpdir("log");
    let mut code = print32(b"to the log\n");
    code.extend_from_slice(&RESET);
    let k = kernel(&d, &code, true);
    let log = d.join("serial.log");
    let out = run_with_timeout(
        vmm(&["--kernel", k.to_str().unwrap(), "--serial-log", log.to_str().unwrap()]),
        Duration::from_secs(20),
    );
    assert_eq!(out.status.code(), Some(0));
    assert!(!String::from_utf8_lossy(&out.stdout).contains("to the log"));
    assert_eq!(std::fs::read_to_string(&log).unwrap(), "to the log\n");
}

#[test]
fn triple_fault_is_a_failure() {
    let d = tmpdir("fault");
    // ud2 with an empty IDT: #UD, #DF, then shutdown.
    let k = kernel(&d, &[0x0f, 0x0b], true);
    let out = run_with_timeout(vmm(&["--kernel", k.to_str().unwrap()]), Duration::from_secs(20));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("triple-fault"), "{stderr}");
}

/// Voluntary context switches (wakeups) of `pid`'s main thread, the VMM's
/// event loop.
fn event_loop_wakeups(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("voluntary_ctxt_switches:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// A guest that halts with interrupts off (what `poweroff` does without
/// ACPI) stays until stopped, and meanwhile nothing wakes the VMM's event
/// loop: no tick, no poll. The control API still answers and stops it.
#[test]
fn halted_guest_wakes_nothing_until_stopped() {
    let d = tmpdir("halt");
    let mut code = print32(b"halting\n");
    code.extend_from_slice(&[0xfa, 0xf4, 0xeb, 0xfd]); // cli; hlt; jmp back to hlt
    let k = kernel(&d, &code, true);
    let api = d.join("api.sock");
    let log = d.join("serial.log");
    let mut cmd = vmm(&["--kernel", k.to_str().unwrap(), "--api", api.to_str().unwrap()]);
    cmd.args(["--serial-log", log.to_str().unwrap()]);
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let start = Instant::now();
    while std::fs::read_to_string(&log).unwrap_or_default() != "halting\n" {
        assert!(start.elapsed() < Duration::from_secs(20), "no output from the guest");
        assert!(child.try_wait().unwrap().is_none(), "burrow-vmm exited");
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(300));
    let before = event_loop_wakeups(child.id());
    std::thread::sleep(Duration::from_secs(2));
    let woke = event_loop_wakeups(child.id()) - before;
    assert!(child.try_wait().unwrap().is_none(), "a halted guest does not end the VM");
    assert_eq!(woke, 0, "the event loop woke {woke} times in 2 s with a halted guest");

    let mut c = BufReader::new(UnixStream::connect(&api).unwrap());
    c.get_mut().write_all(b"{\"cmd\":\"stop\"}\n").unwrap();
    let mut line = String::new();
    c.read_line(&mut line).unwrap();
    let out = run_with_timeout_child(child, Duration::from_secs(20));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    assert!(stderr.contains("stopped"), "{stderr}");
}

#[test]
fn guest_reads_virtio_mmio_registers() {
    let d = tmpdir("mmio");
    let disk = d.join("disk.img");
    std::fs::write(&disk, vec![0u8; 4096]).unwrap();
    // mov eax, [0xd0000000]; then print its 4 bytes; mov eax, [0xd0000008] (device id) + '0'
    let mut code = vec![0xa1, 0x00, 0x00, 0x00, 0xd0];
    code.extend_from_slice(&[0x66, 0xba, 0xf8, 0x03]); // mov dx, 0x3f8
    for _ in 0..4 {
        code.extend_from_slice(&[0xee, 0xc1, 0xe8, 0x08]); // out dx, al; shr eax, 8
    }
    code.extend_from_slice(&[0xa1, 0x08, 0x00, 0x00, 0xd0]); // mov eax, [0xd0000008]
    code.extend_from_slice(&[0x04, b'0', 0xee]); // add al, '0'; out dx, al
    code.extend_from_slice(&[0xb0, b'\n', 0xee]);
    code.extend_from_slice(&RESET);
    let k = kernel(&d, &code, true);
    let out = run_with_timeout(
        vmm(&["--kernel", k.to_str().unwrap(), "--disk", &format!("{}:ro", disk.display())]),
        Duration::from_secs(20),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(stdout.contains("virt2"), "magic then device id 2 (block): {stdout:?}");
}

#[test]
fn bad_kernel_is_a_build_error() {
    let d = tmpdir("badkernel");
    let k = d.join("vmlinux");
    std::fs::write(&k, b"not an elf").unwrap();
    let out = run_with_timeout(vmm(&["--kernel", k.to_str().unwrap()]), Duration::from_secs(20));
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("kernel"));
}

fn request(s: &mut BufReader<UnixStream>, cmd: &str) -> String {
    s.get_mut().write_all(format!("{{\"cmd\":\"{cmd}\"}}\n").as_bytes()).unwrap();
    loop {
        let mut line = String::new();
        s.read_line(&mut line).unwrap();
        if line.starts_with("{\"ok\"") {
            return line;
        }
    }
}

#[test]
fn control_api_start_pause_resume_stop() {
    let d = tmpdir("api");
    let mut code = print32(b"spinning\n");
    code.extend_from_slice(&[0xeb, 0xfe]); // jmp $
    let k = kernel(&d, &code, true);
    let api = d.join("api.sock");
    let mut cmd = vmm(&["--kernel", k.to_str().unwrap(), "--api", api.to_str().unwrap(), "--paused"]);
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    // Read the console as it comes, so the test can wait for the guest to
    // have run before it stops it (on a loaded host that takes a while).
    let mut console = BufReader::new(child.stdout.take().unwrap());
    let (seen_tx, seen_rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        let mut line = String::new();
        while console.read_line(&mut line).unwrap_or(0) > 0 {
            if line.contains("spinning") {
                let _ = seen_tx.send(());
            }
            all.push_str(&line);
            line.clear();
        }
        all
    });
    let start = Instant::now();
    let stream = loop {
        if let Ok(s) = UnixStream::connect(&api) {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "API socket never appeared");
        std::thread::sleep(Duration::from_millis(20));
    };
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut s = BufReader::new(stream);
    assert!(request(&mut s, "status").contains("created"));
    assert!(request(&mut s, "start").contains("running"));
    assert!(request(&mut s, "pause").contains("paused"));
    assert!(request(&mut s, "status").contains("paused"));
    assert!(request(&mut s, "resume").contains("running"));
    s.get_mut().write_all(b"nonsense\n").unwrap();
    let mut line = String::new();
    loop {
        line.clear();
        s.read_line(&mut line).unwrap();
        if line.contains("\"ok\":false") {
            break;
        }
    }
    seen_rx
        .recv_timeout(Duration::from_secs(30))
        .expect("the resumed guest prints on its console");
    s.get_mut().write_all(b"{\"cmd\":\"stop\"}\n").unwrap();
    let mut saw_exit = false;
    loop {
        line.clear();
        if s.read_line(&mut line).unwrap_or(0) == 0 {
            break;
        }
        if line.contains("\"event\":\"exit\"") && line.contains("stopped") {
            saw_exit = true;
        }
    }
    assert!(saw_exit, "exit event");
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0));
    assert!(reader.join().unwrap().contains("spinning"));
    assert!(!api.exists(), "API socket removed on exit");
}

/// A hostile guest writes its console without end (`rep outsb`) and pokes
/// an address with no device behind it (a VMM log line each, at debug): the serial log stays under its cap (the newest output in
/// `PATH`, the previous in `PATH.1`), the VMM's own log under its cap with
/// one line saying so, and the control API still answers at once.
#[test]
fn a_guest_flooding_its_console_stays_under_the_log_caps() {
    let d = tmpdir("flood");
    let mut code = print32(b"flood\n");
    // l: mov esi, ENTRY; mov ecx, 4096; rep outsb; mov [0xd0000000], eax;
    //    jmp l   (the store hits no device: the VMM logs it at debug)
    let lp = code.len();
    code.extend_from_slice(&[0xbe, 0x00, 0x00, 0x10, 0x00]);
    code.extend_from_slice(&[0xb9, 0x00, 0x10, 0x00, 0x00]);
    code.extend_from_slice(&[0xf3, 0x6e]);
    code.extend_from_slice(&[0xa3, 0x00, 0x00, 0x00, 0xd0]);
    let back = lp as i64 - (code.len() as i64 + 2);
    code.extend_from_slice(&[0xeb, back as i8 as u8]);
    let k = kernel(&d, &code, true);
    let log = d.join("serial.log");
    let rotated = d.join("serial.log.1");
    let api = d.join("api.sock");
    const CAP: u64 = 64 << 10;
    const LOG_CAP: u64 = 4096;
    let child = vmm(&[
        "--kernel",
        k.to_str().unwrap(),
        "--serial-log",
        log.to_str().unwrap(),
        "--serial-log-max",
        &CAP.to_string(),
        "--log-max",
        &LOG_CAP.to_string(),
        "--api",
        api.to_str().unwrap(),
    ])
    .env("RUST_LOG", "trace")
    .stdout(Stdio::null())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // Wait until the guest has written several caps' worth: the log has
    // been rotated and refilled.
    let start = Instant::now();
    let mut rotations = 0;
    let mut last_len = 0;
    while rotations < 5 {
        let len = std::fs::metadata(&log).map(|m| m.len()).unwrap_or(0);
        if len < last_len {
            rotations += 1;
        }
        last_len = len;
        assert!(len <= CAP, "serial log at {len} bytes, over its cap {CAP}");
        assert!(start.elapsed() < Duration::from_secs(60), "the guest wrote too little in 60 s ({rotations} rotations)");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(std::fs::metadata(&rotated).unwrap().len() <= CAP);
    let stream = UnixStream::connect(&api).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut s = BufReader::new(stream);
    let asked = Instant::now();
    assert!(request(&mut s, "status").contains("running"));
    assert!(asked.elapsed() < Duration::from_secs(1), "status took {:?} under the flood", asked.elapsed());
    s.get_mut().write_all(b"{\"cmd\":\"stop\"}\n").unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("log reached its cap of 4096 bytes"), "{stderr}");
    // The cap, the line saying so, and the exit line at most.
    assert!(stderr.len() < LOG_CAP as usize + 400, "{} bytes of VMM log", stderr.len());
    let names: Vec<_> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names.len(), 3, "vmlinux, serial.log and serial.log.1 only: {names:?}");
}

/// With `--exit-with-parent` (the shim always passes it), a VMM whose
/// parent dies stops at once: a crashed shim leaves no VM running. Without
/// it, a VMM outlives its parent (a control run, so the check can fail).
#[test]
fn the_vm_ends_with_its_parent_when_asked() {
    let d = tmpdir("parent");
    let mut code = print32(b"spinning\n");
    code.extend_from_slice(&[0xeb, 0xfe]); // jmp $
    let k = kernel(&d, &code, true);
    let vmm_bin = env!("CARGO_BIN_EXE_burrow-vmm");
    let alive = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit(')').next().map(|r| !r.trim_start().starts_with('Z')))
            .unwrap_or(false)
    };
    for with_flag in [true, false] {
        let flag = if with_flag { "--exit-with-parent" } else { "" };
        // The VMM's parent is this sh, which becomes `sleep 2` and exits.
        let script = format!(
            "{vmm_bin} run --kernel {} --mem 32 {flag} >/dev/null 2>{}/stderr & echo $!; exec sleep 2",
            k.display(),
            d.display()
        );
        let out = Command::new("sh").args(["-c", &script]).output().unwrap();
        let pid: u32 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
        let start = Instant::now();
        while alive(pid) && start.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(50));
        }
        let stderr = std::fs::read_to_string(d.join("stderr")).unwrap_or_default();
        if with_flag {
            assert!(!alive(pid), "the VMM still runs {:?} after its parent exited", start.elapsed());
            assert!(stderr.contains("exited; stopping the VM"), "{stderr}");
        } else {
            assert!(alive(pid), "without the flag the VMM should outlive its parent: {stderr}");
            // SAFETY: kill has no memory-safety preconditions.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
    }
}

/// A guest spins on slot 0's capacity (config space, low 32 bits) until
/// the host attaches a file through the control API, then prints it.
#[test]
fn block_slot_attached_through_the_api_shows_its_capacity() {
    let d = tmpdir("slots");
    let disk = d.join("c1.img");
    std::fs::write(&disk, vec![0u8; 8 * 512]).unwrap();
    // l: mov eax, [0xd0000100]; test eax, eax; jz l
    let mut code = vec![0xa1, 0x00, 0x01, 0x00, 0xd0, 0x85, 0xc0, 0x74, 0xf7];
    code.extend_from_slice(&[0x66, 0xba, 0xf8, 0x03]); // mov dx, 0x3f8
    code.extend_from_slice(&[0x04, b'0', 0xee, 0xb0, b'\n', 0xee]); // add al, '0'; out; '\n'
    code.extend_from_slice(&RESET);
    let k = kernel(&d, &code, true);
    let api = d.join("api.sock");
    let mut cmd = vmm(&[
        "--kernel",
        k.to_str().unwrap(),
        "--disk-slots",
        "2",
        "--api",
        api.to_str().unwrap(),
    ]);
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let stream = loop {
        if let Ok(s) = UnixStream::connect(&api) {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "API socket never appeared"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut s = BufReader::new(stream);
    let mut send = |line: String| {
        s.get_mut()
            .write_all(format!("{line}\n").as_bytes())
            .unwrap();
        loop {
            let mut reply = String::new();
            s.read_line(&mut reply).unwrap();
            if reply.starts_with("{\"ok\"") {
                return reply;
            }
        }
    };
    let attach = |slot: u32, path: &Path| {
        format!(
            "{{\"cmd\":\"attach_disk\",\"slot\":{slot},\"path\":{:?}}}",
            path.display().to_string()
        )
    };
    let r = send(attach(2, &disk));
    assert!(
        r.contains("not_found") && r.contains("no block slot 2"),
        "{r}"
    );
    let r = send(attach(0, &d.join("missing.img")));
    assert!(r.contains("\"ok\":false") && r.contains("not_found"), "{r}");
    let r = send(attach(0, &disk));
    assert!(r.contains("\"ok\":true"), "{r}");
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("8\n"),
        "the guest saw 8 sectors: {stdout:?}"
    );
}

/// 32-bit guest code (flat segments, no paging: the PVH entry) that drives
/// virtio-mmio registers with plain stores.
#[derive(Default)]
struct Code(Vec<u8>);

impl Code {
    /// `mov dword [addr], v`.
    fn store(&mut self, addr: u64, v: u32) {
        self.0.extend_from_slice(&[0xc7, 0x05]);
        self.0
            .extend_from_slice(&u32::try_from(addr).unwrap().to_le_bytes());
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    /// `mov word [addr], v`.
    fn store16(&mut self, addr: u64, v: u16) {
        self.0.extend_from_slice(&[0x66, 0xc7, 0x05]);
        self.0
            .extend_from_slice(&u32::try_from(addr).unwrap().to_le_bytes());
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    /// `mov byte [addr], v`.
    fn store8(&mut self, addr: u64, v: u8) {
        self.0.extend_from_slice(&[0xc6, 0x05]);
        self.0
            .extend_from_slice(&u32::try_from(addr).unwrap().to_le_bytes());
        self.0.push(v);
    }

    /// `jmp target` (an offset into this code).
    fn jmp(&mut self, target: usize) {
        let rel = target as i64 - (self.0.len() as i64 + 5);
        self.0.push(0xe9);
        self.0
            .extend_from_slice(&i32::try_from(rel).unwrap().to_le_bytes());
    }
}

/// A driver that writes garbage: what the guest of
/// `a_guest_writing_garbage_to_every_queue_notify_stays_contained` does to
/// one virtio-mmio device at `base` with `queues` queues, its rings in
/// guest memory at `rings` (0x1000 per queue).
struct Garbage<'a> {
    c: &'a mut Code,
    base: u64,
    queues: u32,
    rings: u64,
}

const VIRTQ_DESC_F_NEXT: u32 = 1;
const VIRTQ_DESC_F_WRITE: u32 = 2;
/// Entries of every queue the garbage driver sets up.
const GARBAGE_QUEUE_SIZE: u32 = 8;

impl Garbage<'_> {
    fn reg(&mut self, offset: u64, v: u32) {
        self.c.store(self.base + offset, v);
    }

    fn ring(&self, q: u32) -> (u64, u64, u64, u64) {
        let r = self.rings + u64::from(q) * 0x1000;
        // descriptors, avail ring, used ring, a data buffer
        (r, r + 0x100, r + 0x200, r + 0x800)
    }

    /// Descriptor `i` of queue `q`.
    fn desc(&mut self, q: u32, i: u32, addr: u64, len: u32, flags: u32, next: u32) {
        let d = self.ring(q).0 + 16 * u64::from(i);
        self.c.store(d, addr as u32);
        self.c.store(d + 4, (addr >> 32) as u32);
        self.c.store(d + 8, len);
        self.c.store(d + 12, flags | next << 16);
    }

    /// Publish `idx` as the avail index with `head` in the first slot.
    fn avail(&mut self, q: u32, idx: u16, head: u16) {
        let a = self.ring(q).1;
        self.c.store(a, u32::from(idx) << 16);
        self.c.store(a + 4, u32::from(head));
    }

    /// QueueNotify with every kind of index: the device's own queues
    /// (through KVM's ioeventfds), indexes past them, huge ones, and
    /// 1- and 2-byte writes.
    fn notify_everything(&mut self) {
        for v in [0, 1, 2, 3, 7, 0x100, 0xffff, 0xffff_ffff] {
            self.reg(mmio::REG_QUEUE_NOTIFY, v);
        }
        self.c.store16(self.base + mmio::REG_QUEUE_NOTIFY, 0);
        self.c.store8(self.base + mmio::REG_QUEUE_NOTIFY, 1);
    }

    /// Reset, then the feature handshake up to FEATURES_OK.
    fn handshake(&mut self) {
        self.reg(mmio::REG_STATUS, 0);
        self.reg(mmio::REG_STATUS, mmio::STATUS_ACKNOWLEDGE);
        self.reg(
            mmio::REG_STATUS,
            mmio::STATUS_ACKNOWLEDGE | mmio::STATUS_DRIVER,
        );
        self.reg(mmio::REG_DRIVER_FEATURES_SEL, 1);
        self.reg(mmio::REG_DRIVER_FEATURES, 1); // VIRTIO_F_VERSION_1
        self.reg(mmio::REG_DRIVER_FEATURES_SEL, 0);
        self.reg(mmio::REG_DRIVER_FEATURES, 0);
        self.reg(
            mmio::REG_STATUS,
            mmio::STATUS_ACKNOWLEDGE | mmio::STATUS_DRIVER | mmio::STATUS_FEATURES_OK,
        );
    }

    fn queue(&mut self, q: u32, desc: u64, avail: u64, used: u64, ready: bool) {
        self.reg(mmio::REG_QUEUE_SEL, q);
        self.reg(mmio::REG_QUEUE_NUM, GARBAGE_QUEUE_SIZE);
        for (low, addr) in [
            (mmio::REG_QUEUE_DESC_LOW, desc),
            (mmio::REG_QUEUE_AVAIL_LOW, avail),
            (mmio::REG_QUEUE_USED_LOW, used),
        ] {
            self.reg(low, addr as u32);
            self.reg(low + 4, (addr >> 32) as u32);
        }
        if ready {
            self.reg(mmio::REG_QUEUE_READY, 1);
        }
    }

    /// Queue `q` at its rings in guest memory, ready.
    fn good_queue(&mut self, q: u32) {
        let (d, a, u, _) = self.ring(q);
        self.queue(q, d, a, u, true);
    }

    fn driver_ok(&mut self) {
        self.reg(mmio::REG_STATUS, 0xf);
    }

    /// One round of garbage, each step after a reset and handshake.
    fn round(&mut self) {
        // Notifications before any driver exists.
        self.reg(mmio::REG_STATUS, 0);
        self.notify_everything();

        // A ready queue whose rings lie outside guest memory (past it,
        // in the MMIO hole, on this device's own registers): the device
        // must not activate.
        self.handshake();
        self.queue(0, 0xff_ffff_0000, 0xffff_fff0, self.base, true);
        self.driver_ok();
        self.notify_everything();

        // Every queue ready, each holding a descriptor chain that loops.
        self.handshake();
        for q in 0..self.queues {
            let buf = self.ring(q).3;
            self.desc(q, 0, buf, 16, VIRTQ_DESC_F_NEXT, 1);
            self.desc(q, 1, buf, 16, VIRTQ_DESC_F_NEXT, 0);
            self.avail(q, 1, 0);
            self.good_queue(q);
        }
        self.driver_ok();
        self.notify_everything();

        // Queue 0 posts a head past the end of its table; the others are
        // never set up, and queue 1's rings, not ready, are outside memory.
        self.handshake();
        self.avail(0, 1, 200);
        self.good_queue(0);
        if self.queues > 1 {
            self.queue(1, 0xff_ffff_0000, 0xffff_fff0, self.base, false);
        }
        self.driver_ok();
        self.notify_everything();

        // An avail index far ahead of the device.
        self.handshake();
        self.avail(0, 0x8000, 0);
        self.good_queue(0);
        self.driver_ok();
        self.notify_everything();

        // One descriptor whose buffer lies outside guest memory, both
        // directions in turn.
        for flags in [0, VIRTQ_DESC_F_WRITE] {
            self.handshake();
            self.desc(0, 0, 0xff_ffff_0000, 0xffff_ffff, flags, 0);
            self.avail(0, 1, 0);
            self.good_queue(0);
            self.driver_ok();
            self.notify_everything();
        }
        self.reg(mmio::REG_STATUS, 0);
    }
}

/// Whether this process may make a tap (root with /dev/net/tun): then the
/// garbage test includes a virtio-net device.
fn can_make_tap(name: &str) -> bool {
    #[repr(C)]
    struct IfReq {
        name: [u8; 16],
        flags: libc::c_short,
        _pad: [u8; 22],
    }
    const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
    let Ok(tun) = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")
    else {
        return false;
    };
    let mut req = IfReq {
        name: [0; 16],
        flags: (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short,
        _pad: [0; 22],
    };
    req.name[..name.len()].copy_from_slice(name.as_bytes());
    // SAFETY: TUNSETIFF reads and writes one ifreq, which `req` is; the
    // tap goes away with `tun` (not persistent).
    let rc = unsafe {
        libc::ioctl(
            std::os::fd::AsRawFd::as_raw_fd(&tun),
            TUNSETIFF as _,
            &mut req,
        )
    };
    rc == 0
}

/// A hostile guest loops over every virtio-mmio device the VMM gives it
/// (a disk, two block slots, vsock, and virtio-net where a tap can be
/// made) writing garbage: QueueNotify for queues that do not exist, for
/// queues never set up, 1- and 2-byte notifications, queues whose rings
/// lie outside guest memory, descriptor chains that loop, heads past the
/// table, an avail index far ahead, buffers outside memory. Meanwhile the
/// VMM stays up, the guest keeps running (it prints a dot per round), the
/// control API answers each request within a second, and the VMM's log,
/// which names each kind of thing the guest did wrong, stays under its
/// cap: a repeat is logged with its count, not again.
#[test]
fn a_guest_writing_garbage_to_every_queue_notify_stays_contained() {
    let d = tmpdir("garbage");
    let disk = d.join("disk.img");
    std::fs::write(&disk, vec![0u8; 64 << 10]).unwrap();
    let slot_disk = d.join("slot.img");
    std::fs::write(&slot_disk, vec![0u8; 8 * 512]).unwrap();
    let vsock = d.join("vsock.sock");
    let tap = format!("bwq{}", std::process::id() % 1_000_000);
    let net = can_make_tap(&tap);
    if !net {
        eprintln!("no tap can be made here (not root, or no /dev/net/tun): no virtio-net device in this run");
    }
    // Device order: disks, slots, vsock, net (see Vmm::build).
    let mut queues = vec![1, 1, 1, 3];
    if net {
        queues.push(2);
    }
    let mut code = Code::default();
    code.0.extend(print32(b"garbage\n"));
    let top = code.0.len();
    for (i, &n) in queues.iter().enumerate() {
        Garbage {
            c: &mut code,
            base: VIRTIO_MMIO_START + i as u64 * VIRTIO_MMIO_SIZE,
            queues: n,
            rings: 0x20_0000 + i as u64 * 0x1_0000,
        }
        .round();
    }
    code.0.extend(print32(b"."));
    code.jmp(top);
    let k = kernel(&d, &code.0, true);
    let log = d.join("serial.log");
    let api = d.join("api.sock");
    // A line per kind of fault and per power of ten of its repeats fits
    // in far less than this, however fast the guest loops.
    const LOG_CAP: u64 = 64 << 10;
    let mut args = vec![
        "--kernel".to_string(),
        k.display().to_string(),
        "--disk".into(),
        disk.display().to_string(),
        "--disk-slots".into(),
        "2".into(),
        "--vsock".into(),
        vsock.display().to_string(),
        "--serial-log".into(),
        log.display().to_string(),
        "--log-max".into(),
        LOG_CAP.to_string(),
        "--api".into(),
        api.display().to_string(),
    ];
    if net {
        args.extend(["--net".into(), format!("tap={tap},mac=02:00:00:00:00:01")]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // The VMM's log goes to a file, as the shim has it (a pipe nobody
    // reads would stop it at 64 KiB).
    let vmm_log = d.join("vmm.log");
    let mut child = vmm(&args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&vmm_log).unwrap())
        .spawn()
        .unwrap();
    let rounds = || {
        let text = std::fs::read(&log).unwrap_or_default();
        text.iter().filter(|&&b| b == b'.').count()
    };
    // The host side of vsock asks for a connection: the device has a
    // packet for the guest's receive queue whenever it is notified.
    let start = Instant::now();
    let host_conn = loop {
        if let Ok(mut s) = UnixStream::connect(&vsock) {
            s.write_all(b"CONNECT 1024\n").unwrap();
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "vsock socket never appeared"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let stream = UnixStream::connect(&api).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut s = BufReader::new(stream);
    while rounds() < 3 {
        assert!(child.try_wait().unwrap().is_none(), "burrow-vmm exited");
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the guest finished {} rounds in 60 s",
            rounds()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut send = |line: &str| {
        let asked = Instant::now();
        s.get_mut()
            .write_all(format!("{line}\n").as_bytes())
            .unwrap();
        let reply = loop {
            let mut reply = String::new();
            s.read_line(&mut reply).unwrap();
            if reply.starts_with("{\"ok\"") {
                break reply;
            }
        };
        let took = asked.elapsed();
        assert!(
            took < Duration::from_secs(1),
            "{line} took {took:?} under the garbage"
        );
        reply
    };
    for i in 0..6 {
        let before = rounds();
        let r = send(r#"{"cmd":"status"}"#);
        assert!(r.contains("running"), "{r}");
        if i == 2 {
            let r = send(&format!(
                r#"{{"cmd":"attach_disk","slot":0,"path":{:?}}}"#,
                slot_disk.display().to_string()
            ));
            assert!(r.contains("\"ok\":true"), "{r}");
        }
        let waited = Instant::now();
        while rounds() == before {
            assert!(child.try_wait().unwrap().is_none(), "burrow-vmm exited");
            assert!(
                waited.elapsed() < Duration::from_secs(30),
                "the guest made no progress in 30 s"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // Many more rounds than it would take to fill the log to its cap,
    // were each repeat logged.
    while rounds() < 20 {
        assert!(child.try_wait().unwrap().is_none(), "burrow-vmm exited");
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the guest finished {} rounds in 120 s",
            rounds()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(send(r#"{"cmd":"status"}"#).contains("running"));
    s.get_mut().write_all(b"{\"cmd\":\"stop\"}\n").unwrap();
    drop(host_conn);
    let out = run_with_timeout_child(child, Duration::from_secs(20));
    let stderr = std::fs::read_to_string(&vmm_log).unwrap();
    assert_eq!(out.status.code(), Some(0), "{stderr}");
    // A fault the guest repeats each round is logged once and then with
    // its count at powers of ten, so the flood never fills the log and
    // every kind of fault stays in it.
    assert!(
        stderr.len() < LOG_CAP as usize,
        "{} bytes of VMM log",
        stderr.len()
    );
    assert!(
        !stderr.contains("log reached its cap"),
        "the guest's repeats filled the log:\n{stderr}"
    );
    assert!(!stderr.contains('\x1b'), "colour codes in a log file:\n{stderr}");
    let repeats = stderr
        .lines()
        .filter(|l| l.contains("queue 7 does not exist"))
        .count();
    assert!(
        (1..=3 * queues.len()).contains(&repeats),
        "{repeats} lines of one repeated fault for {} devices:\n{stderr}",
        queues.len()
    );
    assert!(stderr.contains("(seen 10 times)"), "{stderr}");
    // The garbage reached the devices and was refused for what it was.
    for said in [
        "virtio queue 0 is invalid; not activating",
        "malformed request: descriptor chain loops",
        "queue 7 does not exist; device needs reset",
        "descriptor chain is empty or its head is out of range",
        "avail index 32768",
    ] {
        assert!(
            stderr.contains(said),
            "no {said:?} in the VMM's log:\n{stderr}"
        );
    }
}

/// `--mem-max` gives the VM a virtio-mem device (alone here: MMIO window
/// 0): `status` reports its memory, `resize_memory` refuses sizes outside
/// `--mem`..=`--mem-max` or not in 2 MiB steps and sets the requested size
/// in config space, which the guest (spinning on it) sees and prints.
#[test]
fn resize_memory_sets_the_requested_size_the_guest_reads() {
    let d = tmpdir("memresize");
    // l: mov eax, [0xd0000130] (requested_size, low half); test eax, eax; jz l
    let mut code = vec![0xa1, 0x30, 0x01, 0x00, 0xd0, 0x85, 0xc0, 0x74, 0xf7];
    code.extend_from_slice(&print32(b"resized\n"));
    code.extend_from_slice(&RESET);
    let k = kernel(&d, &code, true);
    let api = d.join("api.sock");
    let mut cmd = vmm(&["--kernel", k.to_str().unwrap(), "--mem-max", "288", "--api", api.to_str().unwrap()]);
    let child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let start = Instant::now();
    let stream = loop {
        if let Ok(s) = UnixStream::connect(&api) {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "API socket never appeared");
        std::thread::sleep(Duration::from_millis(20));
    };
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut s = BufReader::new(stream);
    let mut send = |line: &str| {
        s.get_mut().write_all(format!("{line}\n").as_bytes()).unwrap();
        loop {
            let mut reply = String::new();
            s.read_line(&mut reply).unwrap();
            if reply.starts_with("{\"ok\"") {
                return reply;
            }
        }
    };
    let r = send(r#"{"cmd":"status"}"#);
    assert!(
        r.contains(r#""memory":{"base_mib":32,"max_mib":288,"requested_mib":32,"plugged_mib":32}"#),
        "{r}"
    );
    for bad in [16, 289, 33] {
        let r = send(&format!(r#"{{"cmd":"resize_memory","mib":{bad}}}"#));
        assert!(r.contains("invalid_request"), "{bad}: {r}");
    }
    let r = send(r#"{"cmd":"resize_memory","mib":160}"#);
    assert!(r.contains(r#""ok":true"#) && r.contains(r#""requested_mib":160,"plugged_mib":32"#), "{r}");
    let out = run_with_timeout_child(child, Duration::from_secs(20));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("resized"), "{stdout:?} {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0));
}

#[test]
fn resize_memory_without_mem_max_is_unsupported() {
    let d = tmpdir("memnone");
    let mut code = print32(b"x\n");
    code.extend_from_slice(&[0xeb, 0xfe]); // jmp $
    let k = kernel(&d, &code, true);
    let api = d.join("api.sock");
    let mut cmd = vmm(&["--kernel", k.to_str().unwrap(), "--api", api.to_str().unwrap()]);
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let start = Instant::now();
    let stream = loop {
        if let Ok(s) = UnixStream::connect(&api) {
            break s;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "API socket never appeared");
        std::thread::sleep(Duration::from_millis(20));
    };
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut s = BufReader::new(stream);
    s.get_mut().write_all(b"{\"cmd\":\"resize_memory\",\"mib\":64}\n").unwrap();
    let mut line = String::new();
    while !line.starts_with("{\"ok\"") {
        line.clear();
        s.read_line(&mut line).unwrap();
    }
    assert!(line.contains("unsupported"), "{line}");
    assert!(!request(&mut s, "status").contains("memory"));
    request(&mut s, "stop");
    assert_eq!(child.wait().unwrap().code(), Some(0));
}

/// A hostile guest drives the virtio-mem device itself (MMIO window 0)
/// with its virtqueue in the hotplug region, which it never plugged: the
/// VMM must not die of SIGSEGV reading the ring but end the VM with
/// status 1 and a message saying why.
#[test]
fn a_queue_in_unplugged_memory_ends_the_vm_with_a_message() {
    let d = tmpdir("memqueue");
    let mut c = Code::default();
    let mut g = Garbage { c: &mut c, base: 0xd000_0000, queues: 1, rings: 0x1_0000 };
    g.handshake();
    // Rings at 4 GiB: the start of the (unplugged) hotplug region.
    g.queue(0, 1 << 32, (1 << 32) + 0x100, (1 << 32) + 0x200, true);
    g.driver_ok();
    g.reg(mmio::REG_QUEUE_NOTIFY, 0);
    c.0.extend_from_slice(&print32(b"still here\n"));
    c.0.extend_from_slice(&[0xeb, 0xfe]); // jmp $
    let k = kernel(&d, &c.0, true);
    let out = run_with_timeout(
        vmm(&["--kernel", k.to_str().unwrap(), "--mem-max", "160"]),
        Duration::from_secs(20),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "status {:?}, stderr {stderr}", out.status);
    assert!(stderr.contains("has not plugged"), "{stderr}");
}
