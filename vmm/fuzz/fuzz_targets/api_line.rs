//! The VMM control API's input: bytes through the line reader (which
//! bounds lines) and every complete line through the request parser.
#![no_main]

use std::io::Write;
use std::os::unix::net::UnixStream;

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok((a, mut b)) = UnixStream::pair() else {
        return;
    };
    let Ok(mut c) = burrow_vmm::api::Client::new(a) else {
        return;
    };
    // Chunks the socket buffer holds, read between writes.
    for chunk in data.chunks(4096) {
        if b.write_all(chunk).is_err() {
            return;
        }
        let Some(lines) = c.read_lines() else {
            return;
        };
        for line in lines {
            assert!(line.len() <= burrow_vmm_api::MAX_LINE * 5);
            let _ = burrow_vmm_api::Request::parse(&line);
        }
    }
});
