//! `burrow`: the command-line front of burrow.

mod audit;
mod browse;
mod check;
mod containerd_config;
mod copy;
mod fork;
mod install;
mod interactive;
mod mcp;
mod sandbox;
mod session;
mod template;
mod tools;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "burrow",
    version,
    about = "KVM microVM sandboxes for containerd"
)]
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
    /// Run a command in a sandbox's container (waking it if it hibernates);
    /// prints its output as it comes and exits with its status (124:
    /// killed at --timeout; 125: burrow failed); -t gives it a terminal. With
    /// --detach it starts a session that survives hibernation and
    /// checkpoint/restore; --attach reads on in it.
    Exec(tools::ExecArgs),
    /// Print lines of a file in a sandbox's container, at most 500 per call;
    /// says on stderr which lines were shown and how many remain.
    Read(tools::ReadArgs),
    /// Replace a file in a sandbox's container atomically with stdin (text,
    /// at most 1 MiB; its mode is kept, missing parents are made).
    Write(tools::PathArgs),
    /// List a directory in a sandbox's container.
    Ls(tools::PathArgs),
    /// Copy one file, any bytes, up to 4 GiB, into or out of a sandbox's
    /// container, as `docker cp` does: `burrow cp LOCAL ID:PATH`, `burrow cp
    /// ID:PATH LOCAL` (`-`: stdin or stdout). The target is replaced
    /// atomically (a failed copy leaves it as it was); an upload keeps the
    /// local file's mode, a download the guest file's.
    Cp(copy::CpArgs),
    /// Replace the one occurrence of --old with --new in a file in a
    /// sandbox's container; none or several occurrences change nothing.
    Edit(tools::EditArgs),
    /// Load a URL in a sandbox's browser (annotation io.burrow.browser=true)
    /// and print the page's text; with --text, its visible interactive
    /// elements with the indexes `click` and `type` take.
    Browse(browse::BrowseArgs),
    /// Click element INDEX (from `burrow browse ID --text`) in a sandbox's
    /// browser; prints the page's text after it.
    Click(browse::ClickArgs),
    /// Type TEXT into element INDEX in a sandbox's browser.
    Type(browse::TypeArgs),
    /// Write a PNG screenshot of a sandbox's browser page to --out.
    Screenshot(browse::ScreenshotArgs),
    /// Print a sandbox's audit log: every tool call made through burrow
    /// (CLI and MCP), arguments redacted.
    Audit {
        #[command(flatten)]
        target: tools::Target,
        /// JSON lines instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Serve the sandboxes' tools (exec, files, checkpoint) to AI agents as
    /// a Model Context Protocol server on stdio (or Streamable HTTP).
    Mcp {
        /// Serve Streamable HTTP instead of stdio, on a loopback address
        /// (127.0.0.1:PORT, [::1]:PORT; port 0 picks a free one) or a unix
        /// socket (unix:/PATH, made 0600). The bound address is printed on
        /// stderr. Other addresses are refused: the tools have no
        /// authentication.
        #[arg(long, value_name = "ADDR")]
        http: Option<mcp::http::Listen>,
        /// The shims' state directory (default: `state_dir` from the burrow
        /// config, else /run/burrow).
        #[arg(long)]
        state_dir: Option<std::path::PathBuf>,
        /// containerd namespace of the sandboxes served.
        #[arg(long, short = 'n', default_value = "default")]
        namespace: String,
        /// containerd's socket, for `fork` and `restore`, which start new
        /// containers (default: $CONTAINERD_ADDRESS, else
        /// /run/containerd/containerd.sock).
        #[arg(long)]
        address: Option<String>,
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
    /// Warm templates (`templates = true` or io.burrow.template=on): build
    /// one before the first container needs it, or list the cache.
    Template {
        #[command(subcommand)]
        verb: TemplateVerb,
    },
}

#[derive(Subcommand)]
enum TemplateVerb {
    /// Build the template `ctr run` restores for a VM shape (the config's
    /// default size unless given), unless it is built already. Uses the
    /// burrow config ($BURROW_CONFIG, else /etc/burrow/config.toml) and
    /// the burrow-vmm beside this binary, as the shim does.
    Build(template::BuildArgs),
    /// List the built templates: key, disk use, shape.
    Ls,
}

#[derive(Subcommand)]
enum SandboxVerb {
    /// List sandboxes and whether they are running or asleep.
    Ls {
        /// Also where each sandbox's start spent its time.
        #[arg(short, long)]
        verbose: bool,
    },
    /// Snapshot the VM to disk and stop it; containerd still sees the task
    /// running, and the next call that needs the guest wakes it.
    Hibernate { id: String },
    /// Restore a hibernated VM now.
    Wake { id: String },
    /// Write a checkpoint of the whole VM to `<snapshot_dir>/.checkpoints/NAME`
    /// while it runs on; `ctr run --annotation io.burrow.restore=NAME ...`
    /// starts a container from it.
    Checkpoint { id: String, name: String },
    /// Start N copies of a running sandbox from one snapshot of it (its
    /// memory shared copy-on-write, its disk copied), each a new containerd
    /// task `ID-fork-K` with a fresh identity; the source runs on.
    Fork {
        id: String,
        #[arg(value_parser = clap::value_parser!(u32).range(1..=i64::from(fork::MAX_COPIES)))]
        n: u32,
        /// containerd's socket (default: $CONTAINERD_ADDRESS, else
        /// /run/containerd/containerd.sock).
        #[arg(long)]
        address: Option<String>,
    },
}

/// Run tool verb `name`; on failure, say why on one line and exit with
/// `failed` (the verb's own status otherwise).
fn tool(name: &str, failed: i32, run: impl FnOnce() -> Result<i32>) -> ! {
    match run() {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("burrow {name}: {e:#}");
            std::process::exit(failed)
        }
    }
}

