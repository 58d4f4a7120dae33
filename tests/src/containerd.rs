//! A private containerd for one test: its own root, state, socket and
//! burrow config on scratch space, with the workspace's shim on its PATH and
//! the locally built busybox image imported. Dropping it kills containerd,
//! every shim and VMM it started, and removes its directories.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The image every test runs (built by tests/images/busybox).
pub const IMAGE: &str = "docker.io/library/busybox:latest";
/// The runtime under test.
pub const RUNTIME: &str = "io.containerd.burrow.v2";

/// One containerd test at a time: each boots VMs in a nested, software-CPU
/// test host with two vCPUs, and parallel ones only slow each other down.
static SERIAL: Mutex<()> = Mutex::new(());

pub struct Containerd {
    child: Child,
    _serial: MutexGuard<'static, ()>,
    /// Scratch directory: configs, socket, logs, burrow's state dir.
    pub dir: PathBuf,
    /// containerd's root (snapshots, content); on a filesystem overlayfs
    /// accepts as an upper dir.
    pub root: PathBuf,
    /// burrow's `image_dir` (containers' rootfs images), off `/run`.
    images: PathBuf,
    /// burrow's `layer_cache_dir`, on the same file system as `images` (as
    /// on a host where both are under /var): a pod's shared image layer is
    /// a hard link into the cache.
    layers: PathBuf,
    pub socket: PathBuf,
}

/// What one `ctr` call did.
#[derive(Debug)]
pub struct Run {
    pub code: Option<i32>,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
    /// Killed for taking longer than its limit.
    pub timed_out: bool,
}

impl Run {
    fn from(out: Output, elapsed: Duration, timed_out: bool) -> Self {
        Self {
            timed_out,
            code: out.status.code(),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            elapsed,
        }
    }
}

/// Wait for `child` at most `limit`; kill it if it takes longer.
pub fn wait_output(mut child: Child, limit: Duration) -> (Output, bool) {
    // Both pipes are read while the child runs: one that writes more than
    // a pipe holds (64 KiB) would otherwise block forever on it.
    fn drain(
        pipe: Option<impl std::io::Read + Send + 'static>,
    ) -> Option<std::thread::JoinHandle<Vec<u8>>> {
        pipe.map(|mut p| {
            std::thread::spawn(move || {
                let mut buf = Vec::new();
                let _ = p.read_to_end(&mut buf);
                buf
            })
        })
    }
    let stdout = drain(child.stdout.take());
    let stderr = drain(child.stderr.take());
    let start = Instant::now();
    let mut killed = false;
    let status = loop {
        match child.try_wait() {
            Ok(Some(st)) => break st,
            Err(_) => break child.wait().expect("collect child output"),
            Ok(None) if start.elapsed() > limit => {
                let _ = child.kill();
                killed = true;
                break child.wait().expect("collect a killed child");
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(100)),
        }
    };
    let collect = |h: Option<std::thread::JoinHandle<Vec<u8>>>| {
        h.map(|h| h.join().unwrap_or_default()).unwrap_or_default()
    };
    let out = Output {
        status,
        stdout: collect(stdout),
        stderr: collect(stderr),
    };
    (out, killed)
}

/// burrow config for the ctr suites in the nested test host: guests boot
/// slowly there (QEMU TCG), most of all several at once, so the timeouts
/// are generous; 256 MiB guests.
pub const NESTED_CONFIG: &str =
    "agent_timeout_secs = 60\nboot_timeout_secs = 900\n[memory_mib]\ndefault = 256\n";

/// How long a nested guest may take to get somewhere (tests assert no
/// timings), and how long a finished test's cleanup may take.
pub const LONG: Duration = Duration::from_secs(900);
pub const CLEAN: Duration = Duration::from_secs(60);

