//! `burrow-vmm`: one process per microVM.

use anyhow::Result;

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let outcome = burrow_vmm::probe::run_tiny_guest()?;
    println!("tiny guest wrote {:#x} in {} exits", outcome.byte, outcome.exits);
    Ok(())
}
