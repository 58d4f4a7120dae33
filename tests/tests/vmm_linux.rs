//! burrow-vmm booting the real guest kernel with the VMM test initramfs
//! (vmm/tests/initramfs/build). Run inside hack/testhost (or on a host with
//! hardware KVM); each test boots one VM, one at a time.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use burrow_tests::KillOnDrop;

/// Guest code runs 10-20x slower in the nested test host.
const BOOT_TIMEOUT: Duration = Duration::from_secs(400);
/// One VM at a time: the test host has few CPUs.
static ONE_VM: Mutex<()> = Mutex::new(());

struct Vm {
    child: KillOnDrop,
    dir: PathBuf,
    serial: PathBuf,
}

fn start(name: &str, test: &str, extra: &[&str]) -> Vm {
    burrow_tests::require_hardware_kvm();
    let kernel = burrow_tests::asset_from_env("BURROW_GUEST_KERNEL", "guest-kernel/build");
    let initrd =
        burrow_tests::asset_from_env("BURROW_VMM_TEST_INITRD", "vmm/tests/initramfs/build");
    let dir = burrow_tests::scratch_dir(&format!("vmm-linux-{name}"));
    let serial = dir.join("serial.log");
    let child = Command::new(burrow_tests::workspace_bin("burrow-vmm"))
        .arg("run")
        .arg("--kernel")
        .arg(&kernel)
        .arg("--initrd")
        .arg(&initrd)
        .args(["--append", &format!("burrow.test={test}"), "--mem", "256"])
        .arg("--serial-log")
        .arg(&serial)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("stderr")).unwrap())
        .spawn()
        .expect("burrow-vmm starts");
    Vm {
        child: KillOnDrop(child),
        dir,
        serial,
    }
}

impl Vm {
    fn serial_text(&self) -> String {
        std::fs::read_to_string(&self.serial).unwrap_or_default()
    }

    fn diagnostics(&self) -> String {
        let stderr = std::fs::read_to_string(self.dir.join("stderr")).unwrap_or_default();
        burrow_tests::vm_diagnostics("serial", &self.serial_text(), &stderr)
    }

