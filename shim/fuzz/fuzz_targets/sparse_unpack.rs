//! A packed (sparse) memory or disk file from a checkpoint, unpacked: no
//! input may panic the shim, and what is accepted is no larger than the
//! shim's limit and exactly the size its header says.
#![no_main]

use libfuzzer_sys::fuzz_target;

use burrow_shim::vm::sparse;

fuzz_target!(|data: &[u8]| {
    let dir = std::env::temp_dir().join(format!("burrow-fuzz-unpack-{}", std::process::id()));
    if std::fs::create_dir_all(&dir).is_err() {
        return;
    }
    let (packed, out) = (dir.join("packed"), dir.join("out"));
    if std::fs::write(&packed, data).is_err() {
        return;
    }
    let _ = std::fs::remove_file(&out);
    if sparse::unpack(&packed, &out).is_ok() {
        let len = std::fs::metadata(&out).map_or(0, |m| m.len());
        let header = data
            .get(8..16)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes);
        assert_eq!(Some(len), header, "unpacked size and header disagree");
        assert!(len <= sparse::MAX_SIZE);
    }
    let _ = std::fs::remove_file(&out);
});
