//! Virtqueue processing (virtio-blk requests, vsock TX/RX chains and packet
//! headers) on guest memory made from the fuzzer's input.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    burrow_vmm::devices::virtio::fuzz::run(data);
});
