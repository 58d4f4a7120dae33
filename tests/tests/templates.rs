//! Warm templates (issue 16), end to end through containerd and `ctr`: a
//! container started by restoring its VM shape's template behaves like a
//! cold one, copies of one template are each their own guest (entropy,
//! hostname, boot id), and a template whose inputs changed is rebuilt
//! rather than used. Prints cold and template start times. Run inside
//! hack/testhost (or on a host with hardware KVM).

#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use burrow_tests::containerd::{run, Containerd, CLEAN, NESTED_CONFIG};

/// The published templates in `dir` (not the private build directories).
fn templates(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| !n.starts_with('.'))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// Copy `from` to `to` through a new file (a new inode and mtime: to the
/// shim, a changed input).
fn replace_copy(from: &Path, to: &Path) {
    let tmp = to.with_extension("new");
    std::fs::copy(from, &tmp).unwrap();
    std::fs::rename(&tmp, to).unwrap();
}

const IDENTITY: &str =
    "hostname; cat /proc/sys/kernel/random/boot_id; head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'; echo";

#[test]
fn containers_from_a_template_start_warm_and_are_each_their_own() {
    // The VMM binary is a template input; a private copy lets the test
    // change it.
    let inputs = PathBuf::from(format!(
        "/run/burrow-test/template-inputs-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&inputs).unwrap();
    let vmm = inputs.join("burrow-vmm");
    replace_copy(&burrow_tests::workspace_bin("burrow-vmm"), &vmm);
    let tdir = inputs.join("templates");
    let c = Containerd::start(
        "templates",
        &format!(
            "templates = true\ntemplate_dir = {:?}\nvmm = {:?}\n{NESTED_CONFIG}",
            tdir.display().to_string(),
            vmm.display().to_string()
        ),
    );

    // Cold, asked for per container.
    let cold = c.ctr(&run(
        &["--rm", "--annotation", "io.burrow.template=off"],
        "t-cold",
        &["sh", "-c", "echo cold; exit 3"],
    ));
    assert_eq!(cold.code, Some(3), "{cold:?}\n{}", c.diagnostics());
    assert_eq!(cold.stdout.trim(), "cold", "{cold:?}");
    assert!(
        templates(&tdir).is_empty(),
        "a cold start builds no template"
    );

    // The first one of its shape builds the template and runs on that VM.
    let built = c.ctr(&run(
        &["--rm"],
        "t-build",
        &["sh", "-c", "echo built; exit 4"],
    ));
    assert_eq!(built.code, Some(4), "{built:?}\n{}", c.diagnostics());
    assert_eq!(built.stdout.trim(), "built", "{built:?}");
    let first = templates(&tdir);
    assert_eq!(first.len(), 1, "one template: {first:?}");
    assert_eq!(c.log_count("building template"), 1);

    // Restored: the same as a cold one to ctr, with its own identity.
    let warm = c.ctr(&run(
        &["--rm"],
        "t-warm",
        &["sh", "-c", "echo warm; exit 5"],
    ));
    assert_eq!(warm.code, Some(5), "{warm:?}\n{}", c.diagnostics());
    assert_eq!(warm.stdout.trim(), "warm", "{warm:?}");
    assert_eq!(
        c.log_count("created from a template (restored)"),
        1,
        "{}",
        c.diagnostics()
    );
    eprintln!(
        "ctr run --rm to exit: cold {:?}, building the template {:?}, from the template {:?}",
        cold.elapsed, built.elapsed, warm.elapsed
    );

    let mut seen = Vec::new();
    for id in ["t-a", "t-b"] {
        let r = c.ctr(&run(&["-d"], id, &["sleep", "1000"]));
        assert_eq!(r.code, Some(0), "{r:?}\n{}", c.diagnostics());
        c.wait_status(id, "RUNNING", Duration::from_secs(300));
        let out = c.exec_ok(id, "identity", &["sh", "-c", IDENTITY]);
        let lines: Vec<String> = out.lines().map(str::to_string).collect();
        assert_eq!(lines.len(), 3, "{out:?}");
        assert_eq!(lines[0], id, "the guest's hostname is the sandbox's id");
        assert_eq!(lines[1].len(), 36, "boot id {out:?}");
        assert_eq!(lines[2].len(), 64, "32 random bytes {out:?}");
        seen.push(lines);
    }
    assert_eq!(c.log_count("created from a template (restored)"), 3);
    for i in 0..3 {
        assert_ne!(
            seen[0][i], seen[1][i],
            "two copies of one template share line {i}: {seen:?}"
        );
    }
    for id in ["t-a", "t-b"] {
        let k = c.ctr(&["task", "kill", "-s", "SIGKILL", id]);
        assert_eq!(k.code, Some(0), "{k:?}");
    }
    for id in ["t-a", "t-b"] {
        c.wait_status(id, "STOPPED", Duration::from_secs(120));
        assert_eq!(c.ctr(&["task", "rm", id]).code, Some(0));
        assert_eq!(c.ctr(&["container", "rm", id]).code, Some(0));
    }

    // A changed input (the VMM binary): a new template replaces the old.
    replace_copy(&burrow_tests::workspace_bin("burrow-vmm"), &vmm);
    let again = c.ctr(&run(&["--rm"], "t-rebuilt", &["sh", "-c", "echo again"]));
    assert_eq!(again.code, Some(0), "{again:?}\n{}", c.diagnostics());
    assert_eq!(again.stdout.trim(), "again");
    assert_eq!(c.log_count("building template"), 2, "rebuilt, not reused");
    let second = templates(&tdir);
    assert_eq!(second.len(), 1, "the stale one is gone: {second:?}");
    assert_ne!(first, second);

    // `burrow template build` ahead of use: after another input change,
    // it builds the template the next `ctr run` restores (no container
    // pays for the build), and a second call finds it built.
    replace_copy(&burrow_tests::workspace_bin("burrow-vmm"), &vmm);
    let b = c.burrow(&["template", "build"]);
    assert_eq!(b.code, Some(0), "{b:?}\n{}", c.diagnostics());
    assert!(b.stdout.contains(" built in "), "{b:?}");
    let third = templates(&tdir);
    assert_eq!(
        third.len(),
        1,
        "the CLI's replaces the stale one: {third:?}"
    );
    assert_ne!(third, second);
    assert!(b.stdout.contains(&third[0]), "it names its key: {b:?}");
    let again = c.burrow(&["template", "build"]);
    assert_eq!(again.code, Some(0), "{again:?}");
    assert!(again.stdout.contains("already built"), "{again:?}");
    let ls = c.burrow(&["template", "ls"]);
    assert_eq!(ls.code, Some(0), "{ls:?}");
    assert!(
        ls.stdout.starts_with(&third[0]) && ls.stdout.contains("nic=true"),
        "{ls:?}"
    );
    let warm = c.ctr(&run(
        &["--rm"],
        "t-prebuilt",
        &["sh", "-c", "echo prebuilt"],
    ));
    assert_eq!(warm.code, Some(0), "{warm:?}\n{}", c.diagnostics());
    assert_eq!(warm.stdout.trim(), "prebuilt");
    assert_eq!(
        c.log_count("building template"),
        2,
        "the shim restored the CLI's template\n{}",
        c.diagnostics()
    );
    assert_eq!(c.log_count("created from a template (restored)"), 4);
    c.assert_clean(CLEAN);
    drop(c);
    let _ = std::fs::remove_dir_all(&inputs);
}

/// `/tmp/count` in container `id`: the counter its loop writes every second.
fn count(c: &Containerd, id: &str, exec_id: &str) -> u64 {
    let out = c.exec_ok(id, exec_id, &["cat", "/tmp/count"]);
    out.trim()
        .parse()
        .unwrap_or_else(|_| panic!("{id}: /tmp/count is {out:?}"))
}

#[test]
fn a_forked_sandbox_continues_in_three_independent_copies() {
    let c = Containerd::start("fork", NESTED_CONFIG);
    let counter = "i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 1; done";
    let r = c.ctr(&run(&["-d"], "src", &["sh", "-c", counter]));
    assert_eq!(r.code, Some(0), "{r:?}\n{}", c.diagnostics());
    c.wait_status("src", "RUNNING", Duration::from_secs(300));
    let mut before = 0;
    for _ in 0..120 {
        let r = c.ctr(&[
            "task",
            "exec",
            "--exec-id",
            "c0",
            "src",
            "cat",
            "/tmp/count",
        ]);
        if let Ok(v) = r.stdout.trim().parse::<u64>() {
            before = v;
            break;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    assert!(
        before > 0,
        "the source's counter never ran\n{}",
        c.diagnostics()
    );
    c.exec_ok("src", "mark", &["sh", "-c", "echo source > /marker"]);

    let socket = c.socket().display().to_string();
    let f = c.burrow(&["sandbox", "fork", "--address", &socket, "src", "3"]);
    assert_eq!(f.code, Some(0), "{f:?}\n{}", c.diagnostics());
    let copies: Vec<&str> = f.stdout.lines().collect();
    assert_eq!(copies, ["src-fork-1", "src-fork-2", "src-fork-3"], "{f:?}");
    let mut first = Vec::new();
    for id in &copies {
        c.wait_status(id, "RUNNING", Duration::from_secs(300));
        // The copy holds what the source wrote before the fork, and its
        // counter continues from the source's value (it did not restart).
        let marker = c.exec_ok(id, "m1", &["cat", "/marker"]);
        assert_eq!(marker.trim(), "source", "{id}");
        let v = count(&c, id, "c1");
        assert!(
            v >= before,
            "{id}: counter {v} is behind the source's {before}"
        );
        first.push(v);
        c.exec_ok(id, "w", &["sh", "-c", &format!("echo {id} > /marker")]);
    }
    // Each copy's write is its own: the others and the source keep theirs.
    for id in &copies {
        assert_eq!(c.exec_ok(id, "m2", &["cat", "/marker"]).trim(), *id);
    }
    assert_eq!(c.exec_ok("src", "m2", &["cat", "/marker"]).trim(), "source");

    // Killing the source leaves the copies running, their counters going.
    assert_eq!(
        c.ctr(&["task", "kill", "-s", "SIGKILL", "src"]).code,
        Some(0)
    );
    c.wait_status("src", "STOPPED", Duration::from_secs(120));
    assert_eq!(c.ctr(&["task", "rm", "src"]).code, Some(0));
    std::thread::sleep(Duration::from_secs(3));
    for (id, v0) in copies.iter().zip(&first) {
        assert_eq!(c.task_status(id).as_deref(), Some("RUNNING"), "{id}");
        let v = count(&c, id, "c2");
        assert!(v > *v0, "{id}: counter stuck at {v} (was {v0})");
    }
    for id in &copies {
        assert_eq!(c.ctr(&["task", "kill", "-s", "SIGKILL", id]).code, Some(0));
        c.wait_status(id, "STOPPED", Duration::from_secs(120));
        assert_eq!(c.ctr(&["task", "rm", id]).code, Some(0));
        assert_eq!(c.ctr(&["container", "rm", id]).code, Some(0));
    }
    assert_eq!(c.ctr(&["container", "rm", "src"]).code, Some(0));
    c.assert_clean(CLEAN);
}
