//! `containerd-shim-burrow-v2`: containerd's runtime `io.containerd.burrow.v2`.
//! containerd starts it; see the `burrow_shim` library for how it works.

use burrow_shim::shim::{shim_config, BurrowShim, RUNTIME};

fn main() {
    // A sandbox's network-namespace holder (vm::netns): no runtime.
    if std::env::args().nth(1).as_deref() == Some(burrow_shim::vm::netns::HOLDER_ARG) {
        burrow_shim::vm::netns::run_holder();
        return;
    }
    // `burrow check`'s network part (vm::netcheck).
    if std::env::args().nth(1).as_deref() == Some(burrow_shim::vm::netcheck::CHECK_ARG) {
        let parts = burrow_shim::vm::netcheck::check();
        print!("{}", burrow_shim::vm::netcheck::report(&parts));
        std::process::exit(i32::from(parts.iter().any(|(_, r)| r.is_err())));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap_or_else(|e| {
            eprintln!("containerd-shim-burrow-v2: tokio runtime: {e}");
            std::process::exit(1)
        });
    rt.block_on(shim_main());
}

async fn shim_main() {
    // Everything the shim and its VMMs create (rootfs images, snapshots,
    // consoles, logs, sockets, state directories) is theirs alone: guest
    // memory in a snapshot holds the agent's secrets (issue 15).
    // SAFETY: umask has no memory-safety preconditions.
    unsafe { libc::umask(0o077) };
    let args: Vec<String> = std::env::args().collect();
    if args
        .iter()
        .skip(1)
        .any(|a| a == "-v" || a == "--version" || a == "-version")
    {
        println!(
            "containerd-shim-burrow-v2 {} ({RUNTIME})",
            env!("CARGO_PKG_VERSION")
        );
        return;
    }
    containerd_shim::asynchronous::run::<BurrowShim>(RUNTIME, Some(shim_config())).await;
}
