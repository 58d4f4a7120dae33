//! Helpers for burrow's tests that need a host able to boot Linux guests.
//!
//! These tests run where hardware virtualization is available: directly on a
//! host with hardware KVM, or inside `hack/testhost` elsewhere. The README's
//! test command routes them there. Run anywhere else, they fail with a message
//! that says why instead of passing by skipping themselves.

pub mod cni;
pub mod containerd;
pub mod cpu_fault;
pub mod cri;
pub mod devmapper;
pub mod dns;
pub mod jailed;
pub mod ps;

/// A burrow-vmm run's serial console (under the header `--- TITLE ---`)
/// and stderr, for failure messages, with the marker line of the test
/// host's CPU fault (`cpu_fault`) when the console shows it.
pub fn vm_diagnostics(title: &str, serial: &str, stderr: &str) -> String {
    let fault = cpu_fault::marker_line(serial, title)
        .map(|f| format!("\n{f}"))
        .unwrap_or_default();
    format!("--- {title} ---\n{serial}\n--- burrow-vmm stderr ---\n{stderr}{fault}")
}

/// A terminal size for TIOCSWINSZ (tests that drive a PTY).
pub fn winsize(rows: u16, cols: u16) -> libc::winsize {
    libc::winsize {
        ws_row: rows,
        ws_col: cols,
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

use std::path::Path;

/// Panic with a clear message unless this host has `/dev/kvm` backed by
/// hardware virtualization (vmx/svm) rather than PVM.
pub fn require_hardware_kvm() {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let has_flag = burrow_vmm::probe::cpu_virt_flag(&cpuinfo).is_some();
    let pvm = Path::new("/sys/module/kvm_pvm").exists();
    let dev = Path::new("/dev/kvm").exists();
    if !(dev && has_flag && !pvm) {
        panic!(
            "this test needs /dev/kvm with hardware virtualization \
             (found: /dev/kvm {dev}, vmx/svm flag {has_flag}, kvm_pvm loaded {pvm}); \
             run it through the README's test command or `hack/testhost -- <test binary>`"
        );
    }
}

/// Path of a binary built from this workspace (`burrow-vmm`, `burrow`, ...),
/// found beside the running test executable in cargo's target directory.
/// Panics with a clear message if it has not been built.
pub fn workspace_bin(name: &str) -> std::path::PathBuf {
    let exe = std::env::current_exe().expect("current test executable");
    // target/<profile>/deps/<test>-<hash> -> target/<profile>/<name>; a
    // binary of this crate (bench-pods) lives in target/<profile> itself.
    let dir = exe.parent().expect("the executable's directory");
    let profile_dir = if dir.ends_with("deps") {
        dir.parent()
            .expect("test executable lives in target/<profile>/deps")
    } else {
        dir
    };
    let bin = profile_dir.join(name);
    assert!(
        bin.is_file(),
        "{} is missing: build the workspace first (`cargo build --workspace`), \
         as the README's test command does",
        bin.display()
    );
    bin
}

/// Path named by environment variable `var`, which the README's test command
/// sets to a built asset (guest kernel, initramfs, ...). Panics with a clear
/// message naming the script that builds it if the variable is unset or the
/// file is missing.
pub fn asset_from_env(var: &str, built_by: &str) -> std::path::PathBuf {
    let path = std::env::var_os(var).unwrap_or_else(|| {
        panic!("{var} is not set: build the asset with `{built_by}` and export its path as {var} (the README's test command does this)")
    });
    let path = std::path::PathBuf::from(path);
    assert!(
        path.exists(),
        "{var}={} does not exist: rebuild it with `{built_by}`",
        path.display()
    );
    path
}

/// A child process (a burrow-vmm) that is killed and reaped when dropped,
/// so a failing test leaves no VM behind.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl std::ops::Deref for KillOnDrop {
    type Target = std::process::Child;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for KillOnDrop {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

/// A fresh, empty scratch directory `<tmp>/burrow-<name>-<pid>` for one
/// test's VM (its sockets, logs and disks).
pub fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("burrow-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the test's scratch directory");
    dir
}

/// Booting burrow-agent as PID 1 in a real VM (burrow-vmm with the guest
/// kernel and the agent initramfs) and talking to it over hybrid vsock.
pub mod agent_vm {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    use std::path::{Path, PathBuf};
    use std::process::{Command, ExitStatus, Stdio};
    use std::time::{Duration, Instant};

    /// A running burrow-vmm; killed when dropped.
    pub struct Vm {
        pub child: crate::KillOnDrop,
        pub dir: PathBuf,
    }

    /// A virtio-blk disk: image path and whether the guest sees it
    /// read-only. The n-th disk is `/dev/vd<a+n>` in the guest.
    pub struct Disk<'a> {
        pub path: &'a Path,
        pub read_only: bool,
    }

    impl Vm {
        /// Serial console and burrow-vmm's stderr, for failure messages.
        pub fn diagnostics(&self) -> String {
            let serial = std::fs::read_to_string(self.dir.join("serial.log")).unwrap_or_default();
            let stderr = std::fs::read_to_string(self.dir.join("stderr")).unwrap_or_default();
            crate::vm_diagnostics("serial", &serial, &stderr)
        }

        /// Wait up to `timeout` for burrow-vmm to exit.
        pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
            let t0 = Instant::now();
            loop {
                if let Some(st) = self.child.try_wait().expect("wait for burrow-vmm") {
                    return st;
                }
                assert!(
                    t0.elapsed() < timeout,
                    "VM did not power off in {timeout:?}\n{}",
                    self.diagnostics()
                );
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }

    /// Boot the guest kernel (`BURROW_GUEST_KERNEL`) with the agent
    /// initramfs (`BURROW_AGENT_INITRD`), `mem_mib` of memory, 2 vCPUs, the
    /// given disks and `append` added to the kernel command line. The
    /// vsock socket, serial log and VMM stderr go to `dir`.
    pub fn boot(dir: &Path, mem_mib: u32, disks: &[Disk<'_>], append: &str) -> Vm {
        boot_with(dir, mem_mib, disks, append, &["--vcpus", "2"])
    }

    /// [`boot`] with `vcpu_args` (`--vcpus N`, `--max-vcpus M`, `--api
    /// PATH`, ...) instead of `--vcpus 2`.
    pub fn boot_with(
        dir: &Path,
        mem_mib: u32,
        disks: &[Disk<'_>],
        append: &str,
        vcpu_args: &[&str],
    ) -> Vm {
        crate::require_hardware_kvm();
        let kernel = crate::asset_from_env("BURROW_GUEST_KERNEL", "guest-kernel/build");
        let initrd = crate::asset_from_env("BURROW_AGENT_INITRD", "rootfs/build");
        let mut cmd = Command::new(crate::workspace_bin("burrow-vmm"));
        cmd.arg("run")
            .arg("--kernel")
            .arg(&kernel)
            .arg("--initrd")
            .arg(&initrd)
            .args([
                "--mem",
                &mem_mib.to_string(),
                "--append",
                append,
                // The nested test host now and then loses a halted vCPU's
                // wakeup; kick them as the VMM's old 200 ms probe did.
                "--vcpu-kick-ms",
                "200",
            ])
            .args(vcpu_args);
        for d in disks {
            let mut arg = d.path.as_os_str().to_owned();
            if d.read_only {
                arg.push(":ro");
            }
            cmd.arg("--disk").arg(arg);
        }
        let child = cmd
            .arg("--vsock")
            .arg(dir.join("vsock"))
            .arg("--serial-log")
            .arg(dir.join("serial.log"))
            .stdout(Stdio::null())
            .stderr(
                std::fs::File::create(dir.join("stderr")).expect("create the VMM's stderr file"),
            )
            .spawn()
            .expect("burrow-vmm starts");
        Vm {
            child: crate::KillOnDrop(child),
            dir: dir.to_path_buf(),
        }
    }

    /// Connect through the VMM's hybrid vsock (`CONNECT <port>\n` →
    /// `OK <n>\n`), retrying until the agent answers or `timeout` passes.
    pub fn connect(vm: &mut Vm, timeout: Duration) -> UnixStream {
        let start = Instant::now();
        loop {
            if let Some(st) = vm.child.try_wait().expect("wait for burrow-vmm") {
                panic!(
                    "burrow-vmm exited ({st}) before the agent answered\n{}",
                    vm.diagnostics()
                );
            }
            assert!(
                start.elapsed() < timeout,
                "agent not reachable in {timeout:?}\n{}",
                vm.diagnostics()
            );
            if let Ok(mut s) = UnixStream::connect(vm.dir.join("vsock")) {
                let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
                let hello = format!("CONNECT {}\n", burrow_protocol::AGENT_VSOCK_PORT);
                if s.write_all(hello.as_bytes()).is_ok() {
                    let mut line = Vec::new();
                    let mut b = [0u8; 1];
                    while line.len() < 64 {
                        match s.read(&mut b) {
                            Ok(1) if b[0] == b'\n' => break,
                            Ok(1) => line.push(b[0]),
                            _ => break,
                        }
                    }
                    if line.starts_with(b"OK ") && s.set_read_timeout(None).is_ok() {
                        return s;
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// A ttrpc client on a connected stream (call inside a tokio runtime).
    pub fn client(stream: UnixStream) -> burrow_protocol::AgentClient {
        stream
            .set_nonblocking(true)
            .expect("non-blocking vsock stream");
        let stream = tokio::net::UnixStream::from_std(stream).expect("tokio stream");
        let socket = burrow_protocol::ttrpc::r#async::transport::Socket::new(stream);
        burrow_protocol::AgentClient::new(burrow_protocol::ttrpc::r#async::Client::new(socket))
    }

    /// Run `test` against `vm`'s agent (once it answers, within
    /// `boot_timeout`) on a tokio runtime. If `test` panics, the VM's serial
    /// console and VMM stderr are printed before the panic goes on. Then
    /// wait up to 2 minutes for the VM to exit (`test` powers it off) and
    /// return how it exited.
    pub fn drive<F, Fut>(vm: &mut Vm, boot_timeout: Duration, test: F) -> ExitStatus
    where
        F: FnOnce(burrow_protocol::AgentClient) -> Fut,
        Fut: std::future::Future<Output = ()>,
    {
        let stream = connect(vm, boot_timeout);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            rt.block_on(async { test(client(stream)).await })
        }));
        if let Err(panic) = outcome {
            eprintln!("{}", vm.diagnostics());
            std::panic::resume_unwind(panic);
        }
        vm.wait_exit(Duration::from_secs(120))
    }
}
