//! A checkpoint's manifest.json, read as a restore reads it: no input may
//! panic the shim, and what is accepted holds what the rest of the shim
//! relies on (a VM size, a bounded container id, a VM directory that is a
//! plain name inside the checkpoint).
#![no_main]

use libfuzzer_sys::fuzz_target;

use burrow_shim::vm::snapshot;

fuzz_target!(|data: &[u8]| {
    let dir = std::env::temp_dir().join(format!("burrow-fuzz-manifest-{}", std::process::id()));
    if std::fs::create_dir_all(dir.join("vm")).is_err() {
        return;
    }
    for f in ["vm/state", "vm/memory", "rootfs.img"] {
        let _ = std::fs::write(dir.join(f), b"x");
    }
    if std::fs::write(dir.join(snapshot::MANIFEST), data).is_err() {
        return;
    }
    if let Ok(m) = snapshot::read_manifest(&dir) {
        assert!(m.vcpus > 0 && m.memory_mib > 0, "{m:?}");
        assert!(!m.container_id.is_empty());
        assert!(m.container_id.len() <= burrow_protocol::MAX_ID_LEN);
        if let Some(vm) = &m.vm {
            assert!(burrow_shim::is_plain_name(vm, snapshot::MAX_NAME), "{vm:?}");
            assert!(m.vm_dir(&dir).starts_with(&dir));
        }
    }
});
