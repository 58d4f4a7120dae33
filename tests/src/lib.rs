//! Helpers for burrow's tests that need a host able to boot Linux guests.
//!
//! These tests run where hardware virtualization is available: directly on a
//! host with hardware KVM, or inside `hack/testhost` elsewhere. The README's
//! test command routes them there. Run anywhere else, they fail with a message
//! that says why instead of passing by skipping themselves.

pub mod containerd;

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
    // target/<profile>/deps/<test>-<hash> -> target/<profile>/<name>
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test executable lives in target/<profile>/deps");
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
