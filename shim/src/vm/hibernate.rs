//! Hibernation as the sandbox uses it: snapshot the VM to `<snapshot_dir>/
//! <namespace>/<sandbox id>/` and stop burrow-vmm (no process, no guest RAM
//! on the host) while containerd still sees the task running; restore it
//! transparently on the next call that needs the guest. The state machine
//! (phases, the incremental chain, waking) is the
//! [`Lifecycle`](super::lifecycle::Lifecycle)'s; this file holds its two
//! triggers, the disk limit's check ([`super::disk_budget`]) and the
//! manifest each link gets:
//!
//! - Hibernate on idle: `hibernate_idle_secs` (config) or the annotation
//!   `io.burrow.hibernate_idle_secs`; a timer hibernates after that long
//!   with no exec, no stdio traffic, no RPC that reached the guest and a
//!   guest that does not compute: a VMM using more than
//!   [`BUSY_CPU_PERCENT`] of a CPU over a second counts as activity (a
//!   build or a test run that prints nothing is not idle).
//! - A control socket `<state dir>/control.sock` takes JSON lines
//!   `{"cmd":"hibernate"|"wake"|"status"}` or
//!   `{"cmd":"checkpoint","name":NAME}` (see [`super::named`]) and answers
//!   `{"ok":true,"state":PHASE}` (the lifecycle's phase name: `running`,
//!   `paused`, `snapshotting`, `asleep`, ...; with `"dir"` for a
//!   checkpoint) or `{"ok":false,"error":"..."}` (the `burrow sandbox`
//!   verbs use it). It also takes the tool requests of `burrow exec|read|
//!   write|ls|edit|cp` ([`super::tools`], [`super::copy`]), which wake the VM first; an
//!   interactive exec (`burrow exec -t|-i`) reads its caller's input lines
//!   on the same connection ([`read_input`]).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use burrow_vmm_api::sandbox_control::{SandboxReply, SandboxRequest};
use burrow_vmm_api::sandbox_tools::{
    ExecInput, ExecRequest, OutputChunk, ToolReply, MAX_INPUT_LINE,
};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};
use tokio::sync::mpsc;

use super::checkpoint;
use super::lifecycle::Phase;
use super::VmSandbox;
use crate::sandbox::{Result, Stream};
use crate::spec;
use crate::tools::Sink;

/// The control socket's file name in the sandbox's state directory, and
/// its longest request line.
pub use burrow_vmm_api::sandbox_control::{CONTROL_SOCKET, MAX_REQUEST};

pub use super::lifecycle::MAX_CHAIN;

impl VmSandbox {
    /// Record activity (resets the idle timer).
    pub(super) fn touch(&self) {
        *self.last_activity.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    /// Hold off idle hibernation until the guard is dropped (then the
    /// idle time counts from there).
    pub(super) fn busy(&self) -> Busy<'_> {
        self.busy.fetch_add(1, Ordering::SeqCst);
        Busy(self)
    }

    fn is_busy(&self) -> bool {
        self.busy.load(Ordering::SeqCst) > 0
    }

    fn idle_for(&self) -> Duration {
        self.last_activity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .elapsed()
    }

    /// Snapshot the VM and stop burrow-vmm. A no-op when already asleep.
    /// Refused, with the VM left running, when a link of the VM's memory
    /// size would take the sandbox over its disk limit.
    pub async fn hibernate(&self) -> Result<()> {
        let c = self.a_container()?;
        if let Phase::Running(h) = self.vm.phase() {
            self.check_disk("a hibernation", h.memory_mib << 20)?;
        }
        let dir = self.vm.hibernate_dir().to_path_buf();
        self.vm
            .hibernate(|info, link| {
                let r = checkpoint::complete_hibernation(&dir, &c, info, link);
                async { r }
            })
            .await
    }

    /// Restore a hibernated VM and reconnect. A no-op when it runs.
    pub async fn wake(&self) -> Result<()> {
        self.touch();
        self.vm.wake().await
    }

