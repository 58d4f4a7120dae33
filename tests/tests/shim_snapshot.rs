//! Whole-VM checkpoint and restore through containerd 1.6's `ctr`:
//! `ctr c checkpoint --task` (task API Checkpoint; containerd tars the
//! directory into its content store) and `ctr c restore --live` (Create with
//! the extracted checkpoint). Run inside hack/testhost (or on a host with
//! hardware KVM).

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use burrow_tests::containerd::{walk, Containerd};

/// Nested guests are slow (QEMU TCG): allow minutes, assert no timings.
const LONG: Duration = Duration::from_secs(900);
const CLEAN: Duration = Duration::from_secs(60);

/// The container's workload: a counter in /tmp/counter, a long-lived
/// background child, and a TCP connection on the guest's loopback that
/// appends one line a second to /tmp/received. busybox's nc exits when its
/// stdin ends, so the listener reads from a pipe that never does (with the
/// task's own stdin it got one line and quit).
const WORKLOAD: &str = "sleep 100000 & \
    (sleep 100000 | nc -l -p 7000 > /tmp/received &) ; sleep 1; \
    (i=0; while true; do i=$((i+1)); echo tick$i; sleep 1; done | nc 127.0.0.1 7000 &) ; \
    i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 1; done";

/// `ctr run -d` with `flags`, and wait until the task runs.
fn run_detached(c: &Containerd, flags: &[&str], id: &str, cmd: &[&str]) {
    let r = c.ctr(&Containerd::run_args(flags, id, cmd));
    assert_eq!(r.code, Some(0), "run {id}: {r:?}\n{}", c.diagnostics());
    c.wait_status(id, "RUNNING", LONG);
}

fn containerd(name: &str) -> Containerd {
    Containerd::start(
        name,
        "agent_timeout_secs = 30\nboot_timeout_secs = 900\n[memory_mib]\ndefault = 128\n",
    )
}

fn counter(c: &Containerd, id: &str, exec_id: &str) -> u64 {
    // `echo $i > /tmp/counter` truncates before it writes: a read can land
    // in between and see an empty file, so an empty read is repeated.
    for attempt in 0..5 {
        let out = c.exec_ok(
            id,
            &format!("{exec_id}-{attempt}"),
            &["cat", "/tmp/counter"],
        );
        if out.trim().is_empty() {
            eprintln!("note: {id}: /tmp/counter read empty (attempt {attempt})");
            std::thread::sleep(Duration::from_millis(300));
            continue;
        }
        return out
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("counter in {id}: {out:?}: {e}"));
    }
    panic!("counter in {id}: empty five times\n{}", c.diagnostics());
}

/// The tick numbers that came through the loopback connection so far,
/// checked to be 1, 2, 3, ... (one connection, nothing lost or repeated).
fn received_ticks(c: &Containerd, id: &str, exec_id: &str) -> u64 {
    let out = c.exec_ok(
        id,
        exec_id,
        &["sh", "-c", "cat /tmp/received 2>/dev/null; true"],
    );
    let mut n = 0;
    for line in out.lines() {
        let t: u64 = line
            .strip_prefix("tick")
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("{id}: odd line {line:?} in /tmp/received"));
        assert_eq!(
            t,
            n + 1,
            "{id}: the loopback stream skipped or repeated: {out:?}"
        );
        n = t;
    }
    n
}

