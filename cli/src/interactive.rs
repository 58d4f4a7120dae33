//! `burrow exec -t|-i`: an interactive command in a sandbox, as `docker exec
//! -it` runs one. This side's stdin goes to the command (keystrokes, or
//! piped input whose end closes the command's stdin), its output comes
//! back as it is written, and with `-t` the command runs on a terminal in
//! the guest that is sized as this one and follows its resizes
//! (SIGWINCH). While it runs, this terminal is in raw mode ([`RawMode`]:
//! every key goes to the guest's terminal, ^C included) and is restored on
//! every way out: the command's end, an error, a panic, or SIGTERM,
//! SIGHUP, SIGINT or SIGQUIT sent to this process (which exits 128 + the
//! signal, and the command in the sandbox is stopped with the connection).
//!
//! On the control socket it is one streamed `exec` request with
//! [`ExecRequest::stdin`](burrow_vmm_api::sandbox_tools::ExecRequest) set:
//! [`ExecInput`] lines go up the same connection, output chunks with raw
//! bytes come down. Both directions are bounded: stdin is read and sent in
//! pieces of at most [`MAX_INPUT_CHUNK`] with at most [`STDIN_QUEUE`]
//! waiting, and each reply line is read to the request's reply limit.

use std::io::Read;
use std::os::fd::RawFd;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use burrow_vmm_api::sandbox_control::{control_socket, SandboxReply, SandboxRequest};
use burrow_vmm_api::sandbox_tools::{ExecInput, ToolReply, MAX_INPUT_CHUNK};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::mpsc;

/// Pieces of stdin read ahead of the connection.
pub const STDIN_QUEUE: usize = 4;

/// A terminal in raw mode until this is dropped, which puts back the
/// settings it had.
pub struct RawMode {
    fd: RawFd,
    saved: libc::termios,
}

impl RawMode {
    /// Put terminal `fd` in raw mode (no echo, no line editing, no signals
    /// from keys, no output processing); None if `fd` is not a terminal.
    pub fn enter(fd: RawFd) -> std::io::Result<Option<Self>> {
        // SAFETY: tcgetattr writes one termios into `saved`, which lives
        // across the call; on a non-terminal it fails and leaves it alone.
        let mut saved: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: see above.
        if unsafe { libc::tcgetattr(fd, &mut saved) } != 0 {
            let e = std::io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENOTTY | libc::EINVAL) => Ok(None),
                _ => Err(e),
            };
        }
        let mut raw = saved;
        // SAFETY: cfmakeraw changes the termios it is given, ours.
        unsafe { libc::cfmakeraw(&mut raw) };
        // SAFETY: tcsetattr reads the termios we pass.
        if unsafe { libc::tcsetattr(fd, libc::TCSANOW, &raw) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Some(Self { fd, saved }))
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // SAFETY: tcsetattr reads the termios we saved from this fd.
        unsafe { libc::tcsetattr(self.fd, libc::TCSADRAIN, &self.saved) };
    }
}

/// The size (rows, columns) of terminal `fd`, if it is one.
pub fn terminal_size(fd: RawFd) -> Option<(u16, u16)> {
    // SAFETY: TIOCGWINSZ writes one winsize into `ws`, which lives across
    // the call; a non-terminal fails with ENOTTY and leaves it alone.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: see above.
    let rc = unsafe { libc::ioctl(fd, libc::TIOCGWINSZ, &mut ws) };
    (rc == 0 && ws.ws_row > 0 && ws.ws_col > 0).then_some((ws.ws_row, ws.ws_col))
}

/// Whether `fd` is a terminal.
pub fn is_terminal(fd: RawFd) -> bool {
    // SAFETY: isatty only looks at the fd.
    unsafe { libc::isatty(fd) == 1 }
}

/// The size the command's terminal should have: this process's terminal
/// (stdin's, else stdout's).
pub fn local_size() -> Option<(u16, u16)> {
    terminal_size(libc::STDIN_FILENO).or_else(|| terminal_size(libc::STDOUT_FILENO))
}

/// The command was stopped because this process got signal `0`.
#[derive(Debug, thiserror::Error)]
#[error("interrupted by signal {0}: the command in the sandbox is stopped")]
pub struct Interrupted(pub i32);

