//! Hostile checkpoints through containerd (issue 15): a checkpoint is a tar
//! in containerd's content store, and whoever can write there can hand the
//! shim symlinks, FIFOs, an unpacked layout, a VM bigger than the host
//! allows, a memory pack whose extents run past it, or a VM state that
//! names another snapshot's memory. Each must be
//! refused quickly, with an error that says why, through `ctr c restore`,
//! with nothing copied, mapped or left behind; and the untouched checkpoint
//! must still restore (the refusals were for their reason only).
//!
//! The crafted checkpoints are made from a real one: its tar blob in the
//! content store is rewritten in place (containerd does not re-check a
//! blob's digest when it reads it back, see shim_snapshot). An edit of the
//! manifest or VM state breaks the checkpoint's signature; to show what the
//! VMM refuses by itself (should the key leak), some edits are re-signed
//! with the host's key, as only someone holding it could.

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use burrow_tests::containerd::Containerd;

const LONG: Duration = Duration::from_secs(900);
const CLEAN: Duration = Duration::from_secs(60);
/// A refusal through containerd: ctr, containerd extracting the tar, a new
/// shim process, the checks. The checks themselves take milliseconds (the
/// shim's unit tests bound them at a second); the rest is the nested test
/// host's process start-up.
const REFUSED_WITHIN: Duration = Duration::from_secs(20);

/// One member of the checkpoint tar.
#[derive(Clone)]
struct Member {
    path: String,
    kind: Kind,
}

#[derive(Clone)]
enum Kind {
    File(Vec<u8>),
    Dir,
    Symlink(PathBuf),
    Fifo,
}

fn read_tar(data: &[u8]) -> Vec<Member> {
    let mut out = Vec::new();
    let mut a = tar::Archive::new(data);
    for e in a.entries().unwrap() {
        let mut e = e.unwrap();
        let path = e
            .path()
            .unwrap()
            .to_string_lossy()
            .trim_start_matches("./")
            .trim_end_matches('/')
            .to_string();
        if path.is_empty() || path == "." {
            continue;
        }
        let kind = match e.header().entry_type() {
            tar::EntryType::Directory => Kind::Dir,
            tar::EntryType::Regular => {
                let mut v = Vec::new();
                std::io::Read::read_to_end(&mut e, &mut v).unwrap();
                Kind::File(v)
            }
            other => panic!("{path}: unexpected {other:?} in a checkpoint burrow wrote"),
        };
        out.push(Member { path, kind });
    }
    out
}

fn write_tar(members: &[Member]) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for m in members {
        let mut h = tar::Header::new_gnu();
        h.set_mode(0o600);
        h.set_mtime(0);
        match &m.kind {
            Kind::File(data) => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, &m.path, data.as_slice()).unwrap();
            }
            Kind::Dir => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_mode(0o700);
                h.set_size(0);
                b.append_data(&mut h, &m.path, std::io::empty()).unwrap();
            }
            Kind::Symlink(to) => {
                h.set_entry_type(tar::EntryType::Symlink);
                h.set_size(0);
                b.append_link(&mut h, &m.path, to).unwrap();
            }
            Kind::Fifo => {
                h.set_entry_type(tar::EntryType::Fifo);
                h.set_size(0);
                b.append_data(&mut h, &m.path, std::io::empty()).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

/// The content-store blob holding burrow's checkpoint tar.
fn checkpoint_blob(root: &Path) -> PathBuf {
    let dir = root.join("io.containerd.content.v1.content/blobs/sha256");
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        let data = std::fs::read(e.path()).unwrap();
        if data.windows(8).any(|w| w == b"BRWSNAP\0")
            && data.windows(11).any(|w| w == b"burrow.json")
        {
            return e.path();
        }
    }
    panic!("no burrow checkpoint blob in {}", dir.display());
}

fn put_blob(blob: &Path, data: &[u8]) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(blob, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::write(blob, data).unwrap();
}

fn file<'a>(members: &'a mut [Member], path: &str) -> &'a mut Vec<u8> {
    match members
        .iter_mut()
        .find(|m| m.path == path)
        .map(|m| &mut m.kind)
    {
        Some(Kind::File(v)) => v,
        _ => panic!("no file {path} in the checkpoint"),
    }
}

fn replace(members: &mut [Member], path: &str, kind: Kind) {
    let m = members
        .iter_mut()
        .find(|m| m.path == path)
        .unwrap_or_else(|| panic!("no {path}"));
    m.kind = kind;
}

fn edit_manifest(members: &mut [Member], edit: impl FnOnce(&mut serde_json::Value)) {
    let f = file(members, "burrow.json");
    let mut v: serde_json::Value = serde_json::from_slice(f).unwrap();
    edit(&mut v);
    *f = serde_json::to_vec(&v).unwrap();
}

fn edit_state(members: &mut [Member], edit: impl FnOnce(&mut serde_json::Value)) {
    let f = file(members, "vm/state");
    let mut v: serde_json::Value = burrow_vmm::snapshot::format::decode(f).unwrap();
    edit(&mut v);
    *f = burrow_vmm::snapshot::format::encode(&v).unwrap();
}

