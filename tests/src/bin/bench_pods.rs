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

use std::collections::BTreeSet;
use std::time::Instant;

use burrow_tests::cri::Cri;

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

fn one_run(cri: &Cri, handler: &str, n: usize) -> Run {
    let forever = ["sleep", "2147483647"];
    let before = pids();
    let t = Instant::now();
    let pod = cri.run_pod(&format!("bench-{handler}-{n}"), handler);
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
    let kib: u64 = pids().difference(&before).map(|&p| pss_kib(p)).sum();
    let t = Instant::now();
    cri.remove_pod(&pod.id);
    Run {
        pod: pod_s,
        first_started,
        first_exec,
        three,
        mib: kib as f64 / 1024.0,
        teardown: t.elapsed().as_secs_f64(),
    }
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
    while let Some(a) = args.next() {
        match a.as_str() {
            "-n" => runs = args.next().and_then(|v| v.parse().ok()).unwrap_or(3),
            h => handlers.push(h.to_string()),
        }
    }
    if handlers.is_empty() {
        handlers = vec!["runc".into(), "burrow".into()];
    }
    let cri = Cri::start("bench-pods");
    println!(
        "| handler | RunPodSandbox (s) | + first container started (s) | + first ExecSync (s) | 3-container pod ready (s) | host memory of the 3-container pod (PSS, MiB) | stop + remove (s) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for h in &handlers {
        let mut all = Vec::new();
        for n in 0..runs {
            eprintln!("bench-pods: {h} run {}/{runs}", n + 1);
            all.push(one_run(&cri, h, n));
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
}
