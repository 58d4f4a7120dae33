//! bench-pods: CRI pods through containerd's CRI plugin as the kubelet
//! makes them, burrow and runc as runtime handlers side by side in one run
//! (run by `bench/pods`, inside the nested test host on our machines).
//!
//! For each handler and run: RunPodSandbox; the first container created
//! and started; its first ExecSync; two more containers started (a
//! three-container pod); the memory the pod costs the host (PSS of every
//! process it added: shim, VMM with the guest RAM it touched, runc's
//! processes); StopPodSandbox + RemovePodSandbox. Prints a markdown table
//! (min / median / max) on stdout, progress on stderr.
//!
//! Rows beside the handlers: `burrow-restored` (pods started from a named
//! checkpoint of a three-container pod, with `burrow`) and `burrow-copy`
//! (`burrow` with `pod_layer_slots = 0`, in a containerd of its own: each
//! pod member gets a whole copy of its image instead of the shared
//! read-only layer image under a small writable disk).
//!
//! Then, for `runc` and `burrow` when asked for: the host memory a pod
//! gives back when a member that filled 160 MiB leaves (PSS of the pod's
//! processes before the member, with it, and 20 s after its removal):
//! runc's is the host's at once; burrow's VM grew for the member's limit
//! and shrinks when it goes, and the guest unplugs what it can free.

use std::collections::BTreeSet;
use std::time::Instant;

use burrow_tests::cri::Cri;
use k8s_cri::v1 as cri;

fn pids() -> BTreeSet<u32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// Proportional set size of process `pid` in KiB (0 if it is gone).
fn pss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix("Pss:"))
        .filter_map(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// One run's numbers: seconds for each step, MiB for the pod.
struct Run {
    pod: f64,
    first_started: f64,
    first_exec: f64,
    three: f64,
    mib: f64,
    teardown: f64,
}

/// The named checkpoint the `burrow-restored` row starts its pods from.
const CHECKPOINT: &str = "bench-pods";

/// `handler` is a CRI handler, or `burrow-restored`: burrow pods started
/// from [`CHECKPOINT`].
fn one_run(cri: &Cri, handler: &str, n: usize) -> Run {
    let forever = ["sleep", "2147483647"];
    let before = pids();
    let t = Instant::now();
    let name = format!("bench-{handler}-{n}");
    let pod = match handler.strip_suffix("-restored") {
        Some(h) => cri.run_pod_with(&name, h, false, &[("io.burrow.restore", CHECKPOINT)]),
        None => cri.run_pod(&name, handler),
    };
    let pod_s = t.elapsed().as_secs_f64();
    let first = cri
        .create_container(&pod, "c0", &forever)
        .unwrap_or_else(|e| panic!("{handler}: CreateContainer: {e}"));
    cri.start_container(&first);
    let first_started = t.elapsed().as_secs_f64();
    let e = cri.exec(&first, &["true"]);
    assert_eq!(e.code, 0, "{handler}: {e:?}");
    let first_exec = t.elapsed().as_secs_f64();
    for name in ["c1", "c2"] {
        let id = cri
            .create_container(&pod, name, &forever)
            .unwrap_or_else(|e| panic!("{handler}: CreateContainer {name}: {e}"));
        cri.start_container(&id);
    }
    let three = t.elapsed().as_secs_f64();
    let mib = added_mib(&before);
    let t = Instant::now();
    cri.remove_pod(&pod.id);
    Run {
        pod: pod_s,
        first_started,
        first_exec,
        three,
        mib,
        teardown: t.elapsed().as_secs_f64(),
    }
}

/// Checkpoint a three-container burrow pod as [`CHECKPOINT`]; returns the
/// seconds it took and the checkpoint's size on disk in MiB.
fn checkpoint_a_pod(cri: &Cri) -> (f64, f64) {
    let pod = cri.run_pod("bench-source", "burrow");
    for name in ["c0", "c1", "c2"] {
        let id = cri
            .create_container(&pod, name, &["sleep", "2147483647"])
            .unwrap_or_else(|e| panic!("CreateContainer {name}: {e}"));
        cri.start_container(&id);
    }
    let state = cri.containerd.burrow_state().display().to_string();
    let t = Instant::now();
    let r = cri.containerd.burrow(&[
        "sandbox", "--state-dir", &state, "-n", "k8s.io", "checkpoint", &pod.id, CHECKPOINT,
    ]);
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(r.code, Some(0), "burrow sandbox checkpoint: {r:?}");
    cri.remove_pod(&pod.id);
    let dir = cri.containerd.snapshot_dir().join(".checkpoints").join(CHECKPOINT);
    let du = std::process::Command::new("du")
        .args(["-s", "-k"])
        .arg(&dir)
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).split_whitespace().next()?.parse::<f64>().ok())
        .unwrap_or(0.0);
    (secs, du / 1024.0)
}

/// PSS in MiB of the processes `pids()` has beyond `before`.
fn added_mib(before: &BTreeSet<u32>) -> f64 {
    pids().difference(before).map(|&p| pss_kib(p)).sum::<u64>() as f64 / 1024.0
}

