//! `burrow exec|read|write|ls|edit ID ...`: a sandbox's tools from the host,
//! through its shim's control socket (the requests are in burrow-vmm-api's
//! `sandbox_tools`). A hibernated sandbox wakes for them. What the guest
//! sends back is bounded by the shim; this side prints it, says what was
//! cut or remains (on stderr), and exits with the command's status for
//! `exec`.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use burrow_vmm_api::sandbox_control::SandboxRequest;
use burrow_vmm_api::sandbox_tools::{
    EditRequest, ExecOutput, ExecRequest, LineRange, LsOutput, LsRequest, OutputChunk, ReadOutput,
    ReadRequest, ToolReply, WriteRequest, DEFAULT_EXEC_TIMEOUT_SECS, MAX_EXEC_OUTPUT,
    MAX_EXEC_TIMEOUT_SECS, MAX_READ_LINES, MAX_READ_SCAN, MAX_WRITE,
};

use crate::{audit, sandbox};

/// How long a tool request may take beyond its own work: waking a
/// hibernated VM on a slow disk.
pub const WAKE_ALLOWANCE: Duration = Duration::from_secs(600);

/// The sandbox a tool verb addresses.
#[derive(clap::Args, Debug)]
pub struct Target {
    /// The container's id (its sandbox's, for `ctr run`; a CRI pod's
    /// container id, or the pod's id for its only container).
    pub id: String,
    /// The shims' state directory (default: `state_dir` from the burrow
    /// config, else /run/burrow).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
    /// containerd namespace.
    #[arg(long, short = 'n', default_value = "default")]
    pub namespace: String,
}

impl Target {
    /// Send `req`; the tool's result.
    pub fn ask(&self, req: &SandboxRequest, timeout: Duration) -> Result<ToolReply> {
        let root = self
            .state_dir
            .clone()
            .unwrap_or_else(sandbox::state_dir_from_config);
        ask(&root, &self.namespace, &self.id, req, timeout)
    }
}

/// Send tool request `req` to sandbox `id` in `namespace` under state
/// directory `root`; the tool's result.
pub fn ask(
    root: &std::path::Path,
    namespace: &str,
    id: &str,
    req: &SandboxRequest,
    timeout: Duration,
) -> Result<ToolReply> {
    let (dir, routed) = route(root, namespace, id, req)?;
    let start = std::time::Instant::now();
    let result =
        sandbox::request(&dir, routed.as_ref().unwrap_or(req), timeout).and_then(tool_result);
    let mut entry = audit::entry(req, &result, start.elapsed(), std::time::SystemTime::now());
    if routed.is_some() {
        entry.args["container"] = id.into();
    }
    if let Err(e) = audit::append(&dir, &entry) {
        eprintln!("burrow: the audit log: {e:#}");
    }
    result
}

/// Where tool request `req` for container `id` goes: the state directory
/// of sandbox `id`, or, for a container of a CRI pod (which has none: its
/// pod's shim serves all of the pod's containers), the pod's, with the
/// request wrapped for that container (`Some`). A pod's own id addresses
/// its only container (the shim refuses it, listing them, when there are
/// several).
pub(crate) fn route(
    root: &std::path::Path,
    namespace: &str,
    id: &str,
    req: &SandboxRequest,
) -> Result<(std::path::PathBuf, Option<SandboxRequest>)> {
    let dir = sandbox::sandbox_dir(root, namespace, id)?;
    if dir.exists() {
        return Ok((dir, None));
    }
    for (ns, _, pod) in sandbox::list(root) {
        if ns != namespace {
            continue;
        }
        let Ok(status) = sandbox::request(&pod, &SandboxRequest::Status, Duration::from_secs(5))
        else {
            continue;
        };
        if status.containers.len() > 1 && status.containers.iter().any(|c| c == id) {
            let wrapped = SandboxRequest::In {
                container: id.into(),
                request: Box::new(req.clone()),
            };
            return Ok((pod, Some(wrapped)));
        }
    }
    bail!("there is no sandbox {id:?} in namespace {namespace:?}");
}