/// Wait until more than `than` ticks came through the loopback connection.
fn wait_ticks(c: &Containerd, id: &str, than: u64) -> u64 {
    let t = Instant::now();
    loop {
        let n = received_ticks(c, id, &format!("rx{}", t.elapsed().as_millis()));
        if n > than {
            return n;
        }
        assert!(
            t.elapsed() < LONG,
            "{id}: the loopback TCP connection carries nothing past tick {than}\n{}",
            c.diagnostics()
        );
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// `pid args` of the long-lived processes (not ps, not the 1 s sleeps).
fn long_lived(c: &Containerd, id: &str, exec_id: &str) -> Vec<String> {
    let out = c.exec_ok(id, exec_id, &["ps", "-o", "pid,args"]);
    let mut v: Vec<String> = out
        .lines()
        .skip(1)
        .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
        .filter(|l| l.contains("sleep 100000") || l.contains("nc ") || l.contains("sh -c"))
        .collect();
    v.sort();
    v
}

fn remove(c: &Containerd, id: &str) {
    let _ = c.ctr(&["task", "kill", "-s", "SIGKILL", id]);
    c.wait_status(id, "STOPPED", LONG);
    let d = c.ctr(&["task", "delete", id]);
    assert_eq!(d.code, Some(0), "{d:?}");
    assert_eq!(c.ctr(&["containers", "rm", id]).code, Some(0));
}

fn blobs(root: &Path) -> Vec<PathBuf> {
    let dir = root.join("io.containerd.content.v1.content/blobs/sha256");
    std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .collect()
}

/// Damage the VM state inside the checkpoint tar in containerd's content
/// store (containerd does not re-check digests when it reads a blob back).
fn corrupt_checkpoint_blob(root: &Path) {
    for blob in blobs(root) {
        let mut data = std::fs::read(&blob).unwrap();
        if let Some(at) = data.windows(8).position(|w| w == b"BRWSNAP\0") {
            for b in &mut data[at + 100..at + 116] {
                *b ^= 0x5a;
            }
            let mut perms = std::fs::metadata(&blob).unwrap().permissions();
            #[allow(clippy::permissions_set_readonly_false)]
            perms.set_readonly(false);
            std::fs::set_permissions(&blob, perms).unwrap();
            std::fs::write(&blob, data).unwrap();
            return;
        }
    }
    panic!(
        "no checkpoint blob with a burrow VM state in {}",
        root.display()
    );
}

#[test]
fn checkpoint_then_restore_continues_the_process_tree_three_times_and_refuses_a_corrupt_one() {
    let c = containerd("snap");
    run_detached(&c, &["-d"], "t-src", &["sh", "-c", WORKLOAD]);
    let start = Instant::now();
    let mut n = 0;
    while n < 3 {
        assert!(
            start.elapsed() < LONG,
            "the counter does not count\n{}",
            c.diagnostics()
        );
        std::thread::sleep(Duration::from_secs(1));
        n = counter(&c, "t-src", &format!("c{}", start.elapsed().as_millis()));
    }
    // The loopback connection carries data: at least two lines.
    let tcp_before = wait_ticks(&c, "t-src", 1);
    let procs = long_lived(&c, "t-src", "ps0");
    assert!(
        procs.iter().any(|l| l.contains("sleep 100000")),
        "{procs:?}"
    );
    let before = counter(&c, "t-src", "c-before");

    // containerd's other verb: `ctr task checkpoint` (pause, checkpoint into
    // the content store, resume).
    let tc = c.ctr(&["task", "checkpoint", "t-src"]);
    assert_eq!(
        tc.code,
        Some(0),
        "task checkpoint: {tc:?}\n{}",
        c.diagnostics()
    );
    assert!(tc.stdout.contains("checkpoint"), "no image name: {tc:?}");
    c.wait_status("t-src", "RUNNING", LONG);
    // Its blobs must go before the next checkpoint of this container:
    // containerd 1.6's daemon stores each checkpoint's spec as a blob and
    // fails with "already exists" when an identical one is there.
    let rm = c.ctr(&["images", "rm", "--sync", tc.stdout.trim()]);
    assert_eq!(rm.code, Some(0), "{rm:?}");

    // --rw adds the snapshotter's rw layer (burrow's disk is in the
    // checkpoint anyway); it must not get in the way.
    let cp = c.ctr(&["containers", "checkpoint", "--task", "--rw", "t-src", "cp1"]);
    assert_eq!(cp.code, Some(0), "checkpoint: {cp:?}\n{}", c.diagnostics());
    // The source runs on after its checkpoint.
    c.wait_status("t-src", "RUNNING", LONG);
    let later = counter(&c, "t-src", "c-after");
    assert!(later >= before, "{later} < {before}");
    // A named checkpoint in a directory (what --image-path would give, which
    // containerd 1.6 passes only to runc).
    let state_dir = c.burrow_state().display().to_string();
    // Read before the checkpoint: the restored counter starts from at least this.
    let named_at = counter(&c, "t-src", "c-named");
    let nc = c.burrow(&[
        "sandbox",
        "checkpoint",
        "--state-dir",
        &state_dir,
        "t-src",
        "named1",
    ]);
    assert_eq!(
        nc.code,
        Some(0),
        "burrow sandbox checkpoint: {nc:?}\n{}",
        c.diagnostics()
    );
    let named = c.snapshot_dir().join(".checkpoints/named1");
    assert!(named.join("burrow.json").is_file(), "{nc:?}");
    let again = c.burrow(&[
        "sandbox",
        "checkpoint",
        "--state-dir",
        &state_dir,
        "t-src",
        "named1",
    ]);
    assert_ne!(
        again.code,
        Some(0),
        "a named checkpoint was overwritten: {again:?}"
    );
    assert!(again.stderr.contains("remove it first"), "{again:?}");
    remove(&c, "t-src");

    // One checkpoint, three restored containers under new ids.
    for id in ["t-r1", "t-r2", "t-r3"] {
        let mut args = vec!["containers", "restore", "--live"];
        if id == "t-r1" {
            args.push("--rw");
        }
        args.extend([id, "cp1"]);
        let r = c.ctr(&args);
        assert_eq!(r.code, Some(0), "restore {id}: {r:?}\n{}", c.diagnostics());
        c.wait_status(id, "RUNNING", LONG);
        // The packed memory was mapped where it lies, not unpacked first.
        let phases = c.start_phases(id);
        assert!(
            phases.starts_with("restored from a checkpoint")
                && phases.contains("(memory mapped in place)"),
            "{id}: {phases}"
        );
        let got = counter(&c, id, "r-c1");
        assert!(
            got >= before,
            "{id}: the counter restarted: {got} < {before}"
        );
        assert_eq!(
            long_lived(&c, id, "r-ps"),
            procs,
            "{id}: different processes after restore"
        );
        // The counter keeps counting.
        let t = Instant::now();
        while counter(&c, id, &format!("r-c{}", t.elapsed().as_millis())) <= got {
            assert!(
                t.elapsed() < LONG,
                "{id}: the counter stopped\n{}",
                c.diagnostics()
            );
            std::thread::sleep(Duration::from_secs(1));
        }
        // The clock was stepped to the host's time.
        let guest: i64 = c
            .exec_ok(id, "r-date", &["date", "+%s"])
            .trim()
            .parse()
            .unwrap();
        let host = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs() as i64;
        assert!(
            (guest - host).abs() < 120,
            "{id}: guest clock {guest}, host {host}"
        );
        // The TCP connection on the guest's loopback survived: the same
        // stream goes on past where it was at the checkpoint.
        let at_restore = received_ticks(&c, id, "r-rx0");
        assert!(
            at_restore >= tcp_before,
            "{id}: the loopback stream restarted: {at_restore} < {tcp_before}"
        );
        wait_ticks(&c, id, at_restore);
    }
    for id in ["t-r1", "t-r2", "t-r3"] {
        remove(&c, id);
    }
    c.assert_clean(CLEAN);

    // `ctr run` with io.burrow.restore starts from the named checkpoint.
    run_detached(
        &c,
        &["-d", "--annotation", "io.burrow.restore=named1"],
        "t-named",
        &["sh", "-c", "echo this process must not start; exit 3"],
    );
    let got = counter(&c, "t-named", "n-c1");
    assert!(
        got >= named_at,
        "t-named: the counter restarted: {got} < {named_at}"
    );
    assert_eq!(long_lived(&c, "t-named", "n-ps"), procs);
    remove(&c, "t-named");
    c.assert_clean(CLEAN);
    std::fs::remove_dir_all(&named).unwrap();

    // A damaged checkpoint is refused, and nothing is left behind.
    corrupt_checkpoint_blob(&c.root);
    let r = c.ctr(&["containers", "restore", "--live", "t-bad", "cp1"]);
    assert_ne!(r.code, Some(0), "a corrupt checkpoint was restored: {r:?}");
    // The state is covered by the checkpoint's signature (tests/hostile.rs
    // has the rest of what a crafted checkpoint is refused for).
    assert!(
        r.stderr.contains("signature does not match"),
        "the error must say what failed: {r:?}\n{}",
        c.diagnostics()
    );
    let _ = c.ctr(&["task", "delete", "t-bad"]);
    let _ = c.ctr(&["containers", "rm", "t-bad"]);
    c.assert_clean(CLEAN);
}

/// burrow-vmm processes serving sandbox `id` of this containerd.
fn vmm_processes(c: &Containerd, id: &str) -> Vec<String> {
    let marker = c
        .burrow_state()
        .join("default")
        .join(id)
        .display()
        .to_string();
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let cmdline = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            (cmdline.contains("burrow-vmm") && cmdline.contains(&marker)).then_some(cmdline)
        })
        .collect()
}

