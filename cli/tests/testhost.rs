//! hack/testhost's contract, tested from this machine: a command's stdout,
//! stderr and exit status come back; a hung test host is killed at its
//! timeout; a missing kernel is refused with a message that says what to do.

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

/// One test host at a time per machine (hack/testhost's lock): the tests in
/// this file take turns, so that none of them times another one's boot.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn turn() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// stderr less hack/testhost's note that it waited for another test host.
fn stderr_of(out: &std::process::Output) -> String {
    without_lock_note(&String::from_utf8_lossy(&out.stderr))
}

/// hack/run-vm-binary's output: the attempt's stdout and stderr together.
fn output_of(out: &std::process::Output) -> String {
    without_lock_note(&format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    ))
}

fn without_lock_note(text: &str) -> String {
    text.lines()
        .filter(|l| !l.starts_with("testhost: waiting for another test host"))
        .map(|l| format!("{l}\n"))
        .collect()
}

fn testhost() -> Command {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut cmd = Command::new(root.join("hack/testhost"));
    cmd.current_dir(root);
    cmd
}

#[test]
fn command_output_and_status_come_back() {
    let _turn = turn();
    let out = testhost()
        .args(["--", "sh", "-c", "echo out; echo err >&2; test -c /dev/kvm && grep -qw svm /proc/cpuinfo && exit 7"])
        .output()
        .expect("run hack/testhost");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = stderr_of(&out);
    assert_eq!(out.status.code(), Some(7), "stdout: {stdout}\nstderr: {stderr}");
    assert_eq!(stdout, "out\n");
    assert!(stderr.starts_with("err\n"), "stderr: {stderr}");
}

/// A command that hangs in a healthy test host is killed at the timeout
/// (exit 124) and, being a failure of ours, not retried.
#[test]
fn a_hung_test_host_is_killed_at_its_timeout_and_not_retried() {
    let _turn = turn();
    let dir = tempfile::tempdir().expect("tempdir");
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let start = Instant::now();
    // No lock: a wait for another test host on this machine would count
    // against the time this test measures.
    let out = Command::new(root.join("hack/run-vm-binary"))
        .current_dir(&root)
        .env("TESTHOST_LOCK", "none")
        .env("BURROW_TEST_LOGS", dir.path().join("logs"))
        .env("BURROW_RETRIES", dir.path().join("retries"))
        .args(["--timeout", "20", "selftest", "--", "sleep", "600"])
        .output()
        .expect("run hack/run-vm-binary");
    let stderr = output_of(&out);
    assert_eq!(out.status.code(), Some(124), "{stderr}");
    assert!(stderr.contains("timed out after 20s"), "{stderr}");
    assert!(stderr.contains("with the test host healthy"), "{stderr}");
    assert!(!stderr.contains("once more"), "{stderr}");
    assert!(start.elapsed() < Duration::from_secs(60), "took {:?}", start.elapsed());
    assert_eq!(retry_lines(dir.path()), Vec::<String>::new(), "no retry");
}

/// A test host whose heartbeat stops is frozen: exit 75, and since its
/// console says nothing, the report says where QEMU's CPUs were (each
/// vCPU thread's CPU use, each emulated CPU's RIP). A 3 s limit makes the
/// gap between two 5 s beats look like a freeze.
#[test]
fn a_frozen_test_host_is_reported_with_where_its_cpus_were() {
    let _turn = turn();
    let out = testhost()
        .env("TESTHOST_LOCK", "none")
        .env("TESTHOST_HEARTBEAT_LIMIT", "3")
        .args(["--smp", "2", "--timeout", "120", "--", "sleep", "600"])
        .output()
        .expect("run hack/testhost");
    let stderr = stderr_of(&out);
    assert_eq!(out.status.code(), Some(75), "stderr: {stderr}");
    assert!(stderr.contains("testhost: trouble: frozen"), "stderr: {stderr}");
    for want in ["CPU 0/TCG: ", "CPU 1/TCG: ", "CPU#0", "CPU#1"] {
        assert!(stderr.contains(want), "no {want:?} in the report\nstderr: {stderr}");
    }
    assert_eq!(
        stderr.matches("RIP=").count(),
        2,
        "one RIP per emulated CPU\nstderr: {stderr}"
    );
    // Each RIP named from the kernel's symbols (`RIP …: native_safe_halt+0xb
    // (interrupts on)` for this idle one), unless this was the first boot of
    // this kernel, which only now wrote them.
    let named = stderr.matches("(interrupts ").count();
    assert!(
        named == 2 || stderr.contains("no kernel symbols in"),
        "RIPs neither named nor said why\nstderr: {stderr}"
    );
}