/// [`ask`] for a streamed `exec` ([`ExecRequest::stream`]): `on_chunk` gets
/// the output as it comes; the result is the final reply (its output
/// empty, unless the shim predates streaming). The audit log counts the
/// streamed bytes in the result's size.
pub fn ask_stream(
    root: &std::path::Path,
    namespace: &str,
    id: &str,
    req: &SandboxRequest,
    timeout: Duration,
    mut on_chunk: impl FnMut(&OutputChunk) -> Result<()>,
) -> Result<ToolReply> {
    let (dir, routed) = route(root, namespace, id, req)?;
    let start = std::time::Instant::now();
    let mut streamed = 0u64;
    let result = sandbox::request_stream(&dir, routed.as_ref().unwrap_or(req), timeout, |c| {
        streamed += c.data.len() as u64;
        on_chunk(c)
    })
    .and_then(tool_result);
    record(
        &dir,
        id,
        req,
        routed.is_some(),
        &result,
        start,
        streamed,
        None,
    );
    result
}

/// The tool result in a shim's reply.
fn tool_result(reply: burrow_vmm_api::sandbox_control::SandboxReply) -> Result<ToolReply> {
    reply
        .tool
        .context("the shim answered without a result (is it older than this CLI?)")
}

/// [`ask`] for an interactive `exec` ([`ExecRequest::stdin`]): this
/// process's stdin relayed, its output written as it comes (see
/// [`crate::interactive`]; `raw`: this terminal in raw mode meanwhile).
/// The audit log counts the output in the result's size and records the
/// input ([`audit::Typed`]).
pub fn ask_interactive(
    root: &std::path::Path,
    namespace: &str,
    id: &str,
    req: &SandboxRequest,
    timeout: Duration,
    raw: bool,
) -> Result<ToolReply> {
    let (dir, routed) = route(root, namespace, id, req)?;
    let start = std::time::Instant::now();
    let mut streamed = 0u64;
    let typed = audit::Typed::default();
    let mut io = crate::interactive::Io::std();
    io.input = typed.tee(io.input);
    let req_sent = routed.as_ref().unwrap_or(req);
    let result = crate::interactive::run(&dir, req_sent, timeout, raw, io, &mut streamed)
        .and_then(tool_result);
    let routed = routed.is_some();
    record(
        &dir,
        id,
        req,
        routed,
        &result,
        start,
        streamed,
        Some(&typed),
    );
    result
}

/// Append tool request `req`'s `result` to the audit log in `dir` (`routed`:
/// it went to container `id` of a pod; `streamed`: output bytes that came
/// before the result; `typed`: an interactive exec's input).
#[allow(clippy::too_many_arguments)]
pub(crate) fn record(
    dir: &std::path::Path,
    id: &str,
    req: &SandboxRequest,
    routed: bool,
    result: &Result<ToolReply>,
    start: std::time::Instant,
    streamed: u64,
    typed: Option<&audit::Typed>,
) {
    let mut entry = audit::entry(req, result, start.elapsed(), std::time::SystemTime::now());
    entry.result_bytes += streamed;
    if let Some(typed) = typed {
        typed.note(&mut entry);
    }
    if routed {
        entry.args["container"] = id.into();
    }
    if let Err(e) = audit::append(dir, &entry) {
        eprintln!("burrow: the audit log: {e:#}");
    }
}

