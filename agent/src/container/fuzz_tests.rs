//! Bounded randomized tests (issue 15) of the agent's request decoding: an
//! OCI spec or process (what CreateContainer and Exec carry) damaged at
//! random, through parsing, the child plan, the PID-namespace masks and
//! the seccomp compiler. Seeded, a few thousand cases, in the normal test
//! suite; no input may panic the agent (its PID 1).

use serde_json::{json, Value};

use super::fuzz::decode;

fn base() -> Value {
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "user": {"uid": 0, "gid": 0},
            "args": ["sh", "-c", "true"],
            "env": ["PATH=/bin"],
            "cwd": "/",
            "capabilities": {"bounding": ["CAP_KILL"], "effective": ["CAP_KILL"]},
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
            "oomScoreAdj": 0
        },
        "root": {"path": "rootfs"},
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "mount"}],
            "maskedPaths": ["/proc/kcore"],
            "readonlyPaths": ["/proc/sys"],
            "seccomp": {
                "defaultAction": "SCMP_ACT_ERRNO",
                "architectures": ["SCMP_ARCH_X86_64"],
                "syscalls": [{"names": ["read", "write"], "action": "SCMP_ACT_ALLOW",
                    "args": [{"index": 0, "value": 1, "op": "SCMP_CMP_EQ"}]}]
            }
        }
    })
}

fn wild(rng: &mut fastrand::Rng) -> Value {
    match rng.u8(0..9) {
        0 => Value::Null,
        1 => Value::from(rng.i64(..)),
        2 => Value::from([0u64, 6, 7, 4096, u64::MAX][rng.usize(0..5)]),
        3 => Value::from(
            [
                "",
                "\u{0}",
                "CAP_NOPE",
                "SCMP_ACT_NOTIFY",
                "SCMP_CMP_MASKED_EQ",
                "x".repeat(300).as_str(),
            ][rng.usize(0..6)],
        ),
        4 => Value::Array((0..rng.usize(0..3)).map(|_| Value::from("a")).collect()),
        5 => json!([{"index": 9, "value": 1, "op": "SCMP_CMP_EQ"}]),
        6 => json!({"type": "pid", "path": "/proc/1/ns/pid"}),
        _ => Value::Bool(rng.bool()),
    }
}

/// Replace one value somewhere in `v`, at random depth (never the root).
fn mutate(rng: &mut fastrand::Rng, v: &mut Value, depth: u32) {
    let leaf = match v {
        Value::Object(m) => m.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => true,
    };
    if depth > 0 && (leaf || rng.u8(0..3) == 0) {
        *v = wild(rng);
        return;
    }
    match v {
        Value::Object(m) if !m.is_empty() => {
            let k = m
                .keys()
                .nth(rng.usize(0..m.len()))
                .cloned()
                .unwrap_or_default();
            if let Some(c) = m.get_mut(&k) {
                mutate(rng, c, depth + 1);
            }
        }
        Value::Array(a) if !a.is_empty() => {
            let i = rng.usize(0..a.len());
            mutate(rng, &mut a[i], depth + 1);
        }
        _ => {}
    }
}

#[test]
fn damaged_specs_and_processes_never_panic() {
    let mut rng = fastrand::Rng::with_seed(0x5eed_001c);
    let (mut planned, mut compiled) = (0, 0);
    for _ in 0..3000 {
        let mut v = base();
        for _ in 0..rng.usize(1..4) {
            mutate(&mut rng, &mut v, 0);
        }
        let mut bytes = serde_json::to_vec(&v).unwrap_or_default();
        if rng.u8(0..5) == 0 && !bytes.is_empty() {
            let at = rng.usize(0..bytes.len());
            bytes[at] = rng.u8(..);
        }
        let process = v
            .get("process")
            .map(|p| serde_json::to_vec(p).unwrap_or_default());
        let reached = decode(&bytes, process.as_deref());
        planned += usize::from(reached.planned);
        compiled += usize::from(reached.compiled);
    }
    assert!(
        planned > 0 && compiled > 0,
        "{planned} planned, {compiled} compiled: the accepting paths ran"
    );
}