#[test]
fn a_missing_kernel_is_refused_with_what_to_do() {
    let _turn = turn();
    let out = testhost()
        .env("BURROW_CACHE", "/nonexistent/burrow-cache")
        .args(["--", "true"])
        .output()
        .expect("run hack/testhost");
    let stderr = stderr_of(&out);
    assert_eq!(out.status.code(), Some(2), "stderr: {stderr}");
    assert!(stderr.contains("hack/testhost --prepare"), "stderr: {stderr}");
}

/// hack/run-vm-binary with its logs and retry record in a fresh directory.
fn run_vm_binary(dir: &std::path::Path, script: &str) -> std::process::Output {
    run_vm_binary_with(dir, script, &[])
}

fn run_vm_binary_with(dir: &std::path::Path, script: &str, env: &[(&str, &str)]) -> std::process::Output {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    Command::new(root.join("hack/run-vm-binary"))
        .current_dir(&root)
        .envs(env.iter().copied())
        .env("BURROW_TEST_LOGS", dir.join("logs"))
        .env("BURROW_RETRIES", dir.join("retries"))
        .args(["--timeout", "300", "selftest", "--", "sh", "-c", script])
        .output()
        .expect("run hack/run-vm-binary")
}

#[test]
fn a_test_host_soft_lockup_is_detected_within_90s_and_retried_once() {
    let _turn = turn();
    let cache = testhost().arg("--print-cache").output().expect("hack/testhost --print-cache");
    let cache = String::from_utf8_lossy(&cache.stdout).trim().to_string();
    let module = PathBuf::from(cache).join("current/burrow_lockup.ko");
    assert!(
        module.exists(),
        "{} is missing: hack/testhost --prepare builds it (needs Debian's linux-headers for the test-host kernel)",
        module.display()
    );
    let dir = tempfile::tempdir().expect("tempdir");
    // Attempt 1 makes the test host's own kernel spin with preemption off
    // (a soft lockup, as QEMU's emulated SVM causes); attempt 2 is healthy.
    let script = format!(
        "if [ \"$BURROW_TESTHOST_ATTEMPT\" = 1 ]; then insmod {} seconds=200; fi; echo attempt $BURROW_TESTHOST_ATTEMPT done",
        module.display()
    );
    let out = run_vm_binary(dir.path(), &script);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = stderr_of(&out);
    let all = format!("stdout: {stdout}\nstderr: {stderr}");
    assert_eq!(out.status.code(), Some(0), "{all}");
    assert!(stdout.contains("attempt 2 done") && !stdout.contains("attempt 1 done"), "{all}");
    let retries = std::fs::read_to_string(dir.path().join("retries")).expect("retry record");
    let lines: Vec<&str> = retries.lines().collect();
    assert_eq!(lines.len(), 1, "exactly one retry: {retries:?}\n{all}");
    assert!(
        lines[0] == "selftest soft lockup" || lines[0] == "selftest RCU stall",
        "the cause is the test host's lockup: {retries:?}"
    );
    // The first attempt's log is kept, and says when the trouble was seen.
    let kept: Vec<_> = std::fs::read_dir(dir.path().join("logs"))
        .expect("kept logs")
        .filter_map(|e| e.ok())
        .collect();
    assert_eq!(kept.len(), 1, "one kept log");
    let first = std::fs::read_to_string(kept[0].path()).expect("read the kept log");
    let after: u64 = first
        .split("is in trouble after ")
        .nth(1)
        .and_then(|s| s.split('s').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the first attempt's log says when: {first}"));
    assert!(after <= 90, "detected {after} s after the test host started: {first}");
    assert!(stderr.contains("running selftest once more"), "{all}");
}

/// A stand-in for hack/testhost (BURROW_TESTHOST) that runs the command
/// here and passes its status on, for the tests of hack/run-vm-binary's
/// retry accounting: the real test host's trouble detection has its own
/// tests above (a real soft lockup, a real freeze), and a boot per attempt
/// would cost about 15 s each.
fn stand_in_testhost(dir: &std::path::Path) -> (&'static str, String) {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("testhost");
    std::fs::write(&path, "#!/bin/sh\nwhile [ \"$1\" != -- ]; do shift; done\nshift\nexec \"$@\"\n")
        .expect("write the stand-in test host");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    ("BURROW_TESTHOST", path.display().to_string())
}

/// A script whose attempts up to `bad` end as hack/testhost ends one whose
/// kernel soft-locked: its trouble line, exit 75.
fn fake_lockup_until(bad: u32) -> String {
    format!(
        "if [ \"$BURROW_TESTHOST_ATTEMPT\" -le {bad} ]; then \
         echo 'testhost: trouble: soft lockup' >&2; exit 75; fi; \
         echo attempt $BURROW_TESTHOST_ATTEMPT done"
    )
}

fn retry_lines(dir: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("retries")).unwrap_or_default().lines().map(str::to_string).collect()
}

