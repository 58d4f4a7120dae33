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
use burrow_vmm::snapshot::microvm;
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
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(|| burrow_vmm::capped::CappedLog)
        .init();
    // The VMM never executes anything: no privileges to gain (issue 15).
    // SAFETY: prctl(PR_SET_NO_NEW_PRIVS) has no memory-safety preconditions.
    unsafe { libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) };
    let cli = Cli::from_env();
    if let VmmCommand::Run(args) = &cli {
        burrow_vmm::capped::CappedLog::set_max(args.log_max);
        if args.exit_with_parent {
            exit_with_parent();
        }
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

/// Watch the parent: once it is gone (this process was handed to another),
/// end at once. Polled, not PR_SET_PDEATHSIG: that fires when the parent's
/// *thread* that spawned us exits, and the shim spawns from tokio threads.
fn exit_with_parent() {
    // SAFETY: getppid has no preconditions.
    let parent = unsafe { libc::getppid() };
    let _ = std::thread::Builder::new().name("parent-watch".into()).spawn(move || loop {
        std::thread::sleep(std::time::Duration::from_millis(200));
        // SAFETY: as above.
        if unsafe { libc::getppid() } != parent {
            eprintln!("burrow-vmm: the process that started it (pid {parent}) exited; stopping the VM");
            std::process::exit(1);
        }
    });
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
    let (state, chain) =
        microvm::load(dir).with_context(|| format!("snapshot {}", dir.display()))?;
    let (serial, serial_stdin) = serial_config(args);
    let opts = RestoreConfig {
        dir: dir.to_path_buf(),
        serial,
        serial_stdin,
        vsock: args.vsock.clone(),
        disks: args.disks.iter().map(|d| d.path.clone()).collect(),
    };
    check_restore(&opts, &state).with_context(|| format!("snapshot {}", dir.display()))?;
    let api = bind_api(args)?;
    match Vmm::restore(&opts, &state, &chain) {
        Ok(vmm) => Ok((vmm, api)),
        Err(e) => {
            if let Some(p) = &args.api {
                let _ = std::fs::remove_file(p);
            }
            Err(anyhow::Error::new(e).context("restoring the VM"))
        }
    }
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
    config.disk_slots = args.disk_slots;
    config.vsock = args.vsock.as_ref().map(|p| VsockConfig {
        uds_path: p.clone(),
        guest_cid: args.cid,
    });
    config.vcpus = args.vcpus;
    config.mem_mib = args.mem_mib;
    (config.serial, config.serial_stdin) = serial_config(args);
    let api = bind_api(args)?;
    let vmm = Vmm::build(&config).context("building the VM")?;
    Ok((vmm, api))
}

fn run(args: RunArgs) -> ExitCode {
    let (vmm, api) = match build(&args) {
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
