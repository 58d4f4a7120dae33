//! An OCI spec as CreateContainer carries it (the first half of the input)
//! and a process as Exec carries it (the rest), decoded as the agent
//! would: no input may panic the guest's PID 1.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let (spec, process) = data.split_at(data.len() / 2);
    burrow_agent::container::fuzz::decode(spec, Some(process));
});