/// CI saw one binary's test host freeze twice in a row, and a run here
/// saw each of its three groups' first test host in trouble: a group gets
/// three retries, each recorded, each attempt's log kept. A retry runs only
/// the tests that had not finished (BURROW_TESTS_DONE), shows the earlier
/// attempts' results, and a test that failed before a freeze stays failed.
#[test]
fn a_group_gets_three_retries_for_test_host_trouble() {
    let _turn = turn();
    let dir = tempfile::tempdir().expect("tempdir");
    // Attempt 1 finishes test a1 and fails b, attempt 2 finishes a2, each
    // as libtest prints them, before its test host locks up. Attempt 2 also
    // has a job beside it that had finished test c when the test host died,
    // said only by hack/run-test-binaries' progress line (its block comes at
    // its end), and a2 said both ways: carried once each.
    let script = format!(
        "echo '     Running fake-0123'; \
         echo \"test a$BURROW_TESTHOST_ATTEMPT ... ok\"; \
         if [ \"$BURROW_TESTHOST_ATTEMPT\" = 1 ]; then echo 'test b ... FAILED'; fi; \
         if [ \"$BURROW_TESTHOST_ATTEMPT\" = 2 ]; then \
           echo 'hack/run-test-binaries: fake-0123 finished test a2 ... ok'; \
           echo 'hack/run-test-binaries: beside finished test c ... ok (12 s into the job)'; fi; \
         echo \"done:$BURROW_TESTS_DONE.\"; {}",
        fake_lockup_until(3)
    );
    let (var, stand_in) = stand_in_testhost(dir.path());
    let out = run_vm_binary_with(dir.path(), &script, &[(var, &stand_in)]);
    let all = output_of(&out);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "b failed in attempt 1: {all}");
    assert!(all.contains("attempt 4 done"), "{all}");
    assert!(
        stdout.contains("done: fake-0123:a1 fake-0123:b fake-0123:a2 beside:c fake-0123:a3."),
        "attempt 4 skips a1, b, a2, beside's c and a3: {all}"
    );
    for line in ["test a1 ... ok", "test b ... FAILED", "test a2 ... ok", "test c ... ok", "test a3 ... ok", "test a4 ... ok"] {
        assert!(stdout.lines().any(|l| l == line), "{line:?} shown: {all}");
    }
    assert!(
        stdout.contains("test result: FAILED. 4 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in earlier attempts"),
        "{all}"
    );
    assert_eq!(retry_lines(dir.path()), ["selftest soft lockup"; 3], "{all}");
    let kept = std::fs::read_dir(dir.path().join("logs")).expect("kept logs").count();
    assert_eq!(kept, 3, "attempts 1 to 3 kept: {all}");
}

/// Past its three retries a group's trouble is a failure (exit 75) that
/// says so, with the run's budget left.
#[test]
fn a_group_in_trouble_a_fourth_time_fails_and_says_why() {
    let _turn = turn();
    let dir = tempfile::tempdir().expect("tempdir");
    let (var, stand_in) = stand_in_testhost(dir.path());
    let out = run_vm_binary_with(dir.path(), &fake_lockup_until(9), &[(var, &stand_in)]);
    let all = output_of(&out);
    assert_eq!(out.status.code(), Some(75), "{all}");
    assert!(!all.contains("done"), "{all}");
    assert!(all.contains("already had 3 retries (BURROW_TESTHOST_RETRIES): giving up"), "{all}");
    assert_eq!(retry_lines(dir.path()), ["selftest soft lockup"; 3], "{all}");
}

/// A run's retries are bounded: with the budget spent, trouble is a
/// failure (exit 75) that says so, not one more test host.
#[test]
fn test_host_trouble_past_the_retry_budget_fails_and_says_why() {
    let _turn = turn();
    let dir = tempfile::tempdir().expect("tempdir");
    // An earlier binary of the run spent the one retry allowed.
    std::fs::write(dir.path().join("retries"), "earlier frozen\n").expect("retry record");
    let (var, stand_in) = stand_in_testhost(dir.path());
    let out = run_vm_binary_with(
        dir.path(),
        &fake_lockup_until(9),
        &[("BURROW_RETRY_BUDGET", "1"), (var, &stand_in)],
    );
    let all = output_of(&out);
    assert_eq!(out.status.code(), Some(75), "{all}");
    assert!(!all.contains("done"), "{all}");
    assert!(all.contains("already spent its 1 retries (BURROW_RETRY_BUDGET): giving up"), "{all}");
    assert_eq!(retry_lines(dir.path()), ["earlier frozen"], "{all}");
}