/// Sign the (edited) checkpoint with `key` as the shim would.
fn resign(members: &mut [Member], key: &[u8]) {
    let manifest = file(members, "burrow.json").clone();
    let state = file(members, "vm/state").clone();
    let sig = burrow_shim::vm::signing::sign(key, &manifest, &state).unwrap();
    *file(members, "burrow.sig") = sig.into_bytes();
}

/// `ctr c restore` of the (crafted) checkpoint as `id`: refused with
/// `expect` in the error, quickly, and nothing left.
fn assert_refused(c: &Containerd, id: &str, expect: &str) {
    let r = c.ctr(&["containers", "restore", "--live", id, "cp1"]);
    eprintln!("{id}: refused in {:?}", r.elapsed);
    assert_ne!(
        r.code,
        Some(0),
        "{id}: a hostile checkpoint was restored: {r:?}"
    );
    assert!(
        r.stderr.contains(expect),
        "{id}: the error must say {expect:?}: {r:?}\n{}",
        c.diagnostics()
    );
    assert!(
        r.elapsed < REFUSED_WITHIN,
        "{id}: refused only after {:?}",
        r.elapsed
    );
    let _ = c.ctr(&["task", "delete", id]);
    let _ = c.ctr(&["containers", "rm", id]);
    c.assert_clean(CLEAN);
}

#[test]
fn hostile_checkpoints_are_refused_through_containerd_and_the_real_one_restores() {
    let key_path = PathBuf::from(format!(
        "/run/burrow-test/hostile-{}.key",
        std::process::id()
    ));
    let c = Containerd::start(
        "hostile",
        &format!(
            "agent_timeout_secs = 30\nboot_timeout_secs = 900\ncheckpoint_key = {:?}\n\
             [memory_mib]\ndefault = 128\nmax = 256\n",
            key_path.display().to_string()
        ),
    );
    let r = c.ctr(&Containerd::run_args(
        &["-d"],
        "t-src",
        &["sh", "-c", "echo restored-marker > /tmp/m; sleep 100000"],
    ));
    assert_eq!(r.code, Some(0), "{r:?}\n{}", c.diagnostics());
    c.wait_status("t-src", "RUNNING", LONG);
    let cp = c.ctr(&["containers", "checkpoint", "--task", "t-src", "cp1"]);
    assert_eq!(cp.code, Some(0), "checkpoint: {cp:?}\n{}", c.diagnostics());
    let _ = c.ctr(&["task", "kill", "-s", "SIGKILL", "t-src"]);
    c.wait_status("t-src", "STOPPED", LONG);
    assert_eq!(c.ctr(&["task", "delete", "t-src"]).code, Some(0));
    assert_eq!(c.ctr(&["containers", "rm", "t-src"]).code, Some(0));
    c.assert_clean(CLEAN);

    // The shim made the key on first use, private.
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&key_path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "{}", key_path.display());
    }
    let key = std::fs::read(&key_path).unwrap();
    let blob = checkpoint_blob(&c.root);
    let original = std::fs::read(&blob).unwrap();
    let good = read_tar(&original);
    let sentinel = c.dir().join("sentinel");
    std::fs::write(&sentinel, b"host secret").unwrap();
    let fifo = c.dir().join("host-fifo");
    let cfifo = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: mkfifo reads a valid C string.
    assert_eq!(unsafe { libc::mkfifo(cfifo.as_ptr(), 0o600) }, 0);

    type Craft<'a> = Box<dyn Fn(&mut Vec<Member>) + 'a>;
    let cases: Vec<(&str, Craft<'_>, &str)> = vec![
        (
            "h-sentinel",
            Box::new(|m: &mut Vec<Member>| {
                replace(m, "rootfs.img.packed", Kind::Symlink(sentinel.clone()))
            }),
            "rootfs.img.packed is a symlink",
        ),
        (
            "h-zero",
            Box::new(|m| replace(m, "vm/memory.packed", Kind::Symlink("/dev/zero".into()))),
            "vm/memory.packed is a symlink",
        ),
        (
            "h-fifo-link",
            Box::new(|m| replace(m, "vm/state", Kind::Symlink(fifo.clone()))),
            "vm/state is a symlink",
        ),
        (
            "h-fifo",
            Box::new(|m| replace(m, "vm/state", Kind::Fifo)),
            "vm/state is not a regular file",
        ),
        (
            "h-manifest-fifo",
            Box::new(|m| replace(m, "burrow.json", Kind::Fifo)),
            "burrow.json is not a regular file",
        ),
        (
            "h-unpacked",
            Box::new(|m| {
                edit_manifest(m, |v| v["packed"] = false.into());
                for x in m.iter_mut() {
                    if let Some(p) = x.path.strip_suffix(".packed") {
                        x.path = p.to_string();
                    }
                }
            }),
            "must be packed",
        ),
        (
            "h-big",
            Box::new(|m| {
                edit_manifest(m, |v| v["memory_mib"] = 4096.into());
                edit_state(m, |v| v["mem_mib"] = 4096.into());
            }),
            "4096 MiB of memory; this host allows at most 256 MiB",
        ),
        (
            "h-unsigned",
            Box::new(|m| m.retain(|x| x.path != "burrow.sig")),
            "it is not signed (burrow.sig is missing)",
        ),
        (
            "h-edited-state",
            Box::new(|m| edit_state(m, |v| v["mem_mib"] = 256.into())),
            "its signature does not match",
        ),
        (
            "h-edited-manifest",
            Box::new(|m| edit_manifest(m, |v| v["container_id"] = "other".into())),
            "its signature does not match",
        ),
        // Memory packed page-aligned, mapped in place by the VMM: an
        // extent whose bytes would run past the pack (the memory pack is
        // not signed: its header is checked before anything is mapped).
        (
            "h-memory-extent",
            Box::new(|m| {
                let f = file(m, "vm/memory.packed");
                assert_eq!(&f[..8], b"BRWSPRS\x02", "memory packed page-aligned");
                // The first extent's length (offset 32) grows by a page.
                let len = u64::from_le_bytes(f[32..40].try_into().unwrap());
                f[32..40].copy_from_slice(&(len + 4096).to_le_bytes());
            }),
            "the checkpoint's memory",
        ),
        // With the key (defence in depth): the VMM's own checks.
        (
            "h-state-size",
            Box::new(|m| {
                edit_state(m, |v| v["mem_mib"] = 256.into());
                resign(m, &key);
            }),
            "the state has 256 MiB of memory, the checkpoint says 128 MiB",
        ),
        (
            "h-base-dir",
            Box::new(|m| {
                edit_state(m, |v| {
                    v["memory"]["kind"] = serde_json::json!({
                        "kind": "incremental", "base_dir": "/var/lib/elsewhere", "base_id": 1, "runs": []
                    })
                });
                resign(m, &key);
            }),
            "names a base snapshot",
        ),
    ];
    for (id, craft, expect) in &cases {
        let mut m = good.clone();
        craft(&mut m);
        put_blob(&blob, &write_tar(&m));
        assert_refused(&c, id, expect);
        assert_eq!(std::fs::read(&sentinel).unwrap(), b"host secret");
    }

    // The untouched checkpoint restores: each refusal was for its reason.
    put_blob(&blob, &original);
    let r = c.ctr(&["containers", "restore", "--live", "t-good", "cp1"]);
    assert_eq!(
        r.code,
        Some(0),
        "the real checkpoint: {r:?}\n{}",
        c.diagnostics()
    );
    c.wait_status("t-good", "RUNNING", LONG);
    assert_eq!(
        c.exec_ok("t-good", "e1", &["cat", "/tmp/m"]).trim(),
        "restored-marker"
    );
    let _ = c.ctr(&["task", "kill", "-s", "SIGKILL", "t-good"]);
    c.wait_status("t-good", "STOPPED", LONG);
    assert_eq!(c.ctr(&["task", "delete", "t-good"]).code, Some(0));
    assert_eq!(c.ctr(&["containers", "rm", "t-good"]).code, Some(0));
    c.assert_clean(CLEAN);
    let _ = std::fs::remove_file(&key_path);
}