#[derive(clap::Args, Debug)]
pub struct ExecArgs {
    #[command(flatten)]
    pub target: Target,
    /// Working directory in the container.
    #[arg(long)]
    pub cwd: Option<String>,
    /// Add KEY=VALUE to the command's environment (repeatable).
    #[arg(long = "env", short = 'e', value_parser = parse_env)]
    pub env: Vec<String>,
    /// Kill the command after this many seconds (exit status 124; default
    /// 600, with --detach none, with -t or -i 86400).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=MAX_EXEC_TIMEOUT_SECS))]
    pub timeout: Option<u64>,
    /// Start the command as a detached session and print its id at once;
    /// the guest keeps its output (the last 1 MiB, stdout and stderr
    /// together) across hibernation and checkpoint/restore for --attach.
    #[arg(long, conflicts_with = "attach")]
    pub detach: bool,
    /// Print detached session SESSION's output from --from on, following it
    /// until the command ends; exit with its status.
    #[arg(long, value_name = "SESSION")]
    pub attach: Option<String>,
    /// With --attach: the output offset to start from (0: the start; a
    /// stopped --attach says where to read on).
    #[arg(long, requires = "attach")]
    pub from: Option<u64>,
    /// With --attach: stop following once all output there is is printed
    /// and some was, or after this many seconds, and say where to read on
    /// (exit 0); 0 prints what there is now.
    #[arg(long, requires = "attach")]
    pub wait: Option<u64>,
    /// Run the command interactively on a terminal in the guest (a PTY:
    /// `tty` names it; stdout carries both streams), as `docker exec -it`
    /// does: this stdin goes to it (from a terminal raw, every key, ^C
    /// included; the end of piped input is ^D), its terminal has this
    /// one's size and follows its resizes, and TERM is this one's.
    #[arg(short = 't', long = "tty", conflicts_with_all = ["attach", "detach"])]
    pub tty: bool,
    /// Relay this stdin to the command (without -t: on a pipe, closed when
    /// this stdin ends).
    #[arg(short = 'i', long = "interactive", conflicts_with_all = ["attach", "detach"])]
    pub interactive: bool,
    /// The command and its arguments (after `--`).
    #[arg(
        required_unless_present = "attach",
        conflicts_with = "attach",
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    pub cmd: Vec<String>,
}

#[derive(clap::Args, Debug)]
pub struct ReadArgs {
    #[command(flatten)]
    pub target: Target,
    /// File in the container.
    pub path: String,
    /// Lines A:B (1-based, inclusive; A: to the end, :B from the start), at
    /// most 500 per call.
    #[arg(long, value_parser = parse_lines)]
    pub lines: Option<LineRange>,
}

#[derive(clap::Args, Debug)]
pub struct PathArgs {
    #[command(flatten)]
    pub target: Target,
    /// Path in the container.
    pub path: String,
}

#[derive(clap::Args, Debug)]
pub struct EditArgs {
    #[command(flatten)]
    pub target: Target,
    /// File in the container.
    pub path: String,
    /// The exact text to replace; it must occur exactly once.
    #[arg(long, allow_hyphen_values = true)]
    pub old: String,
    /// What replaces it.
    #[arg(long, allow_hyphen_values = true)]
    pub new: String,
}

fn parse_env(s: &str) -> std::result::Result<String, String> {
    match s.split_once('=') {
        Some((k, _)) if !k.is_empty() => Ok(s.to_string()),
        _ => Err(format!("{s:?} is not KEY=VALUE")),
    }
}

fn parse_lines(s: &str) -> std::result::Result<LineRange, String> {
    s.parse()
}