    /// After a container's VM is up: the control socket, and the idle timer
    /// if the config or the spec asks for one.
    pub(super) fn started(&self, container_spec: &serde_json::Value) {
        self.touch();
        let idle = spec::annotation(container_spec, spec::ANNOTATION_HIBERNATE_IDLE)
            .and_then(|v| v.trim().parse::<u64>().ok())
            .or_else(|| self.cfg().ok().map(|c| c.hibernate_idle_secs))
            .unwrap_or(0);
        let sock = self.path(CONTROL_SOCKET);
        let _ = std::fs::remove_file(&sock);
        let bound = burrow_vmm_api::sockpath::SocketPath::new(&sock)
            .and_then(|p| UnixListener::bind(p.path()));
        match bound {
            Ok(l) => {
                tokio::spawn(serve_control(self.me.clone(), l));
            }
            Err(e) => tracing::warn!("control socket {}: {e}", sock.display()),
        }
        if idle > 0 {
            tracing::info!("hibernating after {idle}s idle");
            tokio::spawn(idle_timer(self.me.clone(), Duration::from_secs(idle)));
        }
    }
}

/// Work in flight ([`VmSandbox::busy`]).
pub(super) struct Busy<'a>(&'a VmSandbox);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::SeqCst);
        self.0.touch();
    }
}

/// A VMM using more than this share of one CPU (its vCPUs running the
/// guest, its devices working) has a guest at work: not idle. An idle
/// guest's VMM uses next to nothing (nothing polls), a computing one a
/// whole CPU per busy vCPU.
pub const BUSY_CPU_PERCENT: u64 = 30;

/// CPU time (user and system, clock ticks) process `pid` has used so far.
fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name's ')': state is the first; utime and
    // stime are the 12th and 13th (fields 14 and 15 of proc(5)).
    let rest = stat.get(stat.rfind(')')? + 1..)?;
    let mut f = rest.split_whitespace().skip(11);
    let utime: u64 = f.next()?.parse().ok()?;
    let stime: u64 = f.next()?.parse().ok()?;
    Some(utime.saturating_add(stime))
}

/// Whether `ticks` of CPU time (at `per_sec` a second) over `wall` are
/// more than [`BUSY_CPU_PERCENT`] of one CPU.
fn cpu_busy(ticks: u64, wall: Duration, per_sec: u64) -> bool {
    let wall_ms = u64::try_from(wall.as_millis()).unwrap_or(u64::MAX);
    ticks.saturating_mul(100_000) > BUSY_CPU_PERCENT.saturating_mul(per_sec).saturating_mul(wall_ms)
}

/// The VMM's CPU time at the last tick: (pid, ticks, when).
type CpuMark = Option<(u32, u64, Instant)>;

/// Touch `sb` when its VMM `pid` worked since `mark`; the new mark.
fn note_cpu(sb: &VmSandbox, pid: u32, mark: CpuMark) -> CpuMark {
    // SAFETY: sysconf has no preconditions.
    let per_sec = u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).unwrap_or(100);
    let now = cpu_ticks(pid)?;
    if let Some((was_pid, then, at)) = mark {
        if was_pid == pid && cpu_busy(now.saturating_sub(then), at.elapsed(), per_sec.max(1)) {
            sb.touch();
        }
    }
    Some((pid, now, Instant::now()))
}

async fn idle_timer(me: std::sync::Weak<VmSandbox>, idle: Duration) {
    let tick = Duration::from_secs(1).min(idle);
    let mut mark: CpuMark = None;
    loop {
        tokio::time::sleep(tick).await;
        let Some(sb) = me.upgrade() else { return };
        let phase = sb.vm.phase();
        mark = match &phase {
            Phase::Running(h) => note_cpu(&sb, h.pid, mark),
            _ => None,
        };
        match phase {
            // The VM was stopped for good.
            Phase::Gone(_) => return,
            Phase::Running(_) if sb.idle_for() >= idle && !sb.is_busy() => {
                tracing::info!("idle for {}s: hibernating", idle.as_secs());
                if let Err(e) = sb.hibernate().await {
                    tracing::warn!("hibernate on idle: {e}");
                    sb.touch();
                }
            }
            _ => {}
        }
    }
}