fn main() -> Result<()> {
    // `burrow template build`'s network-namespace holder (as the shim's).
    if std::env::args().nth(1).as_deref() == Some(burrow_shim::vm::netns::HOLDER_ARG) {
        burrow_shim::vm::netns::run_holder();
        return Ok(());
    }
    let cli = Cli::parse();
    match cli.command {
        Command::Exec(a) => tool("exec", 125, || tools::exec(a)),
        Command::Read(a) => tool("read", 1, || tools::read(a)),
        Command::Write(a) => tool("write", 1, || tools::write(a)),
        Command::Ls(a) => tool("ls", 1, || tools::ls(a)),
        Command::Cp(a) => tool("cp", 1, || copy::cp(a)),
        Command::Edit(a) => tool("edit", 1, || tools::edit(a)),
        Command::Audit { target, json } => tool("audit", 1, || {
            let root = target
                .state_dir
                .clone()
                .unwrap_or_else(sandbox::state_dir_from_config);
            let dir = sandbox::sandbox_dir(&root, &target.namespace, &target.id)?;
            for e in audit::read(&dir)? {
                if json {
                    println!("{}", serde_json::to_string(&e)?);
                } else {
                    println!("{}", audit::text(&e));
                }
            }
            Ok(0)
        }),
        Command::Browse(a) => tool("browse", 1, || browse::browse(a)),
        Command::Click(a) => tool("click", 1, || browse::click(a)),
        Command::Type(a) => tool("type", 1, || browse::type_text(a)),
        Command::Screenshot(a) => tool("screenshot", 1, || browse::screenshot(a)),
        Command::Mcp {
            http,
            state_dir,
            namespace,
            address,
        } => {
            let root = state_dir.unwrap_or_else(sandbox::state_dir_from_config);
            let server = mcp::Burrow::new(root, namespace).with_containerd(address);
            match http {
                None => mcp::serve_stdio(server),
                Some(listen) => mcp::http::serve(server, listen),
            }
        }
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
        Command::Template { verb } => match verb {
            TemplateVerb::Build(a) => tool("template build", 1, || template::build(a)),
            TemplateVerb::Ls => tool("template ls", 1, template::ls),
        },
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
                SandboxVerb::Ls { verbose } => print!("{}", sandbox::ls(&root, verbose)),
                SandboxVerb::Hibernate { id } => {
                    let reply =
                        sandbox::request(&dir(&id)?, &sandbox::SandboxRequest::Hibernate, timeout)?;
                    println!("{id}: {}", reply.state);
                }
                SandboxVerb::Wake { id } => {
                    let reply =
                        sandbox::request(&dir(&id)?, &sandbox::SandboxRequest::Wake, timeout)?;
                    println!("{id}: {}", reply.state);
                }
                SandboxVerb::Fork { id, n, address } => {
                    let address = fork::containerd_address(address);
                    for copy in fork::fork(&dir(&id)?, &address, &namespace, &id, n)? {
                        println!("{copy}");
                    }
                }
                SandboxVerb::Checkpoint { id, name } => {
                    let req = sandbox::SandboxRequest::Checkpoint { name: name.clone() };
                    let reply = sandbox::request(&dir(&id)?, &req, timeout)?;
                    let at = reply.dir.as_deref().unwrap_or(std::path::Path::new("?"));
                    println!(
                        "{id}: checkpoint {name} written to {} ({})",
                        at.display(),
                        reply.state
                    );
                }
            }
            Ok(())
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Command, clap::Error> {
        Cli::try_parse_from(std::iter::once("burrow").chain(args.iter().copied()))
            .map(|c| c.command)
    }

    #[test]
    fn tool_verbs_parse() {
        let Command::Exec(a) = parse(&[
            "exec",
            "c1",
            "--cwd",
            "/tmp",
            "-e",
            "A=1",
            "--env",
            "B=2",
            "--timeout",
            "9",
            "--",
            "sh",
            "-c",
            "echo hi; exit 3",
        ])
        .unwrap() else {
            panic!("not exec")
        };
        assert_eq!(a.target.id, "c1");
        assert_eq!(a.target.namespace, "default");
        assert_eq!(a.cwd.as_deref(), Some("/tmp"));
        assert_eq!(a.env, ["A=1", "B=2"]);
        assert_eq!(a.timeout, Some(9));
        assert_eq!(a.cmd, ["sh", "-c", "echo hi; exit 3"]);
        // Options of the command after `--` are its own.
        let Command::Exec(a) = parse(&["exec", "c1", "--", "ls", "-l", "--timeout"]).unwrap()
        else {
            panic!("not exec")
        };
        assert_eq!(a.cmd, ["ls", "-l", "--timeout"]);
        assert_eq!(a.timeout, None);
        assert!(parse(&["exec", "c1"]).is_err(), "no command");
        // Detached sessions: --detach with a command, --attach without.
        let Command::Exec(a) = parse(&["exec", "c1", "--detach", "--", "make"]).unwrap() else {
            panic!("not exec")
        };
        assert!(a.detach && a.attach.is_none());
        let Command::Exec(a) = parse(&[
            "exec", "c1", "--attach", "s3", "--from", "812", "--wait", "0",
        ])
        .unwrap() else {
            panic!("not exec")
        };
        assert_eq!(
            (a.attach.as_deref(), a.from, a.wait),
            (Some("s3"), Some(812), Some(0))
        );
        assert!(parse(&["exec", "c1", "--attach", "s3", "--", "ls"]).is_err());
        assert!(parse(&["exec", "c1", "--detach", "--attach", "s3"]).is_err());
        assert!(parse(&["exec", "c1", "-e", "NOEQ", "--", "true"]).is_err());
        assert!(parse(&["exec", "c1", "--timeout", "0", "--", "true"]).is_err());
        // Interactive: -t and -i, alone or together as docker's -it.
        let Command::Exec(a) = parse(&["exec", "-it", "c1", "--", "sh"]).unwrap() else {
            panic!("not exec")
        };
        assert!(a.tty && a.interactive);
        let Command::Exec(a) = parse(&["exec", "c1", "-i", "--", "sh"]).unwrap() else {
            panic!("not exec")
        };
        assert!(a.interactive && !a.tty);
        assert!(parse(&["exec", "c1", "-i", "--detach", "--", "sh"]).is_err());

        let Command::Read(r) =
            parse(&["read", "-n", "k8s", "c1", "/etc/passwd", "--lines", "501:"]).unwrap()
        else {
            panic!("not read")
        };
        assert_eq!(
            (r.target.namespace.as_str(), r.path.as_str()),
            ("k8s", "/etc/passwd")
        );
        assert_eq!(r.lines.map(|l| (l.first, l.last)), Some((501, None)));
        assert!(parse(&["read", "c1", "/a", "--lines", "5:2"]).is_err());

        let Command::Edit(e) = parse(&["edit", "c1", "/a", "--old", "-x", "--new", "y"]).unwrap()
        else {
            panic!("not edit")
        };
        assert_eq!((e.old.as_str(), e.new.as_str()), ("-x", "y"));
        assert!(
            parse(&["edit", "c1", "/a", "--old", "x"]).is_err(),
            "--new is required"
        );
        assert!(matches!(
            parse(&["ls", "c1", "/tmp"]).unwrap(),
            Command::Ls(_)
        ));
        assert!(matches!(
            parse(&["write", "c1", "/tmp/a"]).unwrap(),
            Command::Write(_)
        ));
    }
}
