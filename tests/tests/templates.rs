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

/// Lines of containerd's log (which carries the shim's) containing `what`.
fn log_count(c: &Containerd, what: &str) -> usize {
    std::fs::read_to_string(c.dir.join("containerd.log"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(what))
        .count()
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
    assert_eq!(log_count(&c, "building template"), 1);

    // Restored: the same as a cold one to ctr, with its own identity.
    let warm = c.ctr(&run(
        &["--rm"],
        "t-warm",
        &["sh", "-c", "echo warm; exit 5"],
    ));
    assert_eq!(warm.code, Some(5), "{warm:?}\n{}", c.diagnostics());
    assert_eq!(warm.stdout.trim(), "warm", "{warm:?}");
    assert_eq!(
        log_count(&c, "created from a template (restored)"),
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
    assert_eq!(log_count(&c, "created from a template (restored)"), 3);
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
    assert_eq!(log_count(&c, "building template"), 2, "rebuilt, not reused");
    let second = templates(&tdir);
    assert_eq!(second.len(), 1, "the stale one is gone: {second:?}");
    assert_ne!(first, second);
    c.assert_clean(CLEAN);
    drop(c);
    let _ = std::fs::remove_dir_all(&inputs);
}
