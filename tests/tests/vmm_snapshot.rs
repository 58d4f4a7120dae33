//! burrow-vmm snapshot and restore of a running Linux guest (the guest
//! kernel with the VMM test initramfs in `burrow.test=counter` mode: a
//! counter printed on the console and a vsock echo server). Run inside
//! hack/testhost (or on a host with hardware KVM).
//!
//! Snapshot the running guest, kill the VMM, restore: the counter goes on
//! from where it was (same sequence, no reboot), the vsock listener
//! survives the transport reset, and one snapshot restores three times; an
//! incremental snapshot of a restored guest restores (base + overlay) and
//! continues from its own point.

#![allow(clippy::unwrap_used)] // test helpers outside #[test] fns

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use burrow_tests::KillOnDrop;

/// Guest code runs 10-20x slower in the nested test host.
const TIMEOUT: Duration = Duration::from_secs(400);
const MARK: &str = "BURROW-VMM-TEST: count ";

struct Vm {
    child: KillOnDrop,
    name: String,
    serial: PathBuf,
    stderr: PathBuf,
    api: PathBuf,
}

fn spawn(dir: &Path, name: &str, args: &[&str]) -> Vm {
    let serial = dir.join(format!("{name}.serial"));
    let stderr = dir.join(format!("{name}.stderr"));
    let api = dir.join(format!("{name}.api"));
    let child = Command::new(burrow_tests::workspace_bin("burrow-vmm"))
        .arg("run")
        .args(args)
        .arg("--serial-log")
        .arg(&serial)
        .arg("--api")
        .arg(&api)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).unwrap())
        .spawn()
        .expect("burrow-vmm starts");
    Vm {
        child: KillOnDrop(child),
        name: name.into(),
        serial,
        stderr,
        api,
    }
}

impl Vm {
    fn serial_text(&self) -> String {
        std::fs::read_to_string(&self.serial).unwrap_or_default()
    }

    fn diagnostics(&self) -> String {
        let stderr = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        burrow_tests::vm_diagnostics(&format!("{} serial", self.name), &self.serial_text(), &stderr)
    }