/// Where an interactive exec's input comes from and its output goes:
/// this process's stdin, stdout and stderr, or a test's.
pub struct Io {
    pub input: Box<dyn Read + Send>,
    pub out: Box<dyn tokio::io::AsyncWrite + Unpin + Send>,
    pub err: Box<dyn tokio::io::AsyncWrite + Unpin + Send>,
}

impl Io {
    /// This process's stdin, stdout and stderr.
    pub fn std() -> Self {
        Self {
            input: Box::new(std::io::stdin()),
            out: Box::new(tokio::io::stdout()),
            err: Box::new(tokio::io::stderr()),
        }
    }
}

/// Run interactive exec `req` (a streamed exec with `stdin`) on the sandbox
/// whose state directory is `dir`: `io.input` relayed, output written to
/// `io` as it comes and counted in `on_bytes`; gives up after `limit`.
/// With `raw`, this terminal (stdin) is in raw mode meanwhile and its
/// resizes are sent. The final reply, or [`Interrupted`].
pub fn run(
    dir: &Path,
    req: &SandboxRequest,
    limit: Duration,
    raw: bool,
    io: Io,
    on_bytes: &mut u64,
) -> Result<SandboxReply> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the I/O loop")?;
    rt.block_on(async {
        let sock = control_socket(dir);
        let s = burrow_vmm_api::sockpath::SocketPath::new(&sock)
            .and_then(|p| std::os::unix::net::UnixStream::connect(p.path()))
            .and_then(|s| {
                s.set_nonblocking(true)?;
                tokio::net::UnixStream::from_std(s)
            })
            .with_context(|| {
                format!("connecting to {} (is the sandbox running?)", sock.display())
            })?;
        let (rd, mut wr) = s.into_split();
        wr.write_all(&burrow_vmm_api::to_line(req)).await?;
        // The signals that would end this process are caught first (so
        // that none ends it with the terminal raw), then raw mode.
        let caught = |kind| signal(kind).context("catching signals");
        let mut term = caught(SignalKind::terminate())?;
        let mut hup = caught(SignalKind::hangup())?;
        let mut int = caught(SignalKind::interrupt())?;
        let mut quit = caught(SignalKind::quit())?;
        let winch = caught(SignalKind::window_change())?;
        let _raw = if raw {
            RawMode::enter(libc::STDIN_FILENO).context("putting the terminal in raw mode")?
        } else {
            None
        };
        let sender = tokio::spawn(send_input(wr, read_input(io.input), raw.then_some(winch)));
        let stopped = async {
            tokio::select! {
                _ = term.recv() => libc::SIGTERM,
                _ = hup.recv() => libc::SIGHUP,
                _ = int.recv() => libc::SIGINT,
                _ = quit.recv() => libc::SIGQUIT,
            }
        };
        let relay = relay_output(rd, req, io.out, io.err, on_bytes);
        let result = tokio::select! {
            r = tokio::time::timeout(limit, relay) => match r {
                Ok(r) => r,
                Err(_) => Err(anyhow::anyhow!("no end after {} s", limit.as_secs())),
            },
            n = stopped => Err(Interrupted(n).into()),
        };
        sender.abort();
        result
    })
}

