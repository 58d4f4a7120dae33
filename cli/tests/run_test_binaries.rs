//! hack/run-test-binaries' contract, tested with stand-in libtest binaries:
//! with BURROW_PARALLEL_JOBS=2 two binaries run at once, a binary never runs
//! beside its own second pass (a cold pass reuses its network names), each
//! job's output comes out whole, and a failure anywhere fails the run.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// A stand-in test binary: it logs "start LABEL T" and "end LABEL T"
/// (T in ms since the epoch) to `events`, sleeps, and passes or fails.
fn fake_binary(dir: &Path, name: &str, events: &Path, sleep: &str, status: i32) -> PathBuf {
    let path = dir.join(name);
    let script = format!(
        "#!/bin/sh\n\
         label=${{LABEL:-{name}}}\n\
         echo \"start $label $(date +%s%3N)\" >>{events}\n\
         echo \"{name} args: $*\"\n\
         sleep {sleep}\n\
         echo \"test {name}_test ... ok\"\n\
         echo \"end $label $(date +%s%3N)\" >>{events}\n\
         exit {status}\n",
        events = events.display()
    );
    std::fs::write(&path, script).expect("write a stand-in binary");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

/// (label, start ms, end ms) of each run the stand-ins logged.
fn spans(events: &Path) -> Vec<(String, u64, u64)> {
    let text = std::fs::read_to_string(events).expect("the stand-ins' events");
    let mut out: Vec<(String, u64, u64)> = Vec::new();
    for line in text.lines() {
        let mut f = line.split(' ');
        let (Some(kind), Some(label), Some(t)) = (f.next(), f.next(), f.next()) else {
            panic!("a bad event line: {line:?}");
        };
        let t: u64 = t.parse().expect("a time");
        match kind {
            "start" => out.push((label.to_string(), t, 0)),
            "end" => {
                let span = out
                    .iter_mut()
                    .find(|s| s.0 == label && s.2 == 0)
                    .unwrap_or_else(|| panic!("{label} ended without a start: {text}"));
                span.2 = t;
            }
            _ => panic!("a bad event line: {line:?}"),
        }
    }
    out
}

fn span<'a>(spans: &'a [(String, u64, u64)], label: &str) -> &'a (String, u64, u64) {
    spans
        .iter()
        .find(|s| s.0 == label)
        .unwrap_or_else(|| panic!("{label} never ran: {spans:?}"))
}

fn run(dir: &Path, jobs: &[String]) -> (std::process::ExitStatus, String) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(root.join("hack/run-test-binaries"))
        .arg(dir)
        .args(jobs)
        .args(["--", "--flag", "filt"])
        .env("BURROW_PARALLEL_JOBS", "2")
        .env_remove("BURROW_TESTS_DONE")
        .output()
        .expect("run hack/run-test-binaries");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status, text)
}

#[test]
fn two_binaries_run_at_once_but_never_one_beside_its_own_second_pass() {
    let dir = tempfile::tempdir().expect("tempdir");
    let events = dir.path().join("events");
    let a = fake_binary(dir.path(), "a", &events, "1", 0);
    let b = fake_binary(dir.path(), "b", &events, "1", 0);
    let c = fake_binary(dir.path(), "c", &events, "0.2", 0);
    let jobs = [
        format!("a|{}||LABEL=a", a.display()),
        format!("a-cold|{}|only_this|LABEL=a-cold", a.display()),
        format!("b|{}||LABEL=b", b.display()),
        format!("c|{}||LABEL=c", c.display()),
    ];
    let (status, text) = run(dir.path(), &jobs);
    assert!(status.success(), "{text}");
    let spans = spans(&events);
    let (a, cold, b) = (span(&spans, "a"), span(&spans, "a-cold"), span(&spans, "b"));
    // a-cold waits for a; b, next in line, runs beside a instead.
    assert!(b.1 < a.2 && a.1 < b.2, "a and b did not overlap: {spans:?}\n{text}");
    assert!(cold.1 >= a.2, "a-cold started before a ended: {spans:?}\n{text}");
    // Never more than two at once.
    for s in &spans {
        let beside = spans.iter().filter(|o| o.1 <= s.1 && s.1 < o.2).count();
        assert!(beside <= 2, "{} started with {beside} running: {spans:?}", s.0);
    }
    // Each job's output is one block: its Running line, its own lines, its
    // time line; the cold pass gets its own filter, the others the given one.
    for (label, name, args) in [
        ("a", "a", "--flag filt"),
        ("a-cold", "a", "--flag only_this"),
        ("b", "b", "--flag filt"),
        ("c", "c", "--flag filt"),
    ] {
        let block = format!(
            "     Running {label}\n{name} args: {args}\ntest {name}_test ... ok\nhack/run-test-binaries: {label}: "
        );
        assert!(text.contains(&block), "no whole block for {label}:\n{text}");
        // and its test said the moment it ended, before the block, with
        // how far into its job it ended
        let said = format!("hack/run-test-binaries: {label} finished test {name}_test ... ok (");
        let at = text.find(&said).unwrap_or_else(|| panic!("no progress line for {label}:\n{text}"));
        let rest = text[at + said.len()..].lines().next().unwrap_or("");
        let secs = rest.strip_suffix(" s into the job)").and_then(|n| n.parse::<u32>().ok());
        assert!(secs.is_some_and(|n| n <= 5), "{label}'s progress line has no time: {rest:?}");
        assert!(at < text.find(&block).unwrap_or(0), "{label}'s progress line after its block:\n{text}");
    }
}