    fn wait_for(&mut self, what: &str, ok: impl Fn(&str) -> bool) {
        let start = Instant::now();
        while !ok(&self.serial_text()) {
            if let Some(st) = self.child.try_wait().unwrap() {
                panic!(
                    "burrow-vmm exited ({st}) before {what}\n{}",
                    self.diagnostics()
                );
            }
            assert!(
                start.elapsed() < TIMEOUT,
                "no {what} in {TIMEOUT:?}\n{}",
                self.diagnostics()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn api(&self) -> BufReader<UnixStream> {
        let start = Instant::now();
        let s = loop {
            match UnixStream::connect(&self.api) {
                Ok(s) => break s,
                Err(e) => {
                    assert!(
                        start.elapsed() < Duration::from_secs(60),
                        "API socket: {e}\n{}",
                        self.diagnostics()
                    );
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        };
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        BufReader::new(s)
    }

    fn request(&self, line: &str) -> serde_json::Value {
        let mut c = self.api();
        c.get_mut()
            .write_all(format!("{line}\n").as_bytes())
            .unwrap();
        loop {
            let mut l = String::new();
            assert!(
                c.read_line(&mut l).unwrap() > 0,
                "API closed\n{}",
                self.diagnostics()
            );
            if l.starts_with("{\"ok\"") {
                return serde_json::from_str(&l).unwrap();
            }
        }
    }

    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

/// Every counter value the console shows, in order.
fn counts(serial: &str) -> Vec<u64> {
    serial
        .split('\n')
        .filter_map(|l| l.split(MARK).nth(1))
        .filter_map(|n| n.trim().parse().ok())
        .collect()
}

fn assert_sequence(values: &[u64], what: &str) {
    for (i, v) in values.iter().enumerate() {
        assert_eq!(*v, i as u64 + 1, "{what}: counter value {i} in {values:?}");
    }
}

/// Connect to guest port 1024 through the hybrid vsock socket and echo a line.
fn vsock_echo(uds: &Path, vm: &Vm) {
    let start = Instant::now();
    loop {
        let s = UnixStream::connect(uds).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        let mut s = BufReader::new(s);
        s.get_mut().write_all(b"CONNECT 1024\n").unwrap();
        let mut ok = String::new();
        let _ = s.read_line(&mut ok);
        if ok.starts_with("OK ") {
            s.get_mut().write_all(b"after-restore\n").unwrap();
            let mut echo = String::new();
            s.read_line(&mut echo).unwrap();
            assert_eq!(echo, "after-restore\n", "{}", vm.diagnostics());
            return;
        }
        assert!(
            start.elapsed() < TIMEOUT,
            "vsock connect after restore: {ok:?}\n{}",
            vm.diagnostics()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn running_guest_continues_after_restore_three_times() {
    burrow_tests::require_hardware_kvm();
    let kernel = burrow_tests::asset_from_env("BURROW_GUEST_KERNEL", "guest-kernel/build");
    let initrd =
        burrow_tests::asset_from_env("BURROW_VMM_TEST_INITRD", "vmm/tests/initramfs/build");
    let dir = burrow_tests::scratch_dir("vmm-snapshot");
    let snap = dir.join("snap");
    let inc = dir.join("inc");
    let mut mid = String::new();
    let uds = dir.join("v.sock");
    let mut vm = spawn(
        &dir,
        "original",
        &[
            "--kernel",
            kernel.to_str().unwrap(),
            "--initrd",
            initrd.to_str().unwrap(),
            "--append",
            "burrow.test=counter quiet",
            "--mem",
            "256",
            "--vsock",
            uds.to_str().unwrap(),
        ],
    );
    vm.wait_for("count 3", |s| counts(s).len() >= 3);
    let r = vm.request(&format!(
        "{{\"cmd\":\"snapshot\",\"dir\":{}}}",
        serde_json::to_string(snap.to_str().unwrap()).unwrap()
    ));
    assert_eq!(r["ok"], true, "{r}\n{}", vm.diagnostics());
    assert_eq!(r["state"], "paused", "{r}");
    eprintln!("snapshot: {}", r["snapshot"]);
    let before = vm.serial_text();
    vm.kill();
    let before_counts = counts(&before);
    assert_sequence(&before_counts, "before the snapshot");
    let last = *before_counts.last().unwrap();

    for round in 1..=3 {
        let uds2 = dir.join(format!("v{round}.sock"));
        let mut vm = spawn(
            &dir,
            &format!("restore{round}"),
            &[
                "--restore",
                snap.to_str().unwrap(),
                "--vsock",
                uds2.to_str().unwrap(),
            ],
        );
        vm.wait_for("3 more counts", |s| counts(s).len() >= 3);
        let after = vm.serial_text();
        assert!(
            !after.contains("BURROW-VMM-TEST: booted"),
            "restore {round} rebooted\n{}",
            vm.diagnostics()
        );
        let all = counts(&format!("{before}{after}"));
        assert_sequence(&all, &format!("restore {round}: before + after"));
        assert!(all.len() as u64 >= last + 3);
        if round == 1 {
            vsock_echo(&uds2, &vm);
            // An incremental snapshot on top of the one restored: only the
            // pages written since (the guest's, and the VMM's own virtio
            // writes from the vsock traffic above).
            let r = vm.request(&format!(
                "{{\"cmd\":\"snapshot\",\"dir\":{},\"incremental\":true}}",
                serde_json::to_string(inc.to_str().unwrap()).unwrap()
            ));
            assert_eq!(r["ok"], true, "{r}\n{}", vm.diagnostics());
            eprintln!("incremental snapshot: {}", r["snapshot"]);
            let pages = r["snapshot"]["memory_pages"].as_u64().unwrap();
            assert!(
                pages > 0 && pages < 256 * 256 / 4,
                "incremental holds a fraction of memory: {r}"
            );
            mid = vm.serial_text();
        }
        let r = vm.request("{\"cmd\":\"stop\"}");
        assert_eq!(r["ok"], true, "{r}");
    }

    // Base + overlay: continues from the incremental snapshot, vsock works.
    let uds4 = dir.join("v4.sock");
    let mut vm = spawn(
        &dir,
        "restore-incremental",
        &[
            "--restore",
            inc.to_str().unwrap(),
            "--vsock",
            uds4.to_str().unwrap(),
        ],
    );
    vm.wait_for("3 more counts", |s| counts(s).len() >= 3);
    let all = counts(&format!("{before}{mid}{}", vm.serial_text()));
    assert_sequence(
        &all,
        "restore from the incremental snapshot: before + round 1 + after",
    );
    vsock_echo(&uds4, &vm);
    let r = vm.request("{\"cmd\":\"stop\"}");
    assert_eq!(r["ok"], true, "{r}");
    let _ = std::fs::remove_dir_all(&dir);
}
