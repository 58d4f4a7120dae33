//! Port I/O on the serial port and the i8042, read from the input.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    burrow_vmm::devices::fuzz::port_io(data);
});