async fn serve_control(me: std::sync::Weak<VmSandbox>, l: UnixListener) {
    loop {
        let Ok((s, _)) = l.accept().await else { return };
        let Some(sb) = me.upgrade() else { return };
        tokio::spawn(async move {
            if let Err(e) = handle_control(&sb, s).await {
                tracing::debug!("control socket: {e}");
            }
        });
    }
}

/// The control connection's read side after its request line: an
/// interactive exec's input lines follow.
type ControlReader = BufReader<tokio::io::Take<tokio::net::unix::OwnedReadHalf>>;

async fn handle_control(sb: &VmSandbox, s: UnixStream) -> std::io::Result<()> {
    let (r, w) = s.into_split();
    let mut line = String::new();
    let mut rd: ControlReader = BufReader::new(r.take(MAX_REQUEST));
    rd.read_line(&mut line).await?;
    let answer = match serde_json::from_str::<SandboxRequest>(line.trim()) {
        Err(_) if !line.ends_with('\n') && line.len() as u64 >= MAX_REQUEST => SandboxReply::new(
            sb.vm.phase().name(),
            Err(format!("request longer than {MAX_REQUEST} bytes")),
        ),
        Err(e) => SandboxReply::new(sb.vm.phase().name(), Err(format!("bad request: {e}"))),
        Ok(req) => {
            let status = req == SandboxRequest::Status;
            // A tool call (an exec above all) holds off idle hibernation
            // until it is answered, however quiet it is meanwhile.
            let _busy = match req {
                SandboxRequest::Hibernate
                | SandboxRequest::Wake
                | SandboxRequest::Status
                | SandboxRequest::Checkpoint { .. } => None,
                _ => Some(sb.busy()),
            };
            let result = match req {
                SandboxRequest::Hibernate => sb.hibernate().await.map(|()| None),
                SandboxRequest::Wake => sb.wake().await.map(|()| None),
                SandboxRequest::Status => Ok(None),
                SandboxRequest::Checkpoint { name } => sb.checkpoint_named(&name).await.map(Some),
                SandboxRequest::Exec(r) if r.stream => return stream_exec(sb, r, w, rd).await,
                SandboxRequest::Upload(r) => return super::copy::upload(sb, r, w, rd).await,
                SandboxRequest::Download(r) => return super::copy::download(sb, r, w).await,
                SandboxRequest::In { container, request } => {
                    let run = async {
                        match *request {
                            SandboxRequest::Exec(r) if r.stream => {
                                stream_exec(sb, r, w, rd).await
                            }
                            SandboxRequest::Upload(r) => super::copy::upload(sb, r, w, rd).await,
                            SandboxRequest::Download(r) => super::copy::download(sb, r, w).await,
                            tool => {
                                let r = sb.tool(tool).await.map_err(|e| e.to_string());
                                reply(w, SandboxReply::tool(sb.vm.phase().name(), r)).await
                            }
                        }
                    };
                    return super::tools::TOOL_TARGET.scope(container, run).await;
                }
                tool => {
                    let r = sb.tool(tool).await.map_err(|e| e.to_string());
                    return reply(w, SandboxReply::tool(sb.vm.phase().name(), r)).await;
                }
            };
            let mut answer =
                SandboxReply::new(sb.vm.phase().name(), result.map_err(|e| e.to_string()));
            if status {
                answer.containers = sb.tool_containers();
            }
            answer
        }
    };
    reply(w, answer).await
}

