//! Bounded randomized tests (issue 15) of what a checkpoint hands the
//! shim: the sparse packs (`sparse::unpack`) and the manifest. A few
//! thousand seeded cases each, built from a real input and damaged the way
//! a hostile one would be (fields set to edge values, bytes flipped, cut
//! short, grown); any panic is a bug, and what is accepted must hold the
//! invariants the rest of the shim relies on.

#![allow(clippy::unwrap_used)]

use std::os::unix::fs::FileExt;
use std::path::Path;

use super::{snapshot, sparse};

/// Values that break arithmetic and bounds.
fn edge(rng: &mut fastrand::Rng, near: u64) -> u64 {
    match rng.u8(0..8) {
        0 => 0,
        1 => 1,
        2 => u64::MAX,
        3 => near.wrapping_add(1),
        4 => near.wrapping_sub(1),
        5 => sparse::MAX_SIZE,
        6 => sparse::MAX_EXTENTS + 1,
        _ => rng.u64(..),
    }
}

fn damage(rng: &mut fastrand::Rng, good: &[u8]) -> Vec<u8> {
    let mut b = good.to_vec();
    for _ in 0..rng.usize(1..4) {
        match rng.u8(0..5) {
            // a u64 field of the header or the extent table
            0 | 1 => {
                let fields = b.len().min(24 + 16 * 4) / 8;
                if fields > 0 {
                    let at = 8 * rng.usize(0..fields);
                    let old = u64::from_le_bytes(b[at..at + 8].try_into().unwrap());
                    b[at..at + 8].copy_from_slice(&edge(rng, old).to_le_bytes());
                }
            }
            2 if !b.is_empty() => {
                let at = rng.usize(0..b.len());
                b[at] ^= 1 << rng.u8(0..8);
            }
            3 => b.truncate(rng.usize(0..=b.len())),
            _ => b.extend((0..rng.usize(1..64)).map(|_| rng.u8(..))),
        }
    }
    b
}

#[test]
fn unpack_survives_random_damage_and_writes_only_what_the_header_says() {
    let d = tempfile::tempdir().unwrap();
    let (src, packed, out) = (d.path().join("src"), d.path().join("p"), d.path().join("o"));
    let f = std::fs::File::create(&src).unwrap();
    f.set_len(1 << 20).unwrap();
    f.write_all_at(&[7u8; 3000], 4096).unwrap();
    f.write_all_at(b"middle", 500_000).unwrap();
    f.write_all_at(b"end", (1 << 20) - 3).unwrap();
    sparse::pack(&src, &packed).unwrap();
    let good = std::fs::read(&packed).unwrap();
    let mut rng = fastrand::Rng::with_seed(0x5eed_0015);
    let mut accepted = 0;
    for case in 0..2000 {
        let bytes = damage(&mut rng, &good);
        std::fs::write(&packed, &bytes).unwrap();
        let _ = std::fs::remove_file(&out);
        if sparse::unpack(&packed, &out).is_ok() {
            accepted += 1;
            let size = u64::from_le_bytes(bytes[8..16].try_into().unwrap());
            let len = std::fs::metadata(&out).unwrap().len();
            assert_eq!(
                len, size,
                "case {case}: unpacked {len} bytes, the header says {size}"
            );
            assert!(size <= sparse::MAX_SIZE, "case {case}");
        }
    }
    // The damage is not all fatal (a flipped data byte unpacks): the
    // accepting path ran too.
    assert!(accepted > 0, "no damaged pack was accepted");
    std::fs::write(&packed, &good).unwrap();
    sparse::unpack(&packed, &out).unwrap();
    assert_eq!(std::fs::read(&out).unwrap(), std::fs::read(&src).unwrap());
}

fn random_json(rng: &mut fastrand::Rng, depth: u32) -> serde_json::Value {
    use serde_json::Value;
    match rng.u8(0..if depth > 2 { 5 } else { 7 }) {
        0 => Value::Null,
        1 => Value::Bool(rng.bool()),
        2 => Value::from(edge(rng, 0)),
        3 => Value::from(-rng.i64(1..)),
        4 => Value::String(
            ["", "..", "../etc", "/abs", "vm-1", "a b", "\u{0}", "ok"][rng.usize(0..8)].into(),
        ),
        5 => Value::Array(
            (0..rng.usize(0..3))
                .map(|_| random_json(rng, depth + 1))
                .collect(),
        ),
        _ => Value::Object(
            (0..rng.usize(0..3))
                .map(|i| (format!("k{i}"), random_json(rng, depth + 1)))
                .collect(),
        ),
    }
}

fn write_checkpoint_files(dir: &Path) {
    std::fs::create_dir_all(dir.join("vm")).unwrap();
    for f in [
        "vm/state",
        "vm/memory",
        "rootfs.img",
        "vm/memory.packed",
        "rootfs.img.packed",
    ] {
        std::fs::write(dir.join(f), b"x").unwrap();
    }
}

#[test]
fn manifests_survive_random_edits_and_what_is_accepted_is_sane() {
    let d = tempfile::tempdir().unwrap();
    write_checkpoint_files(d.path());
    let good = serde_json::json!({
        "kind": snapshot::KIND, "format_version": snapshot::FORMAT_VERSION,
        "container_id": "c1", "vcpus": 1, "memory_mib": 128, "rootfs_fstype": "ext4",
        "rootfs_read_only": false, "created_unix": 1, "spec": {"ociVersion": "1.0.2"},
        "packed": true
    });
    let keys: Vec<String> = good
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .chain(["vm".to_string()])
        .collect();
    let mut rng = fastrand::Rng::with_seed(0x5eed_0016);
    let mut accepted = 0;
    for case in 0..3000 {
        let mut v = good.clone();
        for _ in 0..rng.usize(1..3) {
            let k = &keys[rng.usize(0..keys.len())];
            if rng.u8(0..4) == 0 {
                v.as_object_mut().unwrap().remove(k);
            } else {
                v[k] = random_json(&mut rng, 0);
            }
        }
        let mut bytes = serde_json::to_vec(&v).unwrap();
        if rng.u8(0..4) == 0 && !bytes.is_empty() {
            let at = rng.usize(0..bytes.len());
            bytes[at] = rng.u8(..);
        }
        std::fs::write(d.path().join(snapshot::MANIFEST), &bytes).unwrap();
        if let Ok(m) = snapshot::read_manifest(d.path()) {
            accepted += 1;
            assert!(m.vcpus > 0 && m.memory_mib > 0, "case {case}: {m:?}");
            assert!(!m.container_id.is_empty(), "case {case}");
            assert!(
                m.container_id.len() <= burrow_protocol::MAX_ID_LEN,
                "case {case}"
            );
            if let Some(vm) = &m.vm {
                assert!(
                    crate::is_plain_name(vm, snapshot::MAX_NAME),
                    "case {case}: vm {vm:?}"
                );
                assert!(m.vm_dir(d.path()).starts_with(d.path()), "case {case}");
            }
        }
    }
    assert!(accepted > 0, "no edited manifest was accepted");
}
