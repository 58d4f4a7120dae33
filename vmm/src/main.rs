//! `burrow-vmm`: one process per microVM. Its command line is
//! [`burrow_vmm_api::VmmArgs`] (`burrow-vmm run --kernel PATH ...` boots,
//! `burrow-vmm run --restore DIR ...` rebuilds a VM from a snapshot
//! directory), parsed here from the same type the shim builds it with.
//!
//! Exit status: 0 when the guest reboots or powers off (or the controller
//! stops it), 1 when the guest crashed (panic, triple fault) or the VMM
//! failed while running, 2 when the VM could not be built; then the last
//! stderr line is the typed error ([`ApiError::failure_line`]).

use std::os::unix::net::UnixListener;
use std::process::ExitCode;

use anyhow::Context;
use burrow_vmm::api::failure_kind;
use burrow_vmm::config::{SerialOutput, VsockConfig};
use burrow_vmm::jail::{self, seccomp};
use burrow_vmm::snapshot::microvm;
use burrow_vmm::snapshot::untrusted::Expect;
use burrow_vmm::vmm::{check_restore, RestoreConfig};
use burrow_vmm::{VmConfig, Vmm};
use burrow_vmm_api::{ApiError, Cli, ErrorKind, VmmArgs, VmmCommand};

type RunArgs = VmmArgs;

fn main() -> ExitCode {
    // Snapshots (guest memory), the serial log and the API socket are
    // private to the VMM's user.
    // SAFETY: umask has no memory-safety preconditions.
    unsafe { libc::umask(0o077) };
    tracing_subscriber::fmt()
        .with_env_filter(log_filter())
        .with_writer(|| burrow_vmm::capped::CappedLog)
        // The log is a file the shim keeps, or a pipe: no colour codes.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    // The VMM never executes anything: no privileges to gain (issue 15).
    // SAFETY: prctl(PR_SET_NO_NEW_PRIVS) has no memory-safety preconditions.
    unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    let cli = Cli::from_env();
    if let VmmCommand::Run(args) = &cli {
        burrow_vmm::capped::CappedLog::set_max(args.log_max);
    }
    match cli {
        VmmCommand::Probe => match burrow_vmm::probe::run_tiny_guest() {
            Ok(o) => {
                println!("tiny guest wrote {:#x} in {} exits", o.byte, o.exits);
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("burrow-vmm: {e}");
                ExitCode::from(2)
            }
        },
        VmmCommand::Run(args) => run(*args),
    }
}

/// `RUST_LOG`, or warnings. virtio-queue's own errors repeat, once per
/// notify, what a guest wrote into its rings; the transport already logs
/// each such fault once with its count (`fault_log`), so they are off
/// unless `RUST_LOG` names `virtio_queue`.
fn log_filter() -> tracing_subscriber::EnvFilter {
    let env = std::env::var("RUST_LOG").unwrap_or_default();
    let base = if env.trim().is_empty() { "warn" } else { env.as_str() };
    let spec = if base.contains("virtio_queue") {
        base.to_string()
    } else {
        format!("{base},virtio_queue=off")
    };
    tracing_subscriber::EnvFilter::try_new(&spec)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn,virtio_queue=off"))
}

/// Watch the parent: once it is gone (this process was handed to another),
/// end at once. A pidfd, not PR_SET_PDEATHSIG: that fires when the parent's
/// *thread* that spawned us exits, and the shim spawns from tokio threads.
/// The watching thread sleeps in poll(2) on a pidfd of the parent until
/// it exits: nothing wakes an idle VMM.
fn exit_with_parent(parent: libc::pid_t) -> anyhow::Result<()> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, parent, 0) };
    let fd = libc::c_int::try_from(fd).unwrap_or(-1);
    let open_error = std::io::Error::last_os_error();
    // Checked after the open: a parent that exits later is seen by the pidfd.
    // SAFETY: getppid has no preconditions.
    if unsafe { libc::getppid() } != parent {
        anyhow::bail!("the process that started it (pid {parent}) exited while the VM was built");
    }
    if fd < 0 {
        anyhow::bail!("pidfd_open of the parent (pid {parent}): {open_error}");
    }
    std::thread::Builder::new()
        .name("parent-watch".into())
        .spawn(move || {
            if let Err(e) = seccomp::apply(seccomp::Thread::ParentWatch) {
                eprintln!("burrow-vmm: {e}");
                std::process::exit(1);
            }
            watch_parent(parent, fd)
        })
        .context("starting the parent-watch thread")?;
    Ok(())
}

