//! `burrow-vmm`: one process per microVM.
//!
//! `burrow-vmm run --kernel PATH [--initrd PATH] [--cmdline STR] [--disk PATH[:ro]]...
//! [--vsock PATH] [--vcpus N] [--mem MiB] [--serial-log PATH] [--api PATH] [--paused]`
//!
//! `burrow-vmm run --restore DIR [--disk PATH]... [--vsock PATH] [--serial-log PATH]
//! [--api PATH] [--paused]` rebuilds a VM from a snapshot directory.
//!
//! Exit status: 0 when the guest reboots or powers off (or the controller
//! stops it), 1 when the guest crashed (panic, triple fault) or the VMM
//! failed while running, 2 when the VM could not be built.

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use burrow_vmm::config::{DiskConfig, SerialOutput, VsockConfig, DEFAULT_CMDLINE};
use burrow_vmm::snapshot::microvm;
use burrow_vmm::vmm::{check_restore, RestoreConfig};
use burrow_vmm::{VmConfig, Vmm};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "burrow-vmm", about = "burrow's VMM: one KVM microVM per process")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Boot a VM and run it until it exits.
    Run(Box<RunArgs>),
    /// Run a tiny real-mode guest to check that /dev/kvm runs guest code.
    Probe,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Uncompressed ELF kernel (vmlinux); PVH entry used when present.
    #[arg(long, required_unless_present = "restore")]
    kernel: Option<PathBuf>,
    /// Restore the VM from this snapshot directory (`state` + `memory`)
    /// instead of booting. `--disk` then replaces the recorded disk paths
    /// (in order; sizes must match), `--vsock` the recorded socket path.
    #[arg(long, conflicts_with_all = ["kernel", "initrd", "cmdline", "append", "vcpus", "mem", "cid"])]
    restore: Option<PathBuf>,
    /// initramfs (newc cpio, optionally compressed as the kernel supports).
    #[arg(long)]
    initrd: Option<PathBuf>,
    /// Kernel command line (virtio-mmio device entries are appended).
    #[arg(long, default_value = DEFAULT_CMDLINE)]
    cmdline: String,
    /// Extra arguments appended to the command line; repeatable.
    #[arg(long)]
    append: Vec<String>,
    /// Raw disk image, `PATH` (read-write) or `PATH:ro`; repeatable.
    #[arg(long = "disk")]
    disks: Vec<DiskConfig>,
    /// Host side of vsock: unix socket path (guest connections go to PATH_<port>).
    #[arg(long)]
    vsock: Option<PathBuf>,
    /// Guest vsock CID.
    #[arg(long, default_value_t = 3)]
    cid: u64,
    #[arg(long, default_value_t = 1)]
    vcpus: u8,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 256)]
    mem: u64,
    /// Write the serial console to this file instead of stdout.
    #[arg(long)]
    serial_log: Option<PathBuf>,
    /// Control API socket (JSON lines).
    #[arg(long)]
    api: Option<PathBuf>,
    /// Wait for a `start` command on the API socket before running vCPUs.
    #[arg(long, requires = "api")]
    paused: bool,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Probe => match burrow_vmm::probe::run_tiny_guest() {
            Ok(o) => {
                println!("tiny guest wrote {:#x} in {} exits", o.byte, o.exits);
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("burrow-vmm: {e}");
                ExitCode::from(2)
            }
        },
        Cmd::Run(args) => run(*args),
    }
}

fn bind_api(args: &RunArgs) -> anyhow::Result<Option<UnixListener>> {
    Ok(match &args.api {
        Some(p) => {
            if p.exists() {
                std::fs::remove_file(p).with_context(|| format!("removing stale {}", p.display()))?;
            }
            Some(UnixListener::bind(p).with_context(|| format!("binding API socket {}", p.display()))?)
        }
        None => None,
    })
}

fn serial_config(args: &RunArgs) -> (SerialOutput, bool) {
    let out = match &args.serial_log {
        Some(p) => SerialOutput::File(p.clone()),
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
    let (state, chain) = microvm::load(dir).with_context(|| format!("snapshot {}", dir.display()))?;
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
    config.vsock = args.vsock.as_ref().map(|p| VsockConfig {
        uds_path: p.clone(),
        guest_cid: args.cid,
    });
    config.vcpus = args.vcpus;
    config.mem_mib = args.mem;
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