#[test]
fn a_failure_of_ours_is_not_retried_even_a_guest_triple_fault() {
    let _turn = turn();
    let dir = tempfile::tempdir().expect("tempdir");
    // What burrow-vmm prints when its guest triple-faults, then a failed
    // test: the test host is healthy, so the failure stands.
    let out = run_vm_binary(
        dir.path(),
        "echo 'vcpu0: guest triple fault: rip=0x0' >&2; echo 'burrow-vmm: guest triple-faulted (CPU shutdown)' >&2; exit 101",
    );
    let stderr = output_of(&out);
    assert_eq!(out.status.code(), Some(101), "{stderr}");
    assert!(stderr.contains("guest triple-faulted"), "{stderr}");
    assert!(!stderr.contains("once more"), "{stderr}");
    let retries = std::fs::read_to_string(dir.path().join("retries")).unwrap_or_default();
    assert_eq!(retries, "", "no retry");
}

/// A stand-in libtest binary for hack/run-test-binaries inside the
/// stand-in test host: `fine` passes, `ours` fails with a message of ours,
/// `cpu` fails in attempt 1 with a guest console that shows the test
/// host's CPU fault (tests/src/cpu_fault.rs) and passes after. It runs the
/// tests named after `--exact`, else all, and answers `--list`.
fn fake_libtest(dir: &std::path::Path) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("fake");
    let script = r#"#!/bin/bash
if [[ $1 == --list ]]; then printf 'cpu: test\nfine: test\nours: test\n'; exit 0; fi
tests=(cpu fine ours)
for ((i = 1; i <= $#; i++)); do
    [[ ${!i} == --exact ]] && tests=("${@:i+1}")
done
echo "running ${#tests[@]} tests"
failed=()
for t in "${tests[@]}"; do
    if [[ $t == ours || ( $t == cpu && $BURROW_TESTHOST_ATTEMPT == 1 ) ]]; then
        echo "test $t ... FAILED"; failed+=("$t")
    else
        echo "test $t ... ok"
    fi
done
((${#failed[@]})) || { echo "test result: ok."; exit 0; }
printf '\nfailures:\n\n'
for t in "${failed[@]}"; do
    echo "---- $t stdout ----"
    if [[ $t == cpu ]]; then
        echo "a computing guest went to sleep"
        echo "burrow-tests: test-host CPU fault: /run/x/console.log: asm_sysvec_apic_timer_interrupt was entered again"
    else
        echo "assertion failed: ours"
    fi
    echo
done
printf '\nfailures:\n'
printf '    %s\n' "${failed[@]}"
echo "test result: FAILED."
exit 101
"#;
    std::fs::write(&path, script).expect("write the stand-in libtest binary");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

/// A test that failed on the test host's emulated CPU (a guest console
/// with an interrupt delivered twice) runs once more in a fresh test host,
/// alone, as a retry the record shows; a failure of ours beside it in the
/// same binary stays failed and is not run again.
#[test]
fn a_test_failed_on_the_test_hosts_cpu_fault_runs_again_and_ours_stays_failed() {
    let _turn = turn();
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = fake_libtest(dir.path());
    let (var, stand_in) = stand_in_testhost(dir.path());
    let script = format!("exec hack/run-test-binaries {} {} --", dir.path().display(), fake.display());
    let out = run_vm_binary_with(dir.path(), &script, &[(var, &stand_in), ("TESTHOST", "1")]);
    let all = output_of(&out);
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert_eq!(out.status.code(), Some(1), "ours failed: {all}");
    assert_eq!(
        retry_lines(dir.path()),
        ["selftest CPU fault in a guest (an interrupt delivered twice)"],
        "{all}"
    );
    assert!(stdout.contains("fake: 1 of 3 tests left after the earlier attempt"), "only cpu again: {all}");
    for line in ["test cpu ... ok", "test fine ... ok", "test ours ... FAILED"] {
        assert!(stdout.lines().any(|l| l == line), "{line:?} shown: {all}");
    }
    assert!(!stdout.lines().any(|l| l == "test cpu ... FAILED"), "cpu's first failure is not carried: {all}");
    assert!(
        stdout.contains("test result: FAILED. 1 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out; finished in earlier attempts"),
        "{all}"
    );
    assert!(all.contains("test-host CPU fault in fake:cpu"), "{all}");
}

/// With hardware KVM (no test host) the same console is a plain failure.
#[test]
fn outside_a_test_host_the_cpu_fault_is_a_plain_failure() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = fake_libtest(dir.path());
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = Command::new(root.join("hack/run-test-binaries"))
        .arg(dir.path())
        .arg(&fake)
        .arg("--")
        .env_remove("TESTHOST")
        .env_remove("BURROW_TESTS_DONE")
        .env("BURROW_TESTHOST_ATTEMPT", "1")
        .output()
        .expect("run hack/run-test-binaries");
    let all = output_of(&out);
    assert_eq!(out.status.code(), Some(1), "{all}");
    assert!(all.contains("fake:cpu failed with a guest console that looks like"), "{all}");
    assert!(!all.contains("test-host CPU fault in"), "{all}");
}
