//! `burrow`: the command-line front of burrow.

mod check;
mod containerd_config;
mod install;

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
    }
}