/// `burrow exec`: the command's exit status.
pub fn exec(a: ExecArgs) -> Result<i32> {
    if a.attach.is_none() && (a.from.is_some() || a.wait.is_some()) {
        bail!("--from and --wait go with --attach");
    }
    if let Some(session) = &a.attach {
        return crate::session::attach(&a.target, session, a.from.unwrap_or(0), a.wait);
    }
    let interactive = a.tty || a.interactive;
    let timeout = a.timeout.unwrap_or(if a.detach {
        0
    } else if interactive {
        MAX_EXEC_TIMEOUT_SECS
    } else {
        DEFAULT_EXEC_TIMEOUT_SECS
    });
    let mut env = a.env;
    if a.tty {
        let local = std::env::var("TERM").ok();
        if let Some(term) = term_env(&env, local.as_deref()) {
            env.push(term);
        }
    }
    let req = ExecRequest {
        args: a.cmd,
        cwd: a.cwd,
        env,
        timeout_secs: timeout,
        max_output: None,
        stream: !a.detach,
        tty: a.tty,
        tty_size: if a.tty {
            crate::interactive::local_size()
        } else {
            None
        },
        stdin: interactive,
    };
    if a.detach {
        return crate::session::detach(&a.target, req);
    }
    let req = SandboxRequest::Exec(req);
    let limit = Duration::from_secs(timeout) + WAKE_ALLOWANCE;
    let root = a
        .target
        .state_dir
        .clone()
        .unwrap_or_else(sandbox::state_dir_from_config);
    let (ns, id) = (&a.target.namespace, &a.target.id);
    let reply = if interactive {
        let raw = a.tty && crate::interactive::is_terminal(libc::STDIN_FILENO);
        match ask_interactive(&root, ns, id, &req, limit, raw) {
            Err(e) => match e.downcast_ref::<crate::interactive::Interrupted>() {
                Some(crate::interactive::Interrupted(sig)) => {
                    eprintln!("burrow: {e}");
                    return Ok(128 + sig);
                }
                None => return Err(e),
            },
            Ok(reply) => reply,
        }
    } else {
        // The output as it comes: each piece written and flushed at once.
        ask_stream(&root, ns, id, &req, limit, |c| {
            if c.stream == "stderr" {
                let mut err = std::io::stderr().lock();
                err.write_all(c.data.as_bytes())?;
                err.flush()?;
            } else {
                let mut out = std::io::stdout().lock();
                out.write_all(c.data.as_bytes())?;
                out.flush()?;
            }
            Ok(())
        })?
    };
    let ToolReply::Exec(out) = reply else {
        bail!("the shim answered exec with another tool's result");
    };
    // Empty from a shim that streamed; all of it from an older one.
    std::io::stdout().write_all(out.stdout.as_bytes())?;
    std::io::stdout().flush()?;
    let mut err = std::io::stderr();
    err.write_all(out.stderr.as_bytes())?;
    for note in exec_notes(&out, timeout, MAX_EXEC_OUTPUT) {
        writeln!(err, "burrow: {note}")?;
    }
    Ok(out.status())
}

/// The TERM entry `exec -t` adds to `env`: this terminal's (`local`), so
/// that what runs on the guest's terminal speaks this one's language;
/// none when the caller set TERM or there is none here.
fn term_env(env: &[String], local: Option<&str>) -> Option<String> {
    let set = env.iter().any(|kv| kv.starts_with("TERM="));
    match local {
        Some(t) if !set && !t.is_empty() => Some(format!("TERM={t}")),
        _ => None,
    }
}

/// What `exec` says about its output and status besides the output (each
/// stream having been capped to `cap` bytes).
pub fn exec_notes(out: &ExecOutput, timeout: u64, cap: usize) -> Vec<String> {
    let mut notes = Vec::new();
    let half = cap / 2 / 1024;
    for (name, cut) in [("stdout", out.stdout_cut), ("stderr", out.stderr_cut)] {
        if cut > 0 {
            notes.push(format!(
                "{cut} bytes of {name} cut (its first and last {half} KiB are shown)"
            ));
        }
    }
    if out.output_open {
        notes.push(
            "the output was still open when the command exited (a background process holds it): later output is not shown"
                .into(),
        );
    }
    if out.timed_out {
        notes.push(format!(
            "killed after {timeout} s (--timeout): exit status 124"
        ));
    }
    notes
}

/// `burrow read`.
pub fn read(a: ReadArgs) -> Result<i32> {
    let req = SandboxRequest::Read(ReadRequest {
        path: a.path.clone(),
        lines: a.lines.unwrap_or_default(),
    });
    let ToolReply::Read(out) = a.target.ask(&req, WAKE_ALLOWANCE)? else {
        bail!("the shim answered read with another tool's result");
    };
    std::io::stdout().write_all(out.text.as_bytes())?;
    std::io::stdout().flush()?;
    eprintln!("{}", read_note(&a.path, &out, lines_option));
    Ok(0)
}