fn sandbox_state(c: &Containerd, id: &str) -> String {
    let state_dir = c.burrow_state().display().to_string();
    let r = c.burrow(&["sandbox", "ls", "--state-dir", &state_dir]);
    assert_eq!(r.code, Some(0), "burrow sandbox ls: {r:?}");
    r.stdout
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(1) == Some(&id)).then(|| f.get(2).map(|s| s.to_string()).unwrap_or_default())
        })
        .unwrap_or_default()
}

/// The newest VM snapshot of a hibernation chain (its manifest's `vm`).
fn latest_link(snap: &Path) -> PathBuf {
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(snap.join("burrow.json")).unwrap()).unwrap();
    let name = m["vm"]
        .as_str()
        .unwrap_or_else(|| panic!("no vm link in {m}"));
    snap.join(name)
}

/// Bytes a (sparse) file has on disk.
fn allocated(p: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .blocks()
        * 512
}

const COUNTER: &str =
    "sleep 100000 & i=0; while true; do i=$((i+1)); echo $i > /tmp/counter; sleep 1; done";

#[test]
fn hibernate_stops_the_vmm_and_the_next_call_wakes_it_transparently() {
    let c = containerd("hib");
    let state_dir = c.burrow_state().display().to_string();
    run_detached(&c, &["-d"], "t-hib", &["sh", "-c", COUNTER]);
    while counter(&c, "t-hib", "h-c0") < 2 {
        std::thread::sleep(Duration::from_secs(1));
    }
    let procs = long_lived(&c, "t-hib", "h-ps0");
    let before = counter(&c, "t-hib", "h-c1");
    assert_eq!(sandbox_state(&c, "t-hib"), "running");

    let h = c.burrow(&["sandbox", "hibernate", "--state-dir", &state_dir, "t-hib"]);
    assert_eq!(h.code, Some(0), "hibernate: {h:?}\n{}", c.diagnostics());
    assert!(h.stdout.contains("asleep"), "{h:?}");
    assert!(
        vmm_processes(&c, "t-hib").is_empty(),
        "burrow-vmm still runs while asleep"
    );
    assert!(c.snapshot_dir().join("default/t-hib/burrow.json").is_file());
    assert_eq!(sandbox_state(&c, "t-hib"), "asleep");
    // The sleeping VM's memory (the agent's secrets) is root's only.
    c.assert_private();
    assert_eq!(
        c.task_status("t-hib").as_deref(),
        Some("RUNNING"),
        "containerd must not notice"
    );

    // The next exec wakes it: same processes, the counter continues.
    let got = counter(&c, "t-hib", "h-c2");
    assert!(got >= before, "the counter restarted: {got} < {before}");
    assert_eq!(sandbox_state(&c, "t-hib"), "running");
    assert_eq!(vmm_processes(&c, "t-hib").len(), 1);
    assert_eq!(long_lived(&c, "t-hib", "h-ps1"), procs);
    let snap = c.snapshot_dir().join("default/t-hib");
    let full = latest_link(&snap);

    // Asleep again: only the pages dirtied since the wake are written, on
    // top of the snapshot it woke from, which stayed.
    let h = c.burrow(&["sandbox", "hibernate", "--state-dir", &state_dir, "t-hib"]);
    assert_eq!(
        h.code,
        Some(0),
        "hibernate again: {h:?}\n{}",
        c.diagnostics()
    );
    assert!(vmm_processes(&c, "t-hib").is_empty());
    let incremental = latest_link(&snap);
    assert_ne!(
        incremental, full,
        "the second hibernation wrote no new link"
    );
    let (full_bytes, inc_bytes) = (
        allocated(&full.join("memory")),
        allocated(&incremental.join("memory")),
    );
    eprintln!("hibernation: full {full_bytes} bytes, incremental {inc_bytes} bytes");
    assert!(
        inc_bytes * 2 < full_bytes,
        "the second hibernation is not incremental: {inc_bytes} bytes against {full_bytes}"
    );
    // And wakes from base + increment: same processes, counting on.
    let again = counter(&c, "t-hib", "h-c3");
    assert!(again >= got, "the counter went back: {again} < {got}");
    assert_eq!(long_lived(&c, "t-hib", "h-ps2"), procs);
    remove(&c, "t-hib");
    assert!(!snap.exists(), "{} outlived its sandbox", snap.display());
    c.assert_clean(CLEAN);

    // Hibernate on idle (annotation), woken by kill; a clean delete. An
    // exec that runs silently for longer than the idle time holds it off
    // (asleep, the command would stop until something woke the VM): the
    // sandbox stays awake until the command has finished. So does a guest
    // that computes. Once all is quiet it sleeps.
    run_detached(
        &c,
        &["-d", "--annotation", "io.burrow.hibernate_idle_secs=8"],
        "t-idle",
        &["sh", "-c", COUNTER],
    );
    let stays_awake = |run: &(dyn Fn() -> burrow_tests::containerd::Run + Sync)| {
        std::thread::scope(|s| {
            let silent = s.spawn(run);
            while !silent.is_finished() {
                let state = sandbox_state(&c, "t-idle");
                assert!(
                    silent.is_finished() || state == "running",
                    "{state} while an exec runs\n{}",
                    c.diagnostics()
                );
                std::thread::sleep(Duration::from_millis(500));
            }
            let r = silent.join().unwrap();
            assert_eq!((r.code, r.stdout.trim()), (Some(0), "finished"), "{r:?}");
        })
    };
    let silent = "sleep 20; echo finished";
    stays_awake(&|| c.ctr(&["task", "exec", "--exec-id", "silent", "t-idle", "sh", "-c", silent]));
    // The same for the tools' exec (`burrow exec`, MCP's exec).
    stays_awake(&|| c.burrow(&["exec", "--state-dir", &state_dir, "t-idle", "--", "sh", "-c", silent]));
    // A guest that computes without a word and with no exec running (a
    // process left in the background) is not idle either: 20 s awake.
    let spin = "(while :; do :; done) >/dev/null 2>&1 & echo $! > /tmp/spin.pid";
    let r = c.ctr(&["task", "exec", "--exec-id", "spin", "t-idle", "sh", "-c", spin]);
    assert_eq!(r.code, Some(0), "{r:?}");
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(20) {
        let state = sandbox_state(&c, "t-idle");
        assert_eq!(state, "running", "a computing guest went to sleep\n{}", c.diagnostics());
        std::thread::sleep(Duration::from_millis(500));
    }
    let r = c.ctr(&["task", "exec", "--exec-id", "unspin", "t-idle", "sh", "-c", "kill $(cat /tmp/spin.pid)"]);
    assert_eq!(r.code, Some(0), "{r:?}");
    let t = Instant::now();
    while sandbox_state(&c, "t-idle") != "asleep" {
        assert!(
            t.elapsed() < LONG,
            "t-idle never hibernated\n{}",
            c.diagnostics()
        );
        std::thread::sleep(Duration::from_secs(2));
    }
    // The phase turns asleep (so the VMM's exit is not taken for a crash)
    // just before the VMM is stopped: it is gone a moment later.
    let t = Instant::now();
    while !vmm_processes(&c, "t-idle").is_empty() {
        assert!(
            t.elapsed() < Duration::from_secs(30),
            "burrow-vmm still runs 30 s after t-idle hibernated on idle"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(c.task_status("t-idle").as_deref(), Some("RUNNING"));
    remove(&c, "t-idle");
    c.assert_clean(CLEAN);
}

/// Issue 15: a container's rootfs image lives on disk under `image_dir`, not
/// in the tmpfs state dir, and within the sandbox's disk limit
/// (`sandbox_disk_limit_mib`, lowered here per container by the annotation
/// `io.burrow.sandbox_disk_limit_mib`): a create whose image would go over
/// is refused with nothing left behind, and a hibernation that would (the
/// image's blocks plus up to the VM's memory) is refused with the VM left
/// running.
#[test]
fn rootfs_images_live_under_image_dir_within_the_sandbox_disk_limit() {
    use std::os::unix::fs::PermissionsExt;
    // No slack: busybox fits in the smallest image, 64 MiB.
    let c = Containerd::start(
        "disk",
        "agent_timeout_secs = 30\nboot_timeout_secs = 900\nrootfs_slack_mib = 0\n[memory_mib]\ndefault = 128\n",
    );
    let state_dir = c.burrow_state().display().to_string();
    let images = c.image_dir().join("default");

    // 32 MiB cannot hold a 64 MiB image: refused before it is made.
    let r = c.ctr(&Containerd::run_args(
        &["-d", "--annotation", "io.burrow.sandbox_disk_limit_mib=32"],
        "t-big",
        &["sleep", "100000"],
    ));
    assert_ne!(r.code, Some(0), "a create over the limit ran: {r:?}");
    assert!(
        r.stderr.contains("sandbox_disk_limit_mib")
            && r.stderr
                .contains("the rootfs image of container t-big may write 64.0 MiB")
            && r.stderr.contains("over its limit of 32 MiB"),
        "the refusal says why: {r:?}\n{}",
        c.diagnostics()
    );
    let _ = c.ctr(&["task", "delete", "t-big"]);
    let _ = c.ctr(&["containers", "rm", "t-big"]);
    c.assert_clean(CLEAN);
    assert!(!images.join("t-big").exists());

    // 100 MiB: the image fits; it is under image_dir, private, and what the
    // VM runs on; nothing of the sort is under /run.
    run_detached(
        &c,
        &["-d", "--annotation", "io.burrow.sandbox_disk_limit_mib=100"],
        "t-img",
        &["sh", "-c", COUNTER],
    );
    let img = images.join("t-img").join("t-img.rootfs.img");
    let md = std::fs::metadata(&img)
        .unwrap_or_else(|e| panic!("{}: {e}\n{}", img.display(), c.diagnostics()));
    assert_eq!(md.len(), 64 << 20, "{}", img.display());
    assert_eq!(md.permissions().mode() & 0o777, 0o600);
    let dir_mode = std::fs::metadata(images.join("t-img"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(dir_mode & 0o777, 0o700);
    let in_run: Vec<_> = walk(&c.burrow_state())
        .into_iter()
        .filter(|f| f.to_string_lossy().ends_with(".rootfs.img"))
        .collect();
    assert!(in_run.is_empty(), "rootfs images under /run: {in_run:?}");
    let vmm = c.vmm_pid("t-img");
    let held = std::fs::read_dir(format!("/proc/{vmm}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .any(|p| p == img);
    assert!(held, "burrow-vmm {vmm} does not hold {}", img.display());
    c.assert_private();

    // The image's blocks and up to 128 MiB of memory are over 100 MiB:
    // hibernation is refused and the VM runs on, counting.
    let before = counter(&c, "t-img", "d-c0");
    let h = c.burrow(&["sandbox", "hibernate", "--state-dir", &state_dir, "t-img"]);
    assert_ne!(h.code, Some(0), "hibernated over the limit: {h:?}");
    let said = format!("{}{}", h.stdout, h.stderr);
    assert!(
        said.contains("sandbox_disk_limit_mib")
            && said.contains("a hibernation may write 128.0 MiB"),
        "{h:?}"
    );
    assert_eq!(sandbox_state(&c, "t-img"), "running");
    assert_eq!(vmm_processes(&c, "t-img").len(), 1);
    assert!(
        walk(&c.snapshot_dir()).is_empty(),
        "a refused hibernation wrote something"
    );
    let t = Instant::now();
    while counter(&c, "t-img", &format!("d-c{}", t.elapsed().as_millis())) <= before {
        assert!(
            t.elapsed() < LONG,
            "t-img stopped counting\n{}",
            c.diagnostics()
        );
        std::thread::sleep(Duration::from_secs(1));
    }

    // Delete takes the image and its sandbox's directory.
    remove(&c, "t-img");
    assert!(!img.exists(), "{} outlived its container", img.display());
    assert!(!images.join("t-img").exists());
    c.assert_clean(CLEAN);
}
