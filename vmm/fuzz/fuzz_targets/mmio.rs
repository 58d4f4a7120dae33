//! virtio-mmio register sequences on a virtio-blk device, read from the
//! input: queue setup, activation, notifications.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    burrow_vmm::devices::fuzz::mmio_registers(data);
});