/// A streamed `exec`: each piece of output as a [`ToolReply::Chunk`] line as
/// it comes, then the final reply (its output empty). A caller that stops
/// reading slows the command (the channel and its pipes fill); one that
/// goes away has it killed. An interactive one ([`ExecRequest::stdin`])
/// also reads the caller's input lines from `rd` ([`read_input`]), and its
/// chunks carry raw bytes.
async fn stream_exec(
    sb: &VmSandbox,
    r: ExecRequest,
    mut w: tokio::net::unix::OwnedWriteHalf,
    rd: ControlReader,
) -> std::io::Result<()> {
    let (tx, mut rx) = mpsc::channel(8);
    let raw = r.stdin;
    let (reader, input) = if raw {
        let (in_tx, in_rx) = mpsc::channel(INPUT_QUEUE);
        (Some(tokio::spawn(read_input(rd, in_tx))), Some(in_rx))
    } else {
        (None, None)
    };
    // Aborted however this ends (it holds the connection's read side).
    let _reader_guard = reader.as_ref().map(|r| AbortOnDrop(r.abort_handle()));
    let mut reader_done = reader;
    let run = sb.tool_exec_to(r, Sink::Stream(tx), input);
    tokio::pin!(run);
    let mut pieces = Pieces::default();
    let mut write_failed = None;
    let result = loop {
        tokio::select! {
            r = &mut run => break r,
            why = async { reader_done.as_mut()?.await.ok() }, if reader_done.is_some() => {
                reader_done = None;
                if let Some(why) = why.flatten() {
                    // Stop the command (its sink is closed).
                    tracing::info!("interactive exec: the caller's input {why}: stopping the command");
                    rx.close();
                }
            }
            Some((stream, data)) = rx.recv() => {
                if write_failed.is_some() {
                    continue;
                }
                let line = if raw {
                    raw_line(sb.vm.phase().name(), stream, data)
                } else {
                    pieces.line(sb.vm.phase().name(), stream, &data, false)
                };
                if let Some(line) = line {
                    if let Err(e) = w.write_all(&line).await {
                        // Stop the command (its sink is closed) and wait
                        // for it to be cleaned up.
                        rx.close();
                        write_failed = Some(e);
                    }
                }
            }
        }
    };
    if let Some(e) = write_failed {
        return Err(e);
    }
    while let Ok((stream, data)) = rx.try_recv() {
        let line = if raw {
            raw_line(sb.vm.phase().name(), stream, data)
        } else {
            pieces.line(sb.vm.phase().name(), stream, &data, false)
        };
        if let Some(line) = line {
            w.write_all(&line).await?;
        }
    }
    for stream in [Stream::Stdout, Stream::Stderr] {
        if let Some(line) = pieces.line(sb.vm.phase().name(), stream, &[], true) {
            w.write_all(&line).await?;
        }
    }
    let r = result.map(ToolReply::Exec).map_err(|e| e.to_string());
    reply(w, SandboxReply::tool(sb.vm.phase().name(), r)).await
}

/// How many input lines wait between the connection and the command: with
/// [`MAX_INPUT_LINE`] each, what a flood of input holds in the shim.
const INPUT_QUEUE: usize = 4;

/// Aborts its task when dropped.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Read an interactive exec's input lines ([`ExecInput`]) from `rd` and
/// queue them for the command, each line at most [`MAX_INPUT_LINE`] bytes
/// (the queue is bounded: a caller that sends faster than the command
/// reads waits on its socket). Returns why the caller's input stopped
/// (its connection ended, a bad or overlong line): the command is
/// stopped then. Returns nothing to say (None) when the command's side is
/// gone first.
async fn read_input<R: tokio::io::AsyncRead + Unpin>(
    mut rd: BufReader<tokio::io::Take<R>>,
    tx: mpsc::Sender<ExecInput>,
) -> Option<String> {
    let mut line = Vec::new();
    loop {
        line.clear();
        rd.get_mut().set_limit(MAX_INPUT_LINE);
        match rd.read_until(b'\n', &mut line).await {
            Ok(0) => return Some("ended".into()),
            Err(e) => return Some(format!("failed: {e}")),
            Ok(_) if line.last() != Some(&b'\n') => {
                return Some(format!(
                    "ended mid-line or sent a line longer than {MAX_INPUT_LINE} bytes"
                ))
            }
            Ok(_) => {}
        }
        let input = match ExecInput::parse(&line) {
            Ok(i) => i,
            Err(e) => return Some(e),
        };
        if tx.send(input).await.is_err() {
            return None;
        }
    }
}

