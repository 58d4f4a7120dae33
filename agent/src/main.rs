//! `burrow-agent`: PID 1 inside a burrow microVM.
//!
//! In a guest (started by the kernel as /init) it sets the guest up, then
//! serves the `burrow.agent.v1.Agent` ttrpc service on vsock port
//! [`burrow_protocol::AGENT_VSOCK_PORT`].
//!
//! `burrow-agent --listen unix:/path [--state-dir DIR]` is a test mode: the
//! agent runs as an ordinary (root) process in mount and UTS namespaces of
//! its own, as a child subreaper, and serves the same service on a unix
//! socket.

use burrow_agent::{browser, host_only, init, net, reaper, service};

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context};
use burrow_protocol::ttrpc::r#async::Server;

enum Listen {
    Vsock(u32),
    Unix(PathBuf),
}

struct Args {
    listen: Listen,
    state_dir: PathBuf,
    /// Browser image: an erofs device or an unpacked directory.
    browser: Option<PathBuf>,
    browser_sandbox: bool,
}

fn parse_args() -> anyhow::Result<Args> {
    let mut listen = Listen::Vsock(burrow_protocol::AGENT_VSOCK_PORT);
    let mut state_dir = PathBuf::from("/run/burrow");
    let mut browser = None;
    let mut browser_sandbox = true;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--listen" => {
                let v = args.next().context("--listen needs a value")?;
                listen = if let Some(p) = v.strip_prefix("unix:") {
                    Listen::Unix(PathBuf::from(p))
                } else if let Some(port) = v.strip_prefix("vsock:") {
                    Listen::Vsock(port.parse().context("bad vsock port")?)
                } else {
                    bail!("--listen takes unix:/path or vsock:PORT, not {v:?}");
                };
            }
            "--state-dir" => state_dir = PathBuf::from(args.next().context("--state-dir needs a value")?),
            "--browser" => browser = Some(PathBuf::from(args.next().context("--browser needs a value")?)),
            "--browser-no-sandbox" => browser_sandbox = false,
            "--version" => {
                println!("burrow-agent {}", env!("CARGO_PKG_VERSION"));
                std::process::exit(0);
            }
            // The kernel may pass its unknown command-line words to init.
            other if std::process::id() == 1 => eprintln!("burrow-agent: ignoring argument {other:?}"),
            other => bail!("unknown argument {other:?} (usage: burrow-agent [--listen unix:/path|vsock:PORT] [--state-dir DIR] [--browser DEV|DIR] [--browser-no-sandbox])"),
        }
    }
    Ok(Args {
        listen,
        state_dir,
        browser,
        browser_sandbox,
    })
}

/// Test mode: keep our mounts and hostname away from the host's, and
/// collect orphans like PID 1 would.
fn isolate_for_test_mode() -> anyhow::Result<()> {
    use nix::mount::{mount, MsFlags};
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS | nix::sched::CloneFlags::CLONE_NEWUTS)
        .context("unshare mount and UTS namespaces (test mode needs root)")?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .context("make mounts private")?;
    // SAFETY: plain prctl.
    if unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } < 0 {
        bail!(
            "PR_SET_CHILD_SUBREAPER: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let pid1 = std::process::id() == 1;
    let args = parse_args()?;
    if pid1 {
        if let Err(e) = init::setup_pid1() {
            eprintln!("burrow-agent: guest setup failed: {e:#}");
        }
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_ansi(false)
        .with_writer(std::io::stderr)
        .init();
    if !pid1 {
        isolate_for_test_mode()?;
    }
    let result = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("start the async runtime")?
        .block_on(serve(args, pid1));
    if let Err(e) = &result {
        tracing::error!("agent failed: {e:#}");
        if pid1 {
            // PID 1 must not exit (the kernel would panic): power off instead.
            let _ = init::power_off(false);
        }
    }
    result
}

async fn serve(args: Args, pid1: bool) -> anyhow::Result<()> {
    reaper::start().context("watch SIGCHLD")?;
    if pid1 {
        // Before the agent answers: the shim starts the container only
        // once the guest's NIC has the namespace's address.
        if let Err(e) = net::configure_from_cmdline().await {
            tracing::error!("configuring the guest network: {e:#}");
        }
    }
    std::fs::create_dir_all(args.state_dir.join("containers"))
        .with_context(|| format!("create {}", args.state_dir.display()))?;
    // In a guest the kernel command line names the browser image:
    // burrow.browser=/dev/vdX (and burrow.browser_sandbox=0 to run
    // Chromium without its sandbox).
    let mut browser_path = args.browser.clone();
    let mut sandbox = args.browser_sandbox;
    if pid1 {
        if let Some(dev) = init::kernel_cmdline_value("burrow.browser") {
            browser_path = Some(PathBuf::from(dev));
        }
        if init::kernel_cmdline_value("burrow.browser_sandbox").as_deref() == Some("0") {
            sandbox = false;
        }
    }
    let browser = Arc::new(browser::Browser::new(
        browser_path.map(browser::Source::from_path),
        args.state_dir.clone(),
        sandbox,
    ));
    let service = Arc::new(service::AgentService::new(
        args.state_dir.clone(),
        pid1,
        browser.clone(),
    ));
    let services = burrow_protocol::create_agent(service);
    let (addr, server) = match &args.listen {
        Listen::Vsock(port) => (
            format!("vsock://-1:{port}"),
            Server::new().add_listener(host_only::listen(*port)?),
        ),
        Listen::Unix(path) => {
            let _ = std::fs::remove_file(path);
            let addr = format!("unix://{}", path.display());
            let server = Server::new()
                .bind(&addr)
                .with_context(|| format!("listen on {addr}"))?;
            (addr, server)
        }
    };
    let mut server = server.register_service(services);
    server.start().await.context("start the ttrpc server")?;
    tracing::info!(version = env!("CARGO_PKG_VERSION"), %addr, pid1, "burrow-agent serving");
    if pid1 {
        std::future::pending::<()>().await;
    } else {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        tracing::info!("shutting down");
        browser.close().await;
    }
    Ok(())
}
