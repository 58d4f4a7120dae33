//! Snapshot state decoding, validation and the untrusted-restore checks.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    burrow_vmm::snapshot::fuzz::run(data);
});