/// An interactive exec's output piece as a reply line: its bytes as
/// they are.
fn raw_line(state: &str, stream: Stream, data: Vec<u8>) -> Option<Vec<u8>> {
    if data.is_empty() {
        return None;
    }
    let chunk = ToolReply::Chunk(OutputChunk {
        stream: match stream {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
        .into(),
        data: String::new(),
        bytes: data,
    });
    Some(burrow_vmm_api::to_line(&SandboxReply::tool(state, Ok(chunk))))
}

/// Output pieces as reply lines, each ending on a whole character: a
/// character split between two reads waits for the next (at most 3 bytes
/// per stream).
#[derive(Default)]
struct Pieces {
    carry: [Vec<u8>; 2],
}

impl Pieces {
    /// The line for `data` of `stream` (None: nothing to send yet); with
    /// `last`, whatever is left, invalid bytes as U+FFFD.
    fn line(&mut self, state: &str, stream: Stream, data: &[u8], last: bool) -> Option<Vec<u8>> {
        let (k, name) = match stream {
            Stream::Stdout => (0, "stdout"),
            Stream::Stderr => (1, "stderr"),
        };
        let carry = &mut self.carry[k];
        carry.extend_from_slice(data);
        let keep = if last {
            0
        } else {
            match std::str::from_utf8(carry) {
                Err(e) if e.error_len().is_none() => carry.len() - e.valid_up_to(),
                _ => 0,
            }
        };
        let send: Vec<u8> = carry.drain(..carry.len() - keep).collect();
        if send.is_empty() {
            return None;
        }
        let chunk = ToolReply::Chunk(OutputChunk {
            stream: name.into(),
            data: String::from_utf8_lossy(&send).into_owned(),
            bytes: Vec::new(),
        });
        Some(burrow_vmm_api::to_line(&SandboxReply::tool(
            state,
            Ok(chunk),
        )))
    }
}

async fn reply(
    mut w: tokio::net::unix::OwnedWriteHalf,
    answer: SandboxReply,
) -> std::io::Result<()> {
    w.write_all(&burrow_vmm_api::to_line(&answer)).await?;
    w.shutdown().await
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// The chunk a line carries.
    fn chunk(line: &[u8]) -> OutputChunk {
        let r: SandboxReply = serde_json::from_slice(line).unwrap();
        match r.tool {
            Some(ToolReply::Chunk(c)) => c,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_vmm_that_computes_is_not_idle() {
        let second = Duration::from_secs(1);
        assert!(!cpu_busy(0, second, 100), "no CPU: idle");
        assert!(!cpu_busy(30, second, 100), "30% of a CPU: idle");
        assert!(cpu_busy(31, second, 100));
        assert!(cpu_busy(200, second, 100), "two vCPUs computing");
        assert!(!cpu_busy(50, Duration::from_secs(2), 100), "25% over 2 s");
        assert!(cpu_busy(u64::MAX, second, 100), "no overflow");
        assert!(!cpu_busy(0, Duration::ZERO, 100));
        // This very process: it has used some CPU, and reads back.
        let me = cpu_ticks(std::process::id());
        assert!(me.is_some(), "utime and stime of /proc/self/stat");
        assert_eq!(cpu_ticks(u32::MAX), None, "no such process");
    }

    #[test]
    fn pieces_end_on_whole_characters_per_stream() {
        let mut p = Pieces::default();
        let euro = "€".as_bytes();
        let line = p
            .line("running", Stream::Stdout, &[b'a', euro[0]], false)
            .unwrap();
        assert_eq!(
            chunk(&line),
            OutputChunk {
                stream: "stdout".into(),
                data: "a".into(),
                ..Default::default()
            }
        );
        // The other stream is its own; the split character waits.
        let line = p.line("running", Stream::Stderr, b"e", false).unwrap();
        assert_eq!(chunk(&line).data, "e");
        assert!(p
            .line("running", Stream::Stdout, &euro[1..2], false)
            .is_none());
        let line = p
            .line("running", Stream::Stdout, &euro[2..], false)
            .unwrap();
        assert_eq!(chunk(&line).data, "€");
        // Invalid bytes mid-stream pass as U+FFFD; at the end, a cut
        // character too.
        let line = p
            .line("running", Stream::Stdout, &[0xff, b'x'], false)
            .unwrap();
        assert_eq!(chunk(&line).data, "\u{fffd}x");
        assert!(p
            .line("running", Stream::Stdout, &euro[..1], false)
            .is_none());
        let line = p.line("running", Stream::Stdout, &[], true).unwrap();
        assert_eq!(chunk(&line).data, "\u{fffd}");
        assert!(p.line("running", Stream::Stderr, &[], true).is_none());
    }

    /// `read_input` over a socket pair: what the command gets, and why the
    /// input stopped.
    async fn read_input_of(sent: Vec<u8>) -> (Vec<ExecInput>, Option<String>) {
        let (a, mut b) = tokio::net::UnixStream::pair().unwrap();
        let (tx, mut rx) = mpsc::channel(INPUT_QUEUE);
        let reader = tokio::spawn(read_input(BufReader::new(a.take(0)), tx));
        let writer = tokio::spawn(async move {
            // The peer may stop reading first (the caller's flood waits).
            let _ = b.write_all(&sent).await;
        });
        let mut got = Vec::new();
        while let Some(i) = rx.recv().await {
            got.push(i);
        }
        writer.await.unwrap();
        (got, reader.await.unwrap())
    }

    #[tokio::test]
    async fn input_lines_reach_the_command_in_order_and_a_bad_one_stops_it() {
        let data = |d: &[u8]| ExecInput::Data { data: d.to_vec() };
        let mut sent = Vec::new();
        for i in [
            data(b"echo hi\r"),
            ExecInput::Resize { rows: 40, cols: 120 },
            ExecInput::Eof,
        ] {
            sent.extend(burrow_vmm_api::to_line(&i));
        }
        let (got, why) = read_input_of(sent.clone()).await;
        assert_eq!(
            got,
            [
                data(b"echo hi\r"),
                ExecInput::Resize { rows: 40, cols: 120 },
                ExecInput::Eof
            ]
        );
        assert_eq!(why.as_deref(), Some("ended"));
        // A bad line, a line cut off by the end, an overlong line: what
        // came before arrives, then the input stops, saying why.
        let mut bad = sent.clone();
        bad.extend(b"{\"input\":\"kill\"}\n");
        let (got, why) = read_input_of(bad).await;
        assert_eq!(got.len(), 3);
        assert!(why.unwrap().contains("bad input line"));
        let mut cut = sent.clone();
        cut.extend(b"{\"input\":");
        let (got, why) = read_input_of(cut).await;
        assert_eq!(got.len(), 3);
        assert!(why.unwrap().contains("mid-line"));
        let mut long = sent;
        long.extend(b"{\"input\":\"data\",\"data\":\"");
        long.extend(vec![b'A'; 4 * MAX_INPUT_LINE as usize]);
        let (got, why) = read_input_of(long).await;
        assert_eq!(got.len(), 3);
        assert!(why.unwrap().contains("longer than"));
    }
}