    fn wait_for_serial(&mut self, marker: &str) {
        let start = Instant::now();
        while !self.serial_text().contains(marker) {
            if let Some(st) = self.child.try_wait().unwrap() {
                panic!(
                    "burrow-vmm exited ({st}) before {marker:?}\n{}",
                    self.diagnostics()
                );
            }
            assert!(
                start.elapsed() < BOOT_TIMEOUT,
                "no {marker:?} in {BOOT_TIMEOUT:?}\n{}",
                self.diagnostics()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn wait_exit(&mut self) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(st) = self.child.try_wait().unwrap() {
                return st;
            }
            assert!(
                start.elapsed() < BOOT_TIMEOUT,
                "burrow-vmm did not exit\n{}",
                self.diagnostics()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

/// CPU time (user + system, in clock ticks) the process has used so far.
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command name (which may hold spaces) start at ") ".
    let rest = &stat[stat.rfind(") ").unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat(5): 12 and 13 here.
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
}

/// A guest that halts every CPU (`poweroff` without ACPI) costs the VMM no
/// CPU while it sits there (nothing in the VMM polls or ticks), and the
/// control API still stops it.
#[test]
fn halted_guest_costs_no_cpu_and_api_stop_ends_it() {
    let _one = ONE_VM.lock().unwrap_or_else(|p| p.into_inner());
    let dir = burrow_tests::scratch_dir("vmm-linux-halt-api");
    let api = dir.join("api.sock");
    let mut vm = start(
        "halt",
        "halt",
        &["--vcpus", "2", "--api", api.to_str().unwrap()],
    );
    vm.wait_for_serial("BURROW-VMM-TEST: booted cpus=2 test=halt");
    // Let the guest reach its halt, then measure.
    let pid = vm.child.0.id();
    let mut settled = cpu_ticks(pid);
    for _ in 0..30 {
        std::thread::sleep(Duration::from_secs(1));
        let now = cpu_ticks(pid);
        if now == settled {
            break;
        }
        settled = now;
    }
    std::thread::sleep(Duration::from_secs(5));
    let used = cpu_ticks(pid) - settled;
    assert!(
        vm.child.try_wait().unwrap().is_none(),
        "the VMM exited\n{}",
        vm.diagnostics()
    );
    // One tick is 10 ms: a 200 ms poll alone would cost several over 5 s
    // in the test host.
    assert!(
        used <= 1,
        "the halted VM used {used} ticks of CPU in 5 s\n{}",
        vm.diagnostics()
    );

    let c = UnixStream::connect(&api).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut c = BufReader::new(c);
    c.get_mut().write_all(b"{\"cmd\":\"stop\"}\n").unwrap();
    let mut rest = String::new();
    let _ = c.read_to_string(&mut rest);
    assert!(rest.contains("\"event\":\"exit\""), "{rest}");
    assert_eq!(vm.wait_exit().code(), Some(0), "{}", vm.diagnostics());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A guest reboot ends the VMM with 0. Before it, the guest says which
/// timers it runs on: the TSC-deadline local APIC timer and kvm-clock,
/// with the PIT never used (no IRQ 0 at all). A guest that calibrates
/// against the PIT or ticks on it costs boot time and, in the nested test
/// host, drove the in-kernel PIT worker its freezes were seen in.
#[test]
fn reboot_exits_0_and_the_guest_needs_no_pit() {
    let _one = ONE_VM.lock().unwrap_or_else(|p| p.into_inner());
    let mut vm = start("reboot", "reboot", &["--append", "quiet"]);
    vm.wait_for_serial("BURROW-VMM-TEST: booted");
    let st = vm.wait_exit();
    assert_eq!(st.code(), Some(0), "{}", vm.diagnostics());
    let text = vm.serial_text();
    assert!(vm.diagnostics().contains("guest rebooted"));
    assert!(
        text.contains("BURROW-VMM-TEST: timers clockevent=lapic-deadline clocksource=kvm-clock irq0=none"),
        "the guest's timers are not the TSC-deadline APIC timer and kvm-clock without the PIT\n{}",
        vm.diagnostics()
    );
}

#[test]
fn block_write_read_back_and_read_only() {
    let _one = ONE_VM.lock().unwrap_or_else(|p| p.into_inner());
    let dir = burrow_tests::scratch_dir("vmm-linux-disks");
    let rw = dir.join("rw.img");
    std::fs::File::create(&rw)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let ro = dir.join("ro.img");
    let mut img = b"read-only-ok".to_vec();
    img.resize(4096, 0);
    std::fs::write(&ro, &img).unwrap();
    let rw_arg = rw.display().to_string();
    let ro_arg = format!("{}:ro", ro.display());
    let mut vm = start("block", "block", &["--disk", &rw_arg, "--disk", &ro_arg]);
    let st = vm.wait_exit();
    let serial = vm.serial_text();
    assert_eq!(st.code(), Some(0), "{}", vm.diagnostics());
    assert!(
        serial.contains("BURROW-VMM-TEST: block rw ok"),
        "{}",
        vm.diagnostics()
    );
    assert!(serial.contains("read-only-ok"), "{}", vm.diagnostics());
    assert!(
        serial.contains("BURROW-VMM-TEST: block ro refused"),
        "{}",
        vm.diagnostics()
    );
    // The guest's write reached the host file, and the read-only image is untouched.
    let data = std::fs::read(&rw).unwrap();
    assert!(data[1 << 20..(1 << 20) + 65536].iter().any(|&b| b != 0));
    assert_eq!(std::fs::read(&ro).unwrap(), img);
}

fn read_line(s: &mut BufReader<UnixStream>) -> String {
    let mut l = String::new();
    s.read_line(&mut l).unwrap();
    l
}

#[test]
fn vsock_round_trips_both_ways_and_api_stop() {
    let _one = ONE_VM.lock().unwrap_or_else(|p| p.into_inner());
    let dir = burrow_tests::scratch_dir("vmm-linux-vsock-sockets");
    let uds = dir.join("v.sock");
    let api = dir.join("api.sock");
    // Guest-initiated connections to port 5000 land here.
    let listener = UnixListener::bind(format!("{}_5000", uds.display())).unwrap();
    let guest_side = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        s.set_read_timeout(Some(BOOT_TIMEOUT)).unwrap();
        let mut s = BufReader::new(s);
        let got = read_line(&mut s);
        s.get_mut().write_all(b"reply-from-host\n").unwrap();
        got
    });
    let mut vm = start(
        "vsock",
        "vsock",
        &[
            "--vsock",
            uds.to_str().unwrap(),
            "--api",
            api.to_str().unwrap(),
            "--append",
            "quiet",
        ],
    );
    vm.wait_for_serial("BURROW-VMM-TEST: vsock listening");

    // host -> guest: the guest runs an echo server on port 1024.
    let s = UnixStream::connect(&uds).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut s = BufReader::new(s);
    s.get_mut().write_all(b"CONNECT 1024\n").unwrap();
    let ok = read_line(&mut s);
    assert!(
        ok.starts_with("OK ") && ok.ends_with('\n'),
        "{ok:?}\n{}",
        vm.diagnostics()
    );
    let big: String = (0..2000).map(|i| format!("{i:05}")).collect();
    s.get_mut()
        .write_all(format!("ping-from-host {big}\n").as_bytes())
        .unwrap();
    assert_eq!(read_line(&mut s), format!("ping-from-host {big}\n"));

    // guest -> host
    assert_eq!(guest_side.join().unwrap(), "hello-from-guest\n");
    vm.wait_for_serial("BURROW-VMM-TEST: host replied: reply-from-host");

    // Stop through the control API: exit status 0, exit event sent.
    let c = UnixStream::connect(&api).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut c = BufReader::new(c);
    c.get_mut().write_all(b"{\"cmd\":\"status\"}\n").unwrap();
    assert!(read_line(&mut c).contains("running"));
    c.get_mut().write_all(b"{\"cmd\":\"stop\"}\n").unwrap();
    let mut rest = String::new();
    let _ = c.read_to_string(&mut rest);
    assert!(rest.contains("\"event\":\"exit\""), "{rest}");
    assert_eq!(vm.wait_exit().code(), Some(0), "{}", vm.diagnostics());
    drop(s);
    let _ = std::fs::remove_dir_all(Path::new(&dir));
}

/// The guest's MemTotal (kB) in the last `memtotal` line on the console.
fn last_memtotal(serial: &str) -> Option<u64> {
    serial
        .lines()
        .filter_map(|l| l.strip_prefix("BURROW-VMM-TEST: memtotal "))
        .filter_map(|v| v.trim().parse().ok())
        .next_back()
}

/// Send one control-API request and return its response (events skipped).
fn api_request(c: &mut BufReader<UnixStream>, line: &str) -> serde_json::Value {
    c.get_mut().write_all(format!("{line}\n").as_bytes()).unwrap();
    loop {
        let l = read_line(c);
        assert!(!l.is_empty(), "API closed while waiting for an answer to {line}");
        if l.starts_with("{\"ok\"") {
            return serde_json::from_str(&l).unwrap();
        }
    }
}

/// `--mem 256 --mem-max 1024`: the guest boots with 256 MiB and a
/// virtio-mem device; `resize_memory` to 768 makes it plug 512 MiB, which
/// `status` reports once plugged, MemTotal grows by that much, and the
/// guest can fill more than it booted with.
#[test]
fn memory_grows_through_virtio_mem() {
    let _one = ONE_VM.lock().unwrap_or_else(|p| p.into_inner());
    let dir = burrow_tests::scratch_dir("vmm-linux-mem-api");
    let api = dir.join("api.sock");
    let mut vm = start("mem", "memory", &["--mem-max", "1024", "--api", api.to_str().unwrap()]);
    vm.wait_for_serial("BURROW-VMM-TEST: memtotal");
    let before = last_memtotal(&vm.serial_text()).unwrap();
    assert!(before < 256 * 1024, "booted with at most --mem: {before} kB\n{}", vm.diagnostics());

    let c = UnixStream::connect(&api).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut c = BufReader::new(c);
    let status = api_request(&mut c, r#"{"cmd":"status"}"#);
    assert_eq!(
        status["memory"],
        serde_json::json!({"base_mib": 256, "max_mib": 1024, "requested_mib": 256, "plugged_mib": 256}),
        "{status}"
    );
    let r = api_request(&mut c, r#"{"cmd":"resize_memory","mib":2048}"#);
    assert_eq!(r["error"]["kind"], "invalid_request", "{r}");
    let r = api_request(&mut c, r#"{"cmd":"resize_memory","mib":768}"#);
    assert_eq!(r["ok"], true, "{r}");
    assert_eq!(r["memory"]["requested_mib"], 768, "{r}");

    // The guest plugs asynchronously: wait for status to say it is done.
    let start = Instant::now();
    loop {
        let s = api_request(&mut c, r#"{"cmd":"status"}"#);
        if s["memory"]["plugged_mib"] == 768 {
            break;
        }
        assert!(
            start.elapsed() < BOOT_TIMEOUT,
            "the guest never plugged 512 MiB: {s}\n{}",
            vm.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    eprintln!("virtio-mem: 512 MiB plugged {:?} after resize_memory", start.elapsed());
    let grown = loop {
        let now = last_memtotal(&vm.serial_text()).unwrap_or(0);
        if now >= before + 500 * 1024 {
            break now;
        }
        assert!(start.elapsed() < BOOT_TIMEOUT, "MemTotal stayed {now} kB\n{}", vm.diagnostics());
        std::thread::sleep(Duration::from_millis(500));
    };
    assert!(
        (before + 500 * 1024..=before + 520 * 1024).contains(&grown),
        "MemTotal grew from {before} to {grown} kB, expected about 512 MiB more\n{}",
        vm.diagnostics()
    );
    vm.wait_for_serial("BURROW-VMM-TEST: fill check");
    assert!(
        vm.serial_text().contains("BURROW-VMM-TEST: filled 400 MiB"),
        "{}",
        vm.diagnostics()
    );
    assert!(vm.serial_text().contains("BURROW-VMM-TEST: fill check bad=0"), "{}", vm.diagnostics());

    c.get_mut().write_all(b"{\"cmd\":\"stop\"}\n").unwrap();
    let mut rest = String::new();
    let _ = c.read_to_string(&mut rest);
    assert_eq!(vm.wait_exit().code(), Some(0), "{}", vm.diagnostics());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A guest that plugged memory (and filled it) is snapshotted and
/// restored: the restored VM reports the same plugged size, its guest
/// goes on with the grown MemTotal, and the memory file holds the plugged
/// blocks but not the rest of the hotplug region.
#[test]
fn plugged_memory_survives_a_snapshot() {
    let _one = ONE_VM.lock().unwrap_or_else(|p| p.into_inner());
    let dir = burrow_tests::scratch_dir("vmm-linux-mem-snap");
    let api = dir.join("api.sock");
    let snap = dir.join("snap");
    let mut vm = start("memsnap", "memory", &["--mem-max", "1024", "--api", api.to_str().unwrap()]);
    vm.wait_for_serial("BURROW-VMM-TEST: memtotal");
    let c = UnixStream::connect(&api).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut c = BufReader::new(c);
    assert_eq!(api_request(&mut c, r#"{"cmd":"resize_memory","mib":768}"#)["ok"], true);
    vm.wait_for_serial("BURROW-VMM-TEST: fill");
    assert!(vm.serial_text().contains("filled 400 MiB"), "{}", vm.diagnostics());
    let grown = last_memtotal(&vm.serial_text()).unwrap();
    let r = api_request(
        &mut c,
        &format!(r#"{{"cmd":"snapshot","dir":{}}}"#, serde_json::to_string(snap.to_str().unwrap()).unwrap()),
    );
    assert_eq!(r["ok"], true, "{r}");
    let memory_file = std::fs::metadata(snap.join("memory")).unwrap();
    assert_eq!(memory_file.len(), (256 + 768) << 20, "RAM and the whole region: {r}");
    let stored = std::os::unix::fs::MetadataExt::blocks(&memory_file) * 512;
    assert!(stored < 768 << 20, "the unplugged 256 MiB are not stored: {stored} bytes");
    c.get_mut().write_all(b"{\"cmd\":\"stop\"}\n").unwrap();
    let mut rest = String::new();
    let _ = c.read_to_string(&mut rest);
    assert_eq!(vm.wait_exit().code(), Some(0), "{}", vm.diagnostics());

    let serial = dir.join("restored.log");
    let api2 = dir.join("api2.sock");
    let child = Command::new(burrow_tests::workspace_bin("burrow-vmm"))
        .args(["run", "--restore", snap.to_str().unwrap(), "--api", api2.to_str().unwrap()])
        .arg("--serial-log")
        .arg(&serial)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("stderr")).unwrap())
        .spawn()
        .expect("burrow-vmm restores");
    let mut vm = Vm { child: KillOnDrop(child), dir: dir.clone(), serial };
    vm.wait_for_serial("BURROW-VMM-TEST: memtotal");
    assert_eq!(last_memtotal(&vm.serial_text()), Some(grown), "{}", vm.diagnostics());
    let start = Instant::now();
    let c = loop {
        if let Ok(c) = UnixStream::connect(&api2) {
            break c;
        }
        assert!(start.elapsed() < Duration::from_secs(30), "no API socket");
        std::thread::sleep(Duration::from_millis(100));
    };
    c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut c = BufReader::new(c);
    let s = api_request(&mut c, r#"{"cmd":"status"}"#);
    assert_eq!(s["memory"]["plugged_mib"], 768, "{s}");
    assert_eq!(s["memory"]["requested_mib"], 768, "{s}");
    // The guest reads back what it wrote into plugged memory before the
    // snapshot: every byte still the pattern.
    vm.wait_for_serial("BURROW-VMM-TEST: fill check");
    assert!(vm.serial_text().contains("BURROW-VMM-TEST: fill check bad=0"), "{}", vm.diagnostics());
    c.get_mut().write_all(b"{\"cmd\":\"stop\"}\n").unwrap();
    let mut rest = String::new();
    let _ = c.read_to_string(&mut rest);
    assert_eq!(vm.wait_exit().code(), Some(0), "{}", vm.diagnostics());
    let _ = std::fs::remove_dir_all(&dir);
}
