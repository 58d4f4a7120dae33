//! Fuzzing harness for snapshot state decoding: a frame through the
//! typed decoder, `validate` and the untrusted-restore checks. Any panic
//! is a bug. Used by `vmm/fuzz` (cargo-fuzz target `snapshot_state`) and
//! by a randomized test in the normal test suite (`fuzz_tests.rs`).

use super::format::{decode, encode};
use super::microvm::{validate, MicrovmState};
use super::untrusted::{check, Expect};

/// Decode `frame` as a state and, if it decodes and validates, check it
/// as an untrusted restore would. True if it decoded.
pub fn state_frame(frame: &[u8]) -> bool {
    let Ok(state) = decode::<MicrovmState>(frame) else {
        return false;
    };
    if validate(&state).is_ok() {
        let _ = check(
            &state,
            &Expect {
                self_contained: true,
                ..Expect::default()
            },
        );
    }
    true
}

/// One fuzzer input: as a frame, and, when it is JSON, as the body of a
/// well-formed frame (which passes the header and checksum and reaches
/// the typed decoder).
pub fn run(data: &[u8]) {
    state_frame(data);
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(data) {
        if let Ok(frame) = encode(&v) {
            state_frame(&frame);
        }
    }
}
