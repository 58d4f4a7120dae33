//! `burrow`: the command-line front of burrow.

mod check;
mod containerd_config;
mod install;
mod sandbox;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "burrow", version, about = "KVM microVM sandboxes for containerd")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Report this host's virtualization and what burrow can do here.
    /// Exit status: 0 hardware KVM, 2 PVM, 3 no usable KVM.
    Check,
    /// Install burrow on this host (idempotent): build the guest kernel and
    /// image, install the binaries, register the runtime with containerd.
    Install {
        /// burrow's source tree (default: found from this binary's location).
        #[arg(long)]
        source: Option<std::path::PathBuf>,
    },
    /// Sandbox lifecycle: list, hibernate, wake, checkpoint (through each
    /// shim's control socket).
    Sandbox {
        /// The shims' state directory (default: `state_dir` from the burrow
        /// config, else /run/burrow).
        #[arg(long, global = true)]
        state_dir: Option<std::path::PathBuf>,
        /// containerd namespace.
        #[arg(long, short = 'n', default_value = "default", global = true)]
        namespace: String,
        #[command(subcommand)]
        verb: SandboxVerb,
    },
}

#[derive(Subcommand)]
enum SandboxVerb {
    /// List sandboxes and whether they are running or asleep.
    Ls,
    /// Snapshot the VM to disk and stop it; containerd still sees the task
    /// running, and the next call that needs the guest wakes it.
    Hibernate { id: String },
    /// Restore a hibernated VM now.
    Wake { id: String },
    /// Write a checkpoint of the whole VM to `<snapshot_dir>/.checkpoints/NAME`
    /// while it runs on; `ctr run --annotation io.burrow.restore=NAME ...`
    /// starts a container from it.
    Checkpoint { id: String, name: String },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Check => {
            let facts = check::Facts::gather();
            print!("{}", check::report(&facts));
            std::process::exit(facts.classify().exit_code());
        }
        Command::Install { source } => {
            let layout = install::Layout::system(source);
            for change in install::install(&layout)? {
                println!("{change}");
            }
            println!(
                "burrow is installed: `ctr run --runtime {} ...`; Kubernetes RuntimeClass handler `{}` \
                 (restart containerd to load the CRI entry)",
                containerd_config::RUNTIME_TYPE,
                containerd_config::HANDLER
            );
            Ok(())
        }
        Command::Sandbox {
            state_dir,
            namespace,
            verb,
        } => {
            let root = state_dir.unwrap_or_else(sandbox::state_dir_from_config);
            // Snapshots of big VMs on slow disks take a while.
            let timeout = std::time::Duration::from_secs(600);
            let dir = |id: &str| sandbox::sandbox_dir(&root, &namespace, id);
            match verb {
                SandboxVerb::Ls => print!("{}", sandbox::ls(&root)),
                SandboxVerb::Hibernate { id } => {
                    println!("{id}: {}", sandbox::command(&dir(&id)?, "hibernate", timeout)?);
                }
                SandboxVerb::Wake { id } => {
                    println!("{id}: {}", sandbox::command(&dir(&id)?, "wake", timeout)?);
                }
                SandboxVerb::Checkpoint { id, name } => {
                    let (state, at) = sandbox::checkpoint(&dir(&id)?, &name, timeout)?;
                    println!("{id}: checkpoint {name} written to {at} ({state})");
                }
            }
            Ok(())
        }
    }
}