#[test]
fn a_failed_binary_fails_the_run_and_the_others_still_run() {
    let dir = tempfile::tempdir().expect("tempdir");
    let events = dir.path().join("events");
    let bad = fake_binary(dir.path(), "bad", &events, "0.2", 101);
    let good = fake_binary(dir.path(), "good", &events, "0.5", 0);
    let after = fake_binary(dir.path(), "after", &events, "0.1", 0);
    let jobs = [bad, good, after].map(|p| p.display().to_string());
    let (status, text) = run(dir.path(), &jobs);
    assert_eq!(status.code(), Some(1), "{text}");
    assert!(
        text.lines().any(|l| l.starts_with("hack/run-test-binaries: bad: ") && l.ends_with(" s (failed)")),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l.starts_with("hack/run-test-binaries: good: ") && !l.contains("failed")),
        "{text}"
    );
    let spans = spans(&events);
    assert!(span(&spans, "after").2 > 0, "after did not finish: {text}");
}

/// A test host that dies mid-job takes hack/run-test-binaries down with no
/// EXIT trap: what each job had printed stays in the directory it names
/// first (on this machine's /tmp), the only record of a failing test's
/// message when the job never ended.
#[test]
fn a_jobs_output_so_far_stays_when_everything_is_killed() {
    use std::io::{BufRead, BufReader};
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let events = dir.path().join("events");
    let slow = fake_binary(dir.path(), "slow", &events, "60", 0);
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut child = Command::new(root.join("hack/run-test-binaries"))
        .arg(dir.path())
        .arg(&slow)
        .args(["--", "--flag", "filt"])
        .env_remove("BURROW_TESTS_DONE")
        .stdout(std::process::Stdio::piped())
        .process_group(0)
        .spawn()
        .expect("start hack/run-test-binaries");
    let pgid = child.id();
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut jobs = None;
    for line in lines.by_ref() {
        let line = line.expect("a line");
        if let Some(rest) = line.strip_prefix("hack/run-test-binaries: each job's output as it comes: ") {
            jobs = rest.strip_suffix("/LABEL").map(PathBuf::from);
            break;
        }
    }
    // Keep reading, as the test host's share does (a closed pipe would end it).
    std::thread::spawn(move || lines.for_each(drop));
    let jobs = jobs.expect("hack/run-test-binaries names its jobs' output directory first");
    let file = jobs.join("slow");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !std::fs::read_to_string(&file).unwrap_or_default().contains("slow args: --flag filt") {
        assert!(std::time::Instant::now() < deadline, "{} never held the job's output", file.display());
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    let killed = Command::new("kill").args(["-KILL", "--", &format!("-{pgid}")]).status().expect("kill");
    assert!(killed.success());
    let _ = child.wait();
    let kept = std::fs::read_to_string(&file).unwrap_or_default();
    let _ = std::fs::remove_dir_all(&jobs);
    assert!(kept.contains("     Running slow\nslow args: --flag filt\n"), "kept: {kept:?}");
}