/// How the CLI asks for the page from line `next`.
fn lines_option(next: u64) -> String {
    format!("--lines {next}:{}", next.saturating_add(MAX_READ_LINES - 1))
}

/// Which lines `read` showed and how many remain; `next` says how to ask
/// for the page from a line.
pub fn read_note(path: &str, out: &ReadOutput, next: impl Fn(u64) -> String) -> String {
    let shown = if out.first == 0 {
        "no lines".to_string()
    } else {
        format!("lines {}-{}", out.first, out.last)
    };
    let mut note = match (out.total, out.remaining()) {
        (Some(total), Some(rem)) => format!("[{path}: {shown} of {total}, {rem} remain"),
        _ => format!(
            "[{path}: {shown}; more than {} MiB, its lines are not counted",
            MAX_READ_SCAN >> 20
        ),
    };
    if out.remaining() != Some(0) && out.first > 0 {
        note.push_str(&format!("; next: {}", next(out.last.saturating_add(1))));
    }
    if out.line_cut {
        note.push_str(&format!("; line {} is too long and was cut", out.last));
    }
    note.push(']');
    note
}

/// `burrow write`: the file's new content from stdin.
pub fn write(a: PathArgs) -> Result<i32> {
    let content = read_stdin(MAX_WRITE)?;
    let bytes = content.len();
    let req = SandboxRequest::Write(WriteRequest {
        path: a.path.clone(),
        content,
    });
    a.target.ask(&req, WAKE_ALLOWANCE)?;
    println!("wrote {bytes} bytes to {}", a.path);
    Ok(0)
}

/// At most `max` bytes of UTF-8 text from stdin.
fn read_stdin(max: usize) -> Result<String> {
    let mut data = Vec::new();
    std::io::stdin()
        .take(max as u64 + 1)
        .read_to_end(&mut data)
        .context("reading stdin")?;
    if data.len() > max {
        bail!("stdin is longer than the {max} bytes one write carries");
    }
    String::from_utf8(data).context("stdin is not UTF-8 text (write takes text)")
}

/// `burrow ls`.
pub fn ls(a: PathArgs) -> Result<i32> {
    let req = SandboxRequest::Ls(LsRequest {
        path: a.path.clone(),
    });
    let ToolReply::Ls(out) = a.target.ask(&req, WAKE_ALLOWANCE)? else {
        bail!("the shim answered ls with another tool's result");
    };
    print!("{}", ls_text(&out));
    if out.truncated {
        eprintln!(
            "[{}: only the first {} entries are listed]",
            a.path,
            out.entries.len()
        );
    }
    Ok(0)
}

/// `ls -l`-like lines: mode, size, name (`/` after a directory, `-> target`
/// after a symlink).
pub fn ls_text(out: &LsOutput) -> String {
    let mut text = String::new();
    for e in &out.entries {
        let suffix = match (&e.target, e.kind.as_str()) {
            (Some(t), _) => format!(" -> {t}"),
            (None, "dir") => "/".into(),
            _ => String::new(),
        };
        text.push_str(&format!(
            "{} {:>10} {}{suffix}\n",
            e.mode_string(),
            e.size,
            e.name.escape_debug()
        ));
    }
    text
}