/// A VM that stops answering (its burrow-vmm frozen with SIGSTOP: no vCPU
/// runs, no device answers): `ctr task kill -s SIGKILL` still ends the task
/// (the agent's call times out and the shim kills the VM), reported as
/// killed, and `delete` leaves nothing.
#[test]
fn a_vm_that_stops_answering_is_killed_and_deleted_through_ctr() {
    let c = Containerd::start(
        "stuck",
        "agent_timeout_secs = 5\nboot_timeout_secs = 900\n[memory_mib]\ndefault = 128\n",
    );
    let r = c.ctr(&Containerd::run_args(
        &["-d"],
        "t-stuck",
        &["sleep", "100000"],
    ));
    assert_eq!(r.code, Some(0), "{r:?}\n{}", c.diagnostics());
    c.wait_status("t-stuck", "RUNNING", LONG);
    let pid = c.vmm_pid("t-stuck");
    // SAFETY: kill(2) on the VMM this test's containerd started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let k = c.ctr(&["task", "kill", "-s", "SIGKILL", "t-stuck"]);
    assert_eq!(
        k.code,
        Some(0),
        "kill of a frozen VM: {k:?}\n{}",
        c.diagnostics()
    );
    // The agent timeout (5 s) and the kill, not the VM lock or a boot timeout.
    assert!(
        k.elapsed < Duration::from_secs(60),
        "kill took {:?}",
        k.elapsed
    );
    c.wait_status("t-stuck", "STOPPED", Duration::from_secs(60));
    assert!(
        !burrow_tests::containerd::process_running(pid),
        "the frozen burrow-vmm {pid} is still there"
    );
    let d = c.ctr(&["task", "delete", "t-stuck"]);
    assert_eq!(d.code, Some(0), "{d:?}\n{}", c.diagnostics());
    assert_eq!(c.ctr(&["containers", "rm", "t-stuck"]).code, Some(0));
    c.assert_clean(CLEAN);
    // Reported: the shim's log says what it did and why.
    let log = c.diagnostics();
    assert!(log.contains("did not take SIGKILL"), "{log}");
}
