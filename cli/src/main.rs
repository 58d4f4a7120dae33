//! `burrow`: the command-line front of burrow.

mod check;

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
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Check => {
            let facts = check::Facts::gather();
            print!("{}", check::report(&facts));
            std::process::exit(facts.classify().exit_code());
        }
    }
}