fn watch_parent(parent: libc::pid_t, pidfd: libc::c_int) {
    loop {
        let mut p = libc::pollfd { fd: pidfd, events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd; no timeout.
        let n = unsafe { libc::poll(&mut p, 1, -1) };
        // SAFETY: getppid has no preconditions.
        if n > 0 || unsafe { libc::getppid() } != parent {
            eprintln!("burrow-vmm: the process that started it (pid {parent}) exited; stopping the VM");
            std::process::exit(1);
        }
    }
}

fn bind_api(args: &RunArgs) -> anyhow::Result<Option<UnixListener>> {
    Ok(match &args.api {
        Some(p) => {
            if p.exists() {
                std::fs::remove_file(p)
                    .with_context(|| format!("removing stale {}", p.display()))?;
            }
            Some(
                UnixListener::bind(burrow_vmm_api::sockpath::SocketPath::new(p)?.path())
                    .with_context(|| format!("binding API socket {}", p.display()))?,
            )
        }
        None => None,
    })
}

fn serial_config(args: &RunArgs) -> (SerialOutput, bool) {
    let out = match &args.serial_log {
        Some(p) => SerialOutput::File {
            path: p.clone(),
            max_bytes: args.serial_log_max,
        },
        None => SerialOutput::Stdout,
    };
    // SAFETY: isatty only inspects the descriptor.
    let stdin = args.serial_log.is_none() && unsafe { libc::isatty(libc::STDIN_FILENO) } == 1;
    (out, stdin)
}

/// Restore: the snapshot is read and checked completely (state file and
/// the memory files of its chain) before anything is created, so a bad
/// snapshot fails with status 2 and touches nothing.
fn restore(args: &RunArgs, dir: &std::path::Path) -> anyhow::Result<(Vmm, Option<UnixListener>)> {
    let expect = Expect {
        self_contained: args.self_contained,
        net_given: args.net.is_some(),
        disks_given: args.disks.len(),
        vcpus: args.expect_vcpus,
        mem_mib: args.expect_mem_mib,
        mem_max_mib: args.expect_mem_max_mib,
    };
    let (state, chain) =
        microvm::load_expecting(dir, &expect).with_context(|| format!("snapshot {}", dir.display()))?;
    let (serial, serial_stdin) = serial_config(args);
    let opts = RestoreConfig {
        dir: dir.to_path_buf(),
        serial,
        serial_stdin,
        vsock: args.vsock.clone(),
        disks: args.disks.iter().map(|d| d.path.clone()).collect(),
        net: args.net.as_ref().map(|n| n.tap.clone()),
    };
    check_restore(&opts, &state).with_context(|| format!("snapshot {}", dir.display()))?;
    let packed = match args.packed_memory_fd {
        Some(fd) => Some(packed_memory(fd, dir, &state).with_context(|| format!("snapshot {}", dir.display()))?),
        None => None,
    };
    let api = bind_api(args)?;
    match Vmm::restore_packed(&opts, &state, &chain, packed.as_ref()) {
        Ok(vmm) => Ok((vmm, api)),
        Err(e) => {
            if let Some(p) = &args.api {
                let _ = std::fs::remove_file(p);
            }
            Err(anyhow::Error::new(e).context("restoring the VM"))
        }
    }
}

/// The packed memory file inherited as `fd` and its map beside the
/// snapshot in `dir`, checked against the snapshot's memory size.
fn packed_memory(fd: i32, dir: &std::path::Path, state: &microvm::MicrovmState) -> anyhow::Result<microvm::PackedMemory> {
    use std::os::fd::FromRawFd;
    anyhow::ensure!(fd > 2, "--packed-memory-fd {fd} is not an inherited file");
    // SAFETY: fcntl only asks whether `fd` is open.
    anyhow::ensure!(unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0, "--packed-memory-fd {fd} is not open");
    // SAFETY: the descriptor was passed to this process for it alone and
    // nothing else here owns it.
    let file = unsafe { std::fs::File::from_raw_fd(fd) };
    anyhow::ensure!(file.metadata()?.is_file(), "--packed-memory-fd {fd} is not a regular file");
    let map = dir.join(burrow_vmm_api::layout::MEMORY_MAP_FILE);
    Ok(microvm::PackedMemory::open(file, &map, state.memory.total_bytes())?)
}

fn build(args: &RunArgs) -> anyhow::Result<(Vmm, Option<UnixListener>)> {
    if let Some(dir) = &args.restore {
        return restore(args, dir);
    }
    let kernel = args.kernel.clone().context("--kernel is required")?;
    let mut config = VmConfig::new(kernel);
    config.initrd = args.initrd.clone();
    config.cmdline = args.cmdline.clone();
    for extra in &args.append {
        config.cmdline.push(' ');
        config.cmdline.push_str(extra);
    }
    config.disks = args.disks.clone();
    config.net = args.net.clone();
    config.disk_slots = args.disk_slots;
    config.vsock = args.vsock.as_ref().map(|p| VsockConfig {
        uds_path: p.clone(),
        guest_cid: args.cid,
    });
    config.vcpus = args.vcpus;
    config.max_vcpus = args.max_vcpus;
    config.mem_mib = args.mem_mib;
    config.mem_max_mib = args.mem_max_mib;
    (config.serial, config.serial_stdin) = serial_config(args);
    let api = bind_api(args)?;
    let vmm = Vmm::build(&config).context("building the VM")?;
    Ok((vmm, api))
}

/// Confine the process once its VM is built: the cgroup and OOM score,
/// the jail, then the VMM thread's seccomp filter (the threads it starts
/// add theirs). See [`burrow_vmm::jail`].
fn confine(args: &RunArgs, parent: libc::pid_t) -> anyhow::Result<()> {
    let j = &args.jail;
    jail::place(j.cgroup.as_deref(), j.oom_score_adj)?;
    if j.jail {
        let mut dirs = Vec::new();
        let mut own_files = Vec::new();
        for p in [&args.api, &args.vsock, &args.serial_log].into_iter().flatten() {
            if let Some(d) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                dirs.push(d.to_path_buf());
            }
        }
        if let Some(log) = &args.serial_log {
            own_files.push(log.clone());
            own_files.push(burrow_vmm::capped::rotated(log));
        }
        own_files.extend(args.api.clone());
        jail::enter(&jail::Jail {
            uid: j.jail_uid,
            gid: j.jail_gid,
            dirs,
            own_files,
        })?;
    }
    seccomp::prepare(!j.no_seccomp)?;
    if args.exit_with_parent {
        exit_with_parent(parent)?;
    }
    seccomp::apply(seccomp::Thread::Vmm)?;
    if j.test_forbidden_syscall {
        seccomp::forbidden_syscall();
        eprintln!("burrow-vmm: the forbidden syscall was allowed");
    }
    Ok(())
}

fn run(args: RunArgs) -> ExitCode {
    // SAFETY: getppid has no preconditions.
    let parent = unsafe { libc::getppid() };
    let built = build(&args).and_then(|(vmm, api)| {
        let t = std::time::Instant::now();
        confine(&args, parent).context("confining the VMM")?;
        tracing::info!("confined in {} us", t.elapsed().as_micros());
        Ok((vmm, api))
    });
    let (vmm, api) = match built {
        Ok(v) => v,
        Err(e) => {
            eprintln!("burrow-vmm: {}", error_chain(&e));
            let kind = e
                .chain()
                .find_map(failure_kind)
                .unwrap_or(ErrorKind::Internal);
            eprintln!("{}", ApiError::new(kind, error_chain(&e)).failure_line());
            return ExitCode::from(2);
        }
    };
    let mut vmm = vmm;
    vmm.kick_vcpus_every(args.vcpu_kick_ms);
    let reason = vmm.run(api, !args.paused);
    if let Some(p) = &args.api {
        let _ = std::fs::remove_file(p);
    }
    eprintln!("burrow-vmm: {reason}");
    if reason.success() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// The error and its causes, skipping causes whose text the message before
/// already includes (many of our errors quote their source).
fn error_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
    }
    out
}
