//! Bounded randomized tests (issue 15) of snapshot state decoding
//! ([`fuzz`](super::fuzz), also a cargo-fuzz target): frames
//! built by `encode` from random JSON shaped like a state (so they pass the
//! header and checksum and reach the typed decoder), with bits flipped or
//! cut short, and noise. No input panics. Random JSON seldom makes a whole
//! state, so the checks behind decoding (`validate`, the untrusted-restore
//! checks) are covered by snapshot_tiny's edits of a real state instead.

use super::format::{decode, encode};
use super::fuzz::{run, state_frame};
use super::microvm::MicrovmState;

fn number(rng: &mut fastrand::Rng) -> serde_json::Value {
    serde_json::Value::from([0, 1, 2, 16, 255, 256, 1 << 20, u64::MAX][rng.usize(0..8)])
}

/// A JSON value with the state's top-level keys, filled at random.
fn state_like(rng: &mut fastrand::Rng) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    for key in ["id", "vcpu_count", "mem_mib", "vcpus", "vm", "devices", "memory", "serial", "i8042", "cmdline"] {
        if rng.u8(0..8) == 0 {
            continue;
        }
        let v = match key {
            "vcpus" | "devices" => serde_json::Value::Array((0..rng.usize(0..3)).map(|_| number(rng)).collect()),
            "memory" => serde_json::json!({
                "regions": [{"guest_addr": number(rng), "size": number(rng)}],
                "kind": if rng.bool() {
                    serde_json::json!({"kind": "full"})
                } else {
                    serde_json::json!({"kind": "incremental", "base_dir": "/x", "base_id": number(rng),
                        "runs": [{"first": number(rng), "count": number(rng)}]})
                },
            }),
            _ => number(rng),
        };
        m.insert(key.to_string(), v);
    }
    serde_json::Value::Object(m)
}

#[test]
fn random_state_frames_are_refused_or_checked_never_panic() {
    let mut rng = fastrand::Rng::with_seed(0x5eed_001b);
    for _ in 0..3000 {
        let mut frame = encode(&state_like(&mut rng)).expect("encode");
        match rng.u8(0..4) {
            0 if !frame.is_empty() => {
                let at = rng.usize(0..frame.len());
                frame[at] ^= 1 << rng.u8(0..8);
            }
            1 => frame.truncate(rng.usize(0..=frame.len())),
            _ => {}
        }
        state_frame(&frame);
        if rng.u8(0..8) == 0 {
            run(&serde_json::to_vec(&state_like(&mut rng)).expect("json"));
        }
    }
    for _ in 0..1000 {
        let noise: Vec<u8> = (0..rng.usize(0..256)).map(|_| rng.u8(..)).collect();
        assert!(decode::<MicrovmState>(&noise).is_err());
    }
}