/// `burrow edit`.
pub fn edit(a: EditArgs) -> Result<i32> {
    let req = SandboxRequest::Edit(EditRequest {
        path: a.path.clone(),
        old: a.old,
        new: a.new,
    });
    let ToolReply::Edit { bytes, line } = a.target.ask(&req, WAKE_ALLOWANCE)? else {
        bail!("the shim answered edit with another tool's result");
    };
    println!(
        "edited {}: replaced at line {line} ({bytes} bytes now)",
        a.path
    );
    Ok(0)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use burrow_vmm_api::sandbox_tools::DirEntry;

    #[test]
    fn notes_say_what_was_cut_and_what_remains() {
        let out = ExecOutput {
            stdout_cut: 10,
            timed_out: true,
            ..Default::default()
        };
        let notes = exec_notes(&out, 5, MAX_EXEC_OUTPUT).join("\n");
        assert!(notes.contains("10 bytes of stdout cut"), "{notes}");
        assert!(notes.contains("killed after 5 s"), "{notes}");
        assert!(exec_notes(&ExecOutput::default(), 5, MAX_EXEC_OUTPUT).is_empty());

        let page = ReadOutput {
            first: 1,
            last: 500,
            total: Some(1200),
            ..Default::default()
        };
        assert_eq!(
            read_note("/n", &page, lines_option),
            "[/n: lines 1-500 of 1200, 700 remain; next: --lines 501:1000]"
        );
        let end = ReadOutput {
            first: 1001,
            last: 1200,
            total: Some(1200),
            ..Default::default()
        };
        assert_eq!(
            read_note("/n", &end, lines_option),
            "[/n: lines 1001-1200 of 1200, 0 remain]"
        );
        let empty = ReadOutput {
            total: Some(0),
            ..Default::default()
        };
        assert_eq!(
            read_note("/e", &empty, lines_option),
            "[/e: no lines of 0, 0 remain]"
        );
    }

    #[test]
    fn a_pod_members_requests_go_to_its_pods_shim() {
        use std::io::BufRead;
        let d = tempfile::tempdir().unwrap();
        let pod = d.path().join("default").join("pod1");
        std::fs::create_dir_all(&pod).unwrap();
        let sock = burrow_vmm_api::sandbox_control::control_socket(&pod);
        let l = std::os::unix::net::UnixListener::bind(sock).unwrap();
        let t = std::thread::spawn(move || {
            for _ in 0..2 {
                let (mut s, _) = l.accept().unwrap();
                let mut line = String::new();
                std::io::BufReader::new(&s).read_line(&mut line).unwrap();
                assert!(line.contains("\"status\""), "{line}");
                s.write_all(
                    b"{\"ok\":true,\"state\":\"running\",\"containers\":[\"pod1\",\"app\"]}\n",
                )
                .unwrap();
            }
        });
        let req = SandboxRequest::Ls(LsRequest { path: "/".into() });
        // The pod's own id: its directory, the request as it is.
        let (dir, routed) = route(d.path(), "default", "pod1", &req).unwrap();
        assert_eq!((dir.as_path(), routed), (pod.as_path(), None));
        // A member: the pod's directory, the request wrapped for it.
        let (dir, routed) = route(d.path(), "default", "app", &req).unwrap();
        assert_eq!(dir, pod);
        assert_eq!(
            routed,
            Some(SandboxRequest::In {
                container: "app".into(),
                request: Box::new(req.clone())
            })
        );
        let e = route(d.path(), "default", "nosuch", &req).unwrap_err();
        assert_eq!(
            e.to_string(),
            "there is no sandbox \"nosuch\" in namespace \"default\""
        );
        t.join().unwrap();
    }

    #[test]
    fn exec_t_passes_this_terminals_term_unless_given_one() {
        assert_eq!(
            term_env(&["A=1".into()], Some("xterm-256color")),
            Some("TERM=xterm-256color".into())
        );
        assert_eq!(term_env(&["TERM=dumb".into()], Some("xterm")), None);
        assert_eq!(term_env(&[], None), None);
        assert_eq!(term_env(&[], Some("")), None);
    }

    #[test]
    fn ls_marks_directories_and_links() {
        let out = LsOutput {
            entries: vec![
                DirEntry {
                    name: "bin".into(),
                    kind: "dir".into(),
                    size: 4096,
                    mode: 0o755,
                    target: None,
                },
                DirEntry {
                    name: "sh".into(),
                    kind: "symlink".into(),
                    size: 7,
                    mode: 0o777,
                    target: Some("busybox".into()),
                },
            ],
            truncated: false,
        };
        assert_eq!(
            ls_text(&out),
            "drwxr-xr-x       4096 bin/\nlrwxrwxrwx          7 sh -> busybox\n"
        );
    }
}
