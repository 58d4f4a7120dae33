//! The first test that proves the nested test host is real: a VM made with
//! kvm-ioctls runs guest code that writes a byte to a port and halts.

use burrow_vmm::probe::{run_tiny_guest, PROBE_BYTE};

#[test]
fn tiny_guest_writes_its_byte_on_hardware_kvm() {
    burrow_tests::require_hardware_kvm();
    let outcome = run_tiny_guest().expect("tiny guest runs");
    assert_eq!(outcome.byte, PROBE_BYTE);
    assert_eq!(outcome.exits, 2, "one port write, then HLT");
}