/// Set to `0` to run every containerd test with warm templates off
/// (burrow's `templates = false`, every VM a cold boot); by default they run
/// as burrow's default, templates on, so the suite checks that a container
/// from a template behaves as users get it and hack/test's cold pass that a
/// cold one behaves the same.
pub const TEMPLATES_ENV: &str = "BURROW_TEST_TEMPLATES";
/// Where the tests' templates go: shared by the tests of one test-host run
/// (a template is keyed by its inputs, so sharing is safe), outside what
/// [`Containerd::leftovers`] checks.
pub const TEMPLATE_DIR: &str = "/run/burrow-test/templates";

/// Whether this run's containerd tests have warm templates on (burrow's
/// default; [`TEMPLATES_ENV`] `0` turns them off).
pub fn templates_on() -> bool {
    std::env::var(TEMPLATES_ENV).map_or(true, |v| v != "0")
}

/// The template lines of a burrow config: none when `extra_config` sets
/// `templates` itself, off when [`TEMPLATES_ENV`] is `0`, else burrow's
/// default (on) with the tests' template directory.
fn templates_config(extra_config: &str) -> String {
    if extra_config.contains("templates") {
        return String::new();
    }
    if std::env::var(TEMPLATES_ENV).is_ok_and(|v| v == "0") {
        return "templates = false\n".into();
    }
    format!("template_dir = {TEMPLATE_DIR:?}\n")
}

/// `ctr run` arguments: see [`Containerd::run_args`].
pub fn run<'a>(flags: &[&'a str], id: &'a str, cmd: &[&'a str]) -> Vec<&'a str> {
    Containerd::run_args(flags, id, cmd)
}

impl Containerd {
    /// containerd with [`NESTED_CONFIG`] for test `name`.
    pub fn nested(name: &str) -> Self {
        Self::start(name, NESTED_CONFIG)
    }

    /// Start containerd for test `name` with burrow's `extra_config` lines
    /// appended to the generated burrow config.
    pub fn start(name: &str, extra_config: &str) -> Self {
        Self::start_with(name, extra_config, "")
    }

    /// Like [`start`](Self::start), with `containerd_extra` (TOML, e.g. a
    /// snapshotter's `[plugins."..."]` table) appended to containerd's own
    /// config.
    pub fn start_with(name: &str, extra_config: &str, containerd_extra: &str) -> Self {
        crate::require_hardware_kvm();
        let serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let kernel = crate::asset_from_env("BURROW_GUEST_KERNEL", "guest-kernel/build");
        let initrd = crate::asset_from_env("BURROW_AGENT_INITRD", "rootfs/build");
        let image = crate::asset_from_env("BURROW_BUSYBOX_IMAGE", "tests/images/busybox");
        let shim = crate::workspace_bin("containerd-shim-burrow-v2");
        crate::workspace_bin("burrow-vmm");
        assert!(
            which("containerd") && which("ctr"),
            "containerd and ctr are missing: apt-get install containerd (hack/setup --deps does)"
        );
        let unique = format!("{name}-{}", std::process::id());
        // /run is a tmpfs in hack/testhost and on most hosts; containerd's
        // overlayfs snapshots need a non-overlay upper.
        let dir = PathBuf::from("/run/burrow-test").join(&unique);
        let root = PathBuf::from("/var/lib/containerd").join(format!("burrow-test-{unique}"));
        // burrow's default image_dir is under /var/lib/burrow (a tmpfs of
        // its own in hack/testhost); one per test, as for everything else.
        let images = PathBuf::from("/var/lib/burrow/test-images").join(&unique);
        let _ = std::fs::remove_dir_all(&images);
        let layers = PathBuf::from("/var/lib/burrow/test-layers").join(&unique);
        let _ = std::fs::remove_dir_all(&layers);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the test's scratch dir");
        std::fs::create_dir_all(&root).expect("create containerd's root");
        let socket = dir.join("containerd.sock");
        let burrow_config = dir.join("burrow.toml");
        std::fs::write(
            &burrow_config,
            format!(
                "kernel = {:?}\ninitrd = {:?}\nstate_dir = {:?}\nsnapshot_dir = {:?}\nimage_dir = {:?}\nlayer_cache_dir = {:?}\n{}{extra_config}\n",
                kernel.display().to_string(),
                initrd.display().to_string(),
                dir.join("burrow").display().to_string(),
                dir.join("snapshots").display().to_string(),
                images.display().to_string(),
                layers.display().to_string(),
                templates_config(extra_config),
            ),
        )
        .expect("write burrow config");
        let containerd_config = dir.join("containerd.toml");
        std::fs::write(
            &containerd_config,
            format!(
                "version = 2\nroot = {:?}\nstate = {:?}\n[grpc]\n  address = {:?}\n[ttrpc]\n  address = {:?}\n{containerd_extra}\n",
                root.display().to_string(),
                dir.join("state").display().to_string(),
                socket.display().to_string(),
                dir.join("containerd.ttrpc.sock").display().to_string(),
            ),
        )
        .expect("write containerd config");
        let child = launch(&dir, &shim);
        let c = Self {
            child,
            _serial: serial,
            dir,
            root,
            images,
            layers,
            socket,
        };
        c.wait_ready();
        let r = c.ctr(&["images", "import", &image.display().to_string()]);
        assert_eq!(
            r.code,
            Some(0),
            "ctr images import: {r:?}\n{}",
            c.diagnostics()
        );
        c
    }