/// The pod's host memory (MiB): with one idle member, with a second that
/// filled 160 MiB under a 512 MiB limit, and 20 s after that one's
/// removal.
fn give_back(cri: &Cri, handler: &str) -> (f64, f64, f64) {
    const MIB: i64 = 1 << 20;
    let before = pids();
    let pod = cri.run_pod(&format!("bench-give-back-{handler}"), handler);
    let idle = cri
        .create_container(&pod, "idle", &["sleep", "2147483647"])
        .unwrap_or_else(|e| panic!("{handler}: CreateContainer idle: {e}"));
    cri.start_container(&idle);
    let with_one = added_mib(&before);
    let fill = format!(
        // A loop, not a last `sleep`: ash would exec that in its own place
        // and the string would be gone.
        "x=$(yes | head -c {}); touch /filled; while true; do sleep 3600; done",
        160 * MIB
    );
    let big = cri
        .create_container_with(
            &pod,
            "big",
            &["sh", "-c", &fill],
            Some(cri::LinuxContainerResources {
                memory_limit_in_bytes: 512 * MIB,
                ..Default::default()
            }),
        )
        .unwrap_or_else(|e| panic!("{handler}: CreateContainer big: {e}"));
    cri.start_container(&big);
    let t = Instant::now();
    while cri.exec(&big, &["test", "-e", "/filled"]).code != 0 {
        assert!(t.elapsed().as_secs() < 300, "{handler}: the big member never filled its memory");
        std::thread::sleep(std::time::Duration::from_millis(500));
    }
    let with_big = added_mib(&before);
    cri.stop_container(&big, 0);
    cri.remove_container(&big);
    std::thread::sleep(std::time::Duration::from_secs(20));
    let after = added_mib(&before);
    cri.remove_pod(&pod.id);
    (with_one, with_big, after)
}

fn stats(mut v: Vec<f64>, digits: usize) -> String {
    v.sort_by(f64::total_cmp);
    match (v.first(), v.get(v.len() / 2), v.last()) {
        (Some(a), Some(m), Some(z)) => format!("{a:.digits$} / {m:.digits$} / {z:.digits$}"),
        _ => "-".into(),
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut runs = 3usize;
    let mut handlers = Vec::new();
    let mut only_give_back = false;
    while let Some(a) = args.next() {
        match a.as_str() {
            "-n" => runs = args.next().and_then(|v| v.parse().ok()).unwrap_or(3),
            "--give-back" => only_give_back = true,
            h => handlers.push(h.to_string()),
        }
    }
    if handlers.is_empty() {
        handlers = vec!["runc".into(), "burrow".into()];
    }
    let mut checkpointed = None;
    if handlers.iter().any(|h| h == "burrow") && !only_give_back {
        handlers.push("burrow-restored".into());
        // Last: it needs a containerd of its own, and a process runs one
        // at a time (tests/src/containerd.rs), so the shared one goes first.
        handlers.push("burrow-copy".into());
    }
    let mut cri = Cri::start("bench-pods");
    if !only_give_back {
        println!(
            "| handler | RunPodSandbox (s) | + first container started (s) | + first ExecSync (s) | 3-container pod ready (s) | host memory of the 3-container pod (PSS, MiB) | stop + remove (s) |"
        );
        println!("| --- | --- | --- | --- | --- | --- | --- |");
        for h in &handlers {
            if h == "burrow-restored" {
                eprintln!("bench-pods: checkpointing a three-container burrow pod");
                checkpointed = Some(checkpoint_a_pod(&cri));
            }
            let handler = if h == "burrow-copy" {
                drop(cri);
                cri = Cri::start_with("bench-pods-copy", "pod_layer_slots = 0");
                "burrow"
            } else {
                h.as_str()
            };
            let mut all = Vec::new();
            for n in 0..runs {
                eprintln!("bench-pods: {h} run {}/{runs}", n + 1);
                all.push(one_run(&cri, handler, n));
            }
            let col = |f: fn(&Run) -> f64, d| stats(all.iter().map(f).collect(), d);
            println!(
                "| {h} | {} | {} | {} | {} | {} | {} |",
                col(|r| r.pod, 2),
                col(|r| r.first_started, 2),
                col(|r| r.first_exec, 2),
                col(|r| r.three, 2),
                col(|r| r.mib, 1),
                col(|r| r.teardown, 2),
            );
        }
        println!("\nmin / median / max of {runs} runs; times are cumulative from RunPodSandbox but the last.");
        if let Some((secs, mib)) = checkpointed {
            println!(
                "burrow-restored: pods started from one named checkpoint of a three-container pod (taken in {secs:.2} s, {mib:.1} MiB on disk); each container created takes over its checkpointed one."
            );
        }
    }
    let give = ["runc", "burrow"].into_iter().filter(|h| handlers.iter().any(|x| x == h));
    let mut header = false;
    for h in give {
        if !header {
            // burrow-copy left its own containerd running; a fresh one.
            drop(cri);
            cri = Cri::start("bench-pods-give-back");
            println!("\n| handler | host memory, one idle member (PSS, MiB) | + a member that filled 160 MiB | 20 s after that member's removal |");
            println!("| --- | --- | --- | --- |");
            header = true;
        }
        eprintln!("bench-pods: {h}, memory given back");
        let (one, big, after) = give_back(&cri, h);
        println!("| {h} | {one:.1} | {big:.1} | {after:.1} |");
    }
}