/// `input` in pieces of at most [`MAX_INPUT_CHUNK`] bytes, read by a
/// thread ([`STDIN_QUEUE`] pieces ahead at most); the channel ends with
/// the input.
fn read_input(mut input: Box<dyn Read + Send>) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel(STDIN_QUEUE);
    std::thread::spawn(move || {
        let mut buf = vec![0u8; MAX_INPUT_CHUNK];
        loop {
            match input.read(&mut buf) {
                Ok(0) => return,
                Ok(n) => {
                    if tx.blocking_send(buf[..n].to_vec()).is_err() {
                        return;
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                // A terminal that went away (EIO) ends the input too.
                Err(_) => return,
            }
        }
    });
    rx
}

/// Send stdin's pieces, its end and (with `winch`) this terminal's new
/// sizes up the connection. Keeps the connection's write side open after
/// stdin ended: closing it would stop the command.
async fn send_input(
    mut wr: tokio::net::unix::OwnedWriteHalf,
    mut stdin: mpsc::Receiver<Vec<u8>>,
    mut winch: Option<tokio::signal::unix::Signal>,
) -> std::io::Result<()> {
    let mut open = true;
    loop {
        let input = tokio::select! {
            d = stdin.recv(), if open => match d {
                Some(data) => ExecInput::Data { data },
                None => {
                    open = false;
                    ExecInput::Eof
                }
            },
            Some(()) = async { winch.as_mut()?.recv().await }, if winch.is_some() => {
                match local_size() {
                    Some((rows, cols)) => ExecInput::Resize { rows, cols },
                    None => continue,
                }
            }
            else => std::future::pending().await,
        };
        wr.write_all(&burrow_vmm_api::to_line(&input)).await?;
    }
}

/// Write the command's output to stdout and stderr as its chunks come;
/// the final reply. `on_bytes` counts the output.
async fn relay_output(
    rd: tokio::net::unix::OwnedReadHalf,
    req: &SandboxRequest,
    mut out: Box<dyn tokio::io::AsyncWrite + Unpin + Send>,
    mut err: Box<dyn tokio::io::AsyncWrite + Unpin + Send>,
    on_bytes: &mut u64,
) -> Result<SandboxReply> {
    let cmd = req.name();
    let mut rd = BufReader::new(rd);
    let mut line = Vec::new();
    loop {
        line.clear();
        let n = (&mut rd)
            .take(req.reply_limit())
            .read_until(b'\n', &mut line)
            .await
            .with_context(|| format!("reading the reply to {cmd:?}"))?;
        if n == 0 {
            bail!("the shim closed the connection before {cmd:?} ended");
        }
        let reply: SandboxReply = serde_json::from_slice(&line).with_context(|| {
            format!(
                "bad reply {:?}",
                String::from_utf8_lossy(&line[..line.len().min(200)])
            )
        })?;
        if !reply.ok {
            let e = reply.error.as_deref().unwrap_or("?");
            bail!("{cmd} failed: {e} (sandbox is {})", reply.state);
        }
        let Some(ToolReply::Chunk(c)) = &reply.tool else {
            return Ok(reply);
        };
        let to = if c.stream == "stderr" {
            &mut err
        } else {
            &mut out
        };
        to.write_all(c.data.as_bytes()).await?;
        to.write_all(&c.bytes).await?;
        to.flush().await?;
        *on_bytes += (c.data.len() + c.bytes.len()) as u64;
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    /// A new pseudo-terminal: (master, slave).
    fn pty() -> (OwnedFd, OwnedFd) {
        let (mut m, mut s) = (0, 0);
        // SAFETY: openpty writes two new fds into m and s; the name,
        // termios and size pointers may be null.
        let rc = unsafe {
            libc::openpty(
                &mut m,
                &mut s,
                std::ptr::null_mut(),
                std::ptr::null(),
                std::ptr::null(),
            )
        };
        assert_eq!(rc, 0, "{}", std::io::Error::last_os_error());
        // SAFETY: openpty made them; nothing else owns them.
        unsafe { (OwnedFd::from_raw_fd(m), OwnedFd::from_raw_fd(s)) }
    }

    fn lflag(fd: RawFd) -> libc::tcflag_t {
        // SAFETY: as in RawMode::enter.
        let mut t: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: as in RawMode::enter.
        assert_eq!(unsafe { libc::tcgetattr(fd, &mut t) }, 0);
        t.c_lflag
    }

    #[test]
    fn raw_mode_is_undone_when_dropped_also_by_a_panic() {
        let (_m, s) = pty();
        let fd = s.as_raw_fd();
        let cooked = lflag(fd);
        assert_ne!(cooked & libc::ICANON, 0);
        assert_ne!(cooked & libc::ECHO, 0);
        {
            let _raw = RawMode::enter(fd).unwrap().unwrap();
            let l = lflag(fd);
            assert_eq!(l & (libc::ICANON | libc::ECHO | libc::ISIG), 0, "{l:o}");
        }
        assert_eq!(lflag(fd), cooked);
        // A panic while raw unwinds through the guard.
        let r = std::panic::catch_unwind(|| {
            let _raw = RawMode::enter(fd).unwrap().unwrap();
            panic!("boom");
        });
        assert!(r.is_err());
        assert_eq!(lflag(fd), cooked);
        // Not a terminal: nothing to do.
        let f = std::fs::File::open("/dev/null").unwrap();
        assert!(RawMode::enter(f.as_raw_fd()).unwrap().is_none());
        assert!(!is_terminal(f.as_raw_fd()) && is_terminal(fd));
    }

    #[test]
    fn the_size_is_the_terminals() {
        let (_m, s) = pty();
        let ws = libc::winsize {
            ws_row: 33,
            ws_col: 77,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads the winsize we pass.
        assert_eq!(
            unsafe { libc::ioctl(s.as_raw_fd(), libc::TIOCSWINSZ, &ws) },
            0
        );
        assert_eq!(terminal_size(s.as_raw_fd()), Some((33, 77)));
        let f = std::fs::File::open("/dev/null").unwrap();
        assert_eq!(terminal_size(f.as_raw_fd()), None);
    }

    /// An AsyncWrite into a shared buffer.
    #[derive(Clone, Default)]
    struct Shared(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

    impl tokio::io::AsyncWrite for Shared {
        fn poll_write(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            self.0.lock().unwrap().extend_from_slice(buf);
            std::task::Poll::Ready(Ok(buf.len()))
        }
        fn poll_flush(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
        fn poll_shutdown(
            self: std::pin::Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::task::Poll::Ready(Ok(()))
        }
    }

    /// A shim on `l` that echoes each input piece back as raw output (the
    /// second on stderr) and answers the input's end with exit 5: the
    /// pieces it got.
    fn echoing_shim(l: std::os::unix::net::UnixListener) -> Vec<Vec<u8>> {
        use std::io::{BufRead, Write};
        let (s, _) = l.accept().unwrap();
        let mut r = std::io::BufReader::new(&s);
        let mut w = &s;
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        assert!(line.contains("\"stdin\":true"), "{line}");
        let send = |w: &mut &std::os::unix::net::UnixStream, t: ToolReply| {
            w.write_all(&burrow_vmm_api::to_line(&SandboxReply::tool(
                "running",
                Ok(t),
            )))
            .unwrap()
        };
        let mut pieces = Vec::new();
        loop {
            line.clear();
            r.read_line(&mut line).unwrap();
            match ExecInput::parse(line.as_bytes()).unwrap() {
                ExecInput::Data { data } => {
                    let stream = if pieces.len() == 1 {
                        "stderr"
                    } else {
                        "stdout"
                    };
                    let chunk = burrow_vmm_api::sandbox_tools::OutputChunk {
                        stream: stream.into(),
                        data: String::new(),
                        bytes: data.clone(),
                    };
                    send(&mut w, ToolReply::Chunk(chunk));
                    pieces.push(data);
                }
                ExecInput::Eof => break,
                other => panic!("{other:?}"),
            }
        }
        let done = burrow_vmm_api::sandbox_tools::ExecOutput {
            exit_code: Some(5),
            ..Default::default()
        };
        send(&mut w, ToolReply::Exec(done));
        pieces
    }

    #[test]
    fn input_goes_up_in_bounded_pieces_then_its_end_and_output_comes_down_raw() {
        let d = tempfile::tempdir().unwrap();
        let sb = d.path().join("default").join("s1");
        std::fs::create_dir_all(&sb).unwrap();
        let l = std::os::unix::net::UnixListener::bind(control_socket(&sb)).unwrap();
        let shim = std::thread::spawn(move || echoing_shim(l));
        // More than two pieces of input, not UTF-8.
        let input: Vec<u8> = (0..MAX_INPUT_CHUNK * 2 + 100)
            .map(|i| (i % 251) as u8)
            .collect();
        let (out, err) = (Shared::default(), Shared::default());
        let io = Io {
            input: Box::new(std::io::Cursor::new(input.clone())),
            out: Box::new(out.clone()),
            err: Box::new(err.clone()),
        };
        let req = SandboxRequest::Exec(burrow_vmm_api::sandbox_tools::ExecRequest {
            args: vec!["sh".into()],
            stream: true,
            stdin: true,
            ..Default::default()
        });
        let mut bytes = 0;
        let reply = run(&sb, &req, Duration::from_secs(30), false, io, &mut bytes).unwrap();
        let Some(ToolReply::Exec(end)) = reply.tool else {
            panic!("{reply:?}")
        };
        assert_eq!(end.status(), 5);
        let pieces = shim.join().unwrap();
        assert!(pieces.len() >= 3, "{}", pieces.len());
        assert!(pieces.iter().all(|p| p.len() <= MAX_INPUT_CHUNK));
        assert_eq!(pieces.concat(), input);
        assert_eq!(bytes, input.len() as u64);
        let (out, err) = (out.0.lock().unwrap(), err.0.lock().unwrap());
        assert_eq!(err.as_slice(), pieces[1].as_slice());
        assert_eq!(out.len() + err.len(), input.len());
    }
}
