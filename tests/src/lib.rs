//! Helpers for burrow's tests that need a host able to boot Linux guests.
//!
//! These tests run where hardware virtualization is available: directly on a
//! host with hardware KVM, or inside `hack/testhost` elsewhere. The README's
//! test command routes them there. Run anywhere else, they fail with a message
//! that says why instead of passing by skipping themselves.

use std::path::Path;

/// Panic with a clear message unless this host has `/dev/kvm` backed by
/// hardware virtualization (vmx/svm) rather than PVM.
pub fn require_hardware_kvm() {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let has_flag = cpuinfo
        .lines()
        .filter(|l| l.starts_with("flags"))
        .flat_map(str::split_whitespace)
        .any(|f| f == "vmx" || f == "svm");
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