    /// Wait until containerd answers `ctr version`.
    fn wait_ready(&self) {
        let start = Instant::now();
        while self
            .try_ctr(&["version"], None, Duration::from_secs(10))
            .code
            != Some(0)
        {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "containerd did not answer in 60 s\n{}",
                self.diagnostics()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Stop containerd (SIGTERM, as a service manager does) and start it
    /// again on the same root, state and config; the shims it started keep
    /// running and the new containerd reconnects to them.
    pub fn restart(&mut self) {
        // SAFETY: kill(2) has no memory-safety preconditions.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let start = Instant::now();
        while self.child.try_wait().ok().flatten().is_none() {
            if start.elapsed() > Duration::from_secs(30) {
                let _ = self.child.kill();
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.child.wait();
        self.child = launch(
            &self.dir,
            &crate::workspace_bin("containerd-shim-burrow-v2"),
        );
        self.wait_ready();
    }

    /// The ttrpc address (`unix://...`) of the shim serving task `id`, as
    /// the shim wrote it into the task's bundle for containerd.
    pub fn shim_address(&self, id: &str) -> String {
        let p = self
            .dir
            .join("state/io.containerd.runtime.v2.task/default")
            .join(id)
            .join("address");
        let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        s.trim().to_string()
    }

    /// Pids of the running (not zombie) shim processes this containerd
    /// started for task `id`.
    pub fn shim_pids(&self, id: &str) -> Vec<i32> {
        let socket = self.socket.display().to_string();
        processes_mentioning(&socket)
            .into_iter()
            .filter(|(pid, cmdline)| {
                let args: Vec<&str> = cmdline.split_whitespace().collect();
                cmdline.contains("containerd-shim-burrow-v2")
                    && args.windows(2).any(|w| w == ["-id", id])
                    && !is_zombie(*pid)
            })
            .map(|(pid, _)| pid)
            .collect()
    }

    /// The live shim daemons and burrow-vmm processes this containerd's
    /// tasks run: (pid, command line).
    pub fn burrow_processes(&self) -> Vec<(i32, String)> {
        let socket = self.socket.display().to_string();
        let shims = processes_mentioning(&socket)
            .into_iter()
            .filter(|(_, c)| c.contains("containerd-shim-burrow-v2") && !c.ends_with(" start"));
        let state = self.burrow_state().display().to_string();
        let vmms = processes_mentioning(&state)
            .into_iter()
            .filter(|(_, c)| c.contains("burrow-vmm"));
        shims
            .chain(vmms)
            .filter(|(pid, _)| !is_zombie(*pid))
            .collect()
    }

    fn command(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("ctr");
        cmd.arg("--address").arg(&self.socket).args(args);
        cmd
    }

    /// `ctr task exec --exec-id EXEC_ID ID CMD...` that must succeed; its
    /// stdout.
    pub fn exec_ok(&self, id: &str, exec_id: &str, cmd: &[&str]) -> String {
        let mut args = vec!["task", "exec", "--exec-id", exec_id, id];
        args.extend_from_slice(cmd);
        let r = self.ctr(&args);
        assert_eq!(
            r.code,
            Some(0),
            "exec {cmd:?} in {id}: {r:?}\n{}",
            self.diagnostics()
        );
        r.stdout
    }

    /// Run `ctr ARGS` with no stdin, at most 10 minutes.
    pub fn ctr(&self, args: &[&str]) -> Run {
        self.ctr_with(args, None, Duration::from_secs(600))
    }

    /// Run `ctr ARGS`, feeding `stdin` if given, killed after `limit`.
    pub fn ctr_with(&self, args: &[&str], stdin: Option<&[u8]>, limit: Duration) -> Run {
        let r = self.try_ctr(args, stdin, limit);
        assert!(
            !r.timed_out,
            "ctr {args:?} did not finish in {limit:?}\n{}",
            self.diagnostics()
        );
        r
    }

    /// Like [`ctr_with`](Self::ctr_with) but reports a timeout instead of
    /// panicking.
    pub fn try_ctr(&self, args: &[&str], stdin: Option<&[u8]>, limit: Duration) -> Run {
        let start = Instant::now();
        let mut child = self
            .command(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run ctr");
        if let Some(data) = stdin {
            let mut w = child.stdin.take().expect("ctr stdin");
            let data = data.to_vec();
            std::thread::spawn(move || {
                let _ = w.write_all(&data);
            });
        }
        let (out, killed) = wait_output(child, limit);
        slow_step("ctr", args, start.elapsed());
        Run::from(out, start.elapsed(), killed)
    }

    /// Start `ctr ARGS` in the background (stdout/stderr piped).
    pub fn spawn_ctr(&self, args: &[&str]) -> Child {
        self.spawn_ctr_with(args, Stdio::null())
    }

    /// Start `ctr ARGS` in the background with `stdin` (stdout/stderr piped).
    pub fn spawn_ctr_with(&self, args: &[&str], stdin: Stdio) -> Child {
        self.command(args)
            .stdin(stdin)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run ctr")
    }

    /// The `ctr run` arguments for burrow and the busybox image:
    /// `run --runtime burrow [FLAGS] IMAGE ID CMD...`.
    pub fn run_args<'a>(flags: &[&'a str], id: &'a str, cmd: &[&'a str]) -> Vec<&'a str> {
        let mut v = vec!["run", "--runtime", RUNTIME];
        v.extend_from_slice(flags);
        v.push(IMAGE);
        v.push(id);
        v.extend_from_slice(cmd);
        v
    }

    /// containerd's gRPC socket (the CRI plugin serves on it too).
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// This containerd's scratch directory (config, logs, state).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// burrow's state directory for this containerd.
    pub fn burrow_state(&self) -> PathBuf {
        self.dir.join("burrow")
    }

    /// Lines of containerd's log (which carries the shim's) containing
    /// `what`.
    pub fn log_count(&self, what: &str) -> usize {
        std::fs::read_to_string(self.dir.join("containerd.log"))
            .unwrap_or_default()
            .lines()
            .filter(|l| l.contains(what))
            .count()
    }

    /// The shim's line on how sandbox `id` (namespace `default`) started
    /// its VM (`burrow sandbox ls -v`): "created from a template (...)"
    /// or "created in ..." for a cold boot.
    pub fn start_phases(&self, id: &str) -> String {
        let p = self.burrow_state().join("default").join(id).join("phases");
        std::fs::read_to_string(&p).unwrap_or_else(|e| format!("{}: {e}", p.display()))
    }

    /// Assert that sandbox `id` started as this run's mode says: from a
    /// template when templates are on, a cold boot when off.
    pub fn assert_started_as_configured(&self, id: &str) {
        let phases = self.start_phases(id);
        if templates_on() {
            assert!(
                phases.starts_with("created from a template"),
                "{id} must start from a template (templates are on): {phases}"
            );
        } else {
            assert!(
                phases.starts_with("created in "),
                "{id} must boot cold (templates are off): {phases}"
            );
        }
    }

    /// burrow's `image_dir` for this containerd: a container's rootfs
    /// image is `<it>/<namespace>/<sandbox id>/<container>.rootfs.img`.
    pub fn image_dir(&self) -> &Path {
        &self.images
    }

    /// burrow's `layer_cache_dir` for this containerd.
    pub fn layer_cache_dir(&self) -> &Path {
        &self.layers
    }

    /// Every file, directory and socket burrow made for this containerd
    /// (state, snapshots and images) is private: no group or other permission bits,
    /// but for a sandbox's directory, which the jailed VMM's group may
    /// create files in (see [`crate::jailed::is_jail_state_dir`]).
    /// Fails if there is no VM console among them (nothing was checked).
    pub fn assert_private(&self) {
        use std::os::unix::fs::PermissionsExt;
        let mut seen = Vec::new();
        let mut open = Vec::new();
        for root in [
            self.burrow_state(),
            self.snapshot_dir(),
            self.images.clone(),
        ] {
            let mut stack = vec![root];
            while let Some(p) = stack.pop() {
                let Ok(meta) = std::fs::symlink_metadata(&p) else {
                    continue;
                };
                if meta.permissions().mode() & 0o077 != 0
                    && !crate::jailed::is_jail_state_dir(&meta)
                {
                    open.push(format!(
                        "{:o} {}",
                        meta.permissions().mode() & 0o7777,
                        p.display()
                    ));
                }
                if meta.is_dir() {
                    stack.extend(
                        std::fs::read_dir(&p)
                            .into_iter()
                            .flatten()
                            .flatten()
                            .map(|e| e.path()),
                    );
                }
                seen.push(p);
            }
        }
        assert!(
            seen.iter()
                .any(|p| p.file_name().is_some_and(|n| n == "console.log")),
            "no VM console under {}: {seen:?}",
            self.burrow_state().display()
        );
        assert!(open.is_empty(), "readable by others:\n{}", open.join("\n"));
    }

    /// burrow's hibernation snapshots for this containerd.
    pub fn snapshot_dir(&self) -> PathBuf {
        self.dir.join("snapshots")
    }

    /// Run the `burrow` CLI with this containerd's burrow config.
    pub fn burrow(&self, args: &[&str]) -> Run {
        self.burrow_with(args, None)
    }

    /// Run the `burrow` CLI with this containerd's burrow config, feeding
    /// `stdin` if given.
    pub fn burrow_with(&self, args: &[&str], stdin: Option<&[u8]>) -> Run {
        let start = Instant::now();
        let mut child = Command::new(crate::workspace_bin("burrow"))
            .args(args)
            .env("BURROW_CONFIG", self.dir.join("burrow.toml"))
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run burrow");
        if let Some(data) = stdin {
            let mut w = child.stdin.take().expect("burrow stdin");
            let data = data.to_vec();
            std::thread::spawn(move || {
                let _ = w.write_all(&data);
            });
        }
        let (out, killed) = wait_output(child, Duration::from_secs(600));
        slow_step("burrow", args, start.elapsed());
        Run::from(out, start.elapsed(), killed)
    }

    /// Task status as `ctr task ls` prints it (RUNNING, PAUSED, STOPPED...).
    pub fn task_status(&self, id: &str) -> Option<String> {
        let r = self.ctr(&["task", "ls"]);
        r.stdout.lines().find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.first() == Some(&id)).then(|| f.get(2).map(|s| s.to_string()).unwrap_or_default())
        })
    }

    /// Wait until `ctr task ls` shows `id` with `status`.
    pub fn wait_status(&self, id: &str, status: &str, limit: Duration) {
        let start = Instant::now();
        loop {
            let now = self.task_status(id);
            if now.as_deref() == Some(status) {
                slow_step("wait for", &[id, status], start.elapsed());
                return;
            }
            assert!(
                start.elapsed() < limit,
                "task {id} is {now:?}, not {status}, after {limit:?}\n{}",
                self.diagnostics()
            );
            std::thread::sleep(poll_pause(start.elapsed()));
        }
    }

    /// Pid of the burrow-vmm serving sandbox `id` (from the shim's state).
    pub fn vmm_pid(&self, id: &str) -> i32 {
        let p = self.burrow_state().join("default").join(id).join("vmm.pid");
        let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        s.trim()
            .parse()
            .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    /// Mount points under this containerd's directories, in mount order.
    fn mounts(&self) -> Vec<String> {
        let (dir, root) = (
            self.dir.display().to_string(),
            self.root.display().to_string(),
        );
        std::fs::read_to_string("/proc/self/mountinfo")
            .unwrap_or_default()
            .lines()
            .filter_map(|m| m.split_whitespace().nth(4))
            .filter(|t| t.starts_with(&dir) || t.starts_with(&root))
            .map(str::to_string)
            .collect()
    }

    /// What is left of burrow after every task is deleted: burrow-vmm
    /// processes started for this containerd, files under its state dir and
    /// snapshot dir (but named checkpoints, `.checkpoints/`, which are kept
    /// on purpose), anything under its image dir (a sandbox's directory
    /// goes with its last image), mounts under its directories. Empty when
    /// clean.
    pub fn leftovers(&self) -> Vec<String> {
        let mut left = Vec::new();
        let state = self.burrow_state();
        let marker = state.display().to_string();
        for (pid, cmdline) in processes_mentioning(&marker) {
            if cmdline.contains("burrow-vmm") {
                left.push(format!("process {pid}: {cmdline}"));
            }
        }
        let named = self.snapshot_dir().join(".checkpoints");
        for d in [&state, &self.snapshot_dir()] {
            if d.exists() {
                for f in walk(d).into_iter().filter(|f| !f.starts_with(&named)) {
                    left.push(format!("file {}", f.display()));
                }
            }
        }
        for e in std::fs::read_dir(&self.images)
            .into_iter()
            .flatten()
            .flatten()
        {
            left.push(format!("image dir entry {}", e.path().display()));
        }
        for target in self.mounts() {
            if !target.ends_with("/snapshots") {
                left.push(format!("mount {target}"));
            }
        }
        left
    }

    /// Wait until [`leftovers`](Self::leftovers) is empty.
    pub fn assert_clean(&self, limit: Duration) {
        let start = Instant::now();
        loop {
            let left = self.leftovers();
            if left.is_empty() {
                return;
            }
            assert!(
                start.elapsed() < limit,
                "burrow left things behind after delete:\n  {}\n{}",
                left.join("\n  "),
                self.diagnostics()
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    /// containerd's log (which carries the shim's) and every VM console.
    pub fn diagnostics(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("containerd.log")).unwrap_or_default();
        let interesting: Vec<&str> = log
            .lines()
            .filter(|l| !l.contains("level=debug") || l.contains("burrow"))
            .collect();
        let tail = interesting[interesting.len().saturating_sub(60)..].join("\n");
        let mut out = format!("--- containerd log (tail) ---\n{tail}\n");
        for f in walk(&self.burrow_state()) {
            if f.file_name()
                .is_some_and(|n| n == "console.log" || n == "vmm.log")
            {
                let text = std::fs::read_to_string(&f).unwrap_or_default();
                let lines: Vec<&str> = text.lines().collect();
                let tail = lines[lines.len().saturating_sub(30)..].join("\n");
                out.push_str(&format!("--- {} (tail) ---\n{tail}\n", f.display()));
                if let Some(fault) = crate::cpu_fault::marker_line(&text, &f.display().to_string()) {
                    out.push_str(&format!("{fault}\n"));
                }
            }
        }
        out
    }
}

impl Drop for Containerd {
    fn drop(&mut self) {
        // Delete what is left so shims stop their VMs, then stop containerd.
        let limit = Duration::from_secs(60);
        let ls = self.try_ctr(&["task", "ls", "-q"], None, limit);
        for id in ls.stdout.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let _ = self.try_ctr(&["task", "kill", "-s", "SIGKILL", id], None, limit);
            let _ = self.try_ctr(&["task", "delete", "-f", id], None, limit);
        }
        let ls = self.try_ctr(&["containers", "ls", "-q"], None, limit);
        for id in ls.stdout.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let _ = self.try_ctr(&["containers", "rm", id], None, limit);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        let marker = self.burrow_state().display().to_string();
        for (pid, _) in processes_mentioning(&marker) {
            // SAFETY: kill(2) has no memory-safety preconditions.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        for t in self.mounts().iter().rev() {
            let _ = Command::new("umount").args(["-l", t]).status();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_dir_all(&self.root);
        let _ = std::fs::remove_dir_all(&self.images);
        let _ = std::fs::remove_dir_all(&self.layers);
    }
}

/// Start containerd with the config and burrow config under `dir`, the
/// workspace's `shim` first on its PATH, logging to `dir/containerd.log`.
fn launch(dir: &Path, shim: &Path) -> Child {
    let bin_dir = shim.parent().expect("shim has a directory");
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_else(|_| "/usr/sbin:/usr/bin:/sbin:/bin".into())
    );
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("containerd.log"))
        .expect("containerd log");
    let mut cmd = Command::new("containerd");
    // With no udev running (hack/testhost), libdevmapper must create the
    // /dev/mapper nodes itself, or containerd's devmapper snapshotter finds
    // neither its pool nor the thin devices it creates.
    if !Path::new("/run/udev/control").exists() {
        cmd.env("DM_DISABLE_UDEV", "1");
    }
    cmd.arg("--config")
        .arg(dir.join("containerd.toml"))
        .args(["--log-level", "debug"])
        .env("PATH", &path)
        .env("BURROW_CONFIG", dir.join("burrow.toml"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("dup log"))
        .stderr(log)
        .spawn()
        .expect("start containerd")
}

/// Whether process `pid` exists and has not exited (a zombie has).
pub fn process_running(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists() && !is_zombie(pid)
}

/// Whether process `pid` has exited but not been reaped yet.
fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// Processes whose command line mentions `marker`: (pid, command line).
fn processes_mentioning(marker: &str) -> Vec<(i32, String)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(marker) {
            found.push((pid, cmdline));
        }
    }
    found
}

fn which(cmd: &str) -> bool {
    std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .any(|d| Path::new(d).join(cmd).is_file())
}

/// Every file (not directory) under `dir`.
pub fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() && !p.is_symlink() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// A `ctr` or `burrow` call that took seconds goes to the test's stderr
/// with its time (libtest shows it when the test fails, or always with
/// `--nocapture`), so a slow test says where its time went.
fn slow_step(what: &str, args: &[&str], took: Duration) {
    if took >= Duration::from_secs(2) {
        eprintln!("[{took:.1?}] {what} {}", args.join(" "));
    }
}

/// The pause between two `ctr` polls, `waited` into a wait: 250 ms at
/// first, then a quarter of the time waited so far, at most 2 s. One `ctr`
/// call costs 1.5-3 s of the test host's software CPU (a Go program's
/// start), so polling at a fixed 250 ms kept one of its two CPUs busy
/// with `ctr` for the whole of a long wait, taken from the VM waited for.
fn poll_pause(waited: Duration) -> Duration {
    (waited / 4).clamp(Duration::from_millis(250), Duration::from_secs(2))
}
