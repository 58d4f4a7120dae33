//! Detached sessions (`StartSession`, `ReadSession`): a process whose
//! stdout and stderr the agent drains itself into one bounded ring, in the
//! order they come, so a caller reads the output by offset whenever it
//! likes. The ring is guest memory: it goes into a hibernation or
//! checkpoint with the VM and is there again after wake or restore, which
//! is the point (the host keeps nothing per session).
//!
//! At most [`MAX_SESSIONS`] sessions: a new one replaces the oldest
//! finished one and is refused while all are running. Each keeps the last
//! [`MAX_SESSION_BUFFER`] bytes; a read from before them says how many were
//! dropped.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use burrow_protocol::agent::{
    ExecProcessRequest, ReadSessionRequest, ReadSessionResponse, StartSessionRequest,
    StartSessionResponse,
};
use burrow_protocol::{MAX_SESSIONS, MAX_SESSION_BUFFER, MAX_SESSION_WAIT_MS};
use tokio::sync::watch;

use super::AgentService;
use crate::container::Container;
use crate::error::{AgentError, Result};
use crate::process::{Process, Stream};
use crate::spawn::ExitStatus;

/// Bytes one pump reads from a pipe at a time.
const PUMP_CHUNK: usize = 64 * 1024;
/// How long output may stay open after the process exited (a background
/// child holding it) before the session is done without it.
const OUTPUT_GRACE: Duration = Duration::from_secs(2);

/// The last `cap` bytes of a byte stream, addressed by their offset in it.
#[derive(Debug)]
pub struct Ring {
    buf: VecDeque<u8>,
    cap: usize,
    /// Offset of `buf`'s first byte.
    start: u64,
}

impl Ring {
    pub fn new(cap: usize) -> Self {
        Ring {
            buf: VecDeque::new(),
            cap,
            start: 0,
        }
    }

    /// Offset just past the last byte written.
    pub fn end(&self) -> u64 {
        self.start + self.buf.len() as u64
    }

    pub fn push(&mut self, data: &[u8]) {
        let data = if data.len() > self.cap {
            self.start += (data.len() - self.cap) as u64;
            &data[data.len() - self.cap..]
        } else {
            data
        };
        let over = (self.buf.len() + data.len()).saturating_sub(self.cap);
        self.buf.drain(..over);
        self.start += over as u64;
        self.buf.extend(data);
    }

    /// At most `max` bytes from `offset` (from the oldest kept byte if
    /// `offset` is older): where they start, and the bytes.
    pub fn read(&self, offset: u64, max: usize) -> (u64, Vec<u8>) {
        let from = offset.clamp(self.start, self.end());
        let skip = usize::try_from(from - self.start).unwrap_or(usize::MAX);
        (
            from,
            self.buf.iter().skip(skip).take(max).copied().collect(),
        )
    }
}

#[derive(Debug)]
struct Output {
    ring: Ring,
    exit: Option<ExitStatus>,
    timed_out: bool,
    /// Exited and its output drained (or given up on).
    done: bool,
}

#[derive(Debug)]
struct Session {
    out: Mutex<Output>,
    /// Bumped on every change of `out`.
    changed: watch::Sender<u64>,
}

impl Session {
    fn update(&self, f: impl FnOnce(&mut Output)) {
        f(&mut self.out.lock().unwrap_or_else(|p| p.into_inner()));
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn done(&self) -> bool {
        self.out.lock().unwrap_or_else(|p| p.into_inner()).done
    }
}

/// The guest's sessions, oldest first.
#[derive(Debug, Default)]
pub struct Sessions {
    inner: Mutex<(u64, BTreeMap<u64, Arc<Session>>)>,
}

impl Sessions {
    /// Room for one more session: the oldest finished one goes if needed.
    fn make_room(&self) -> Result<()> {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if inner.1.len() < MAX_SESSIONS {
            return Ok(());
        }
        let oldest_done = inner.1.iter().find(|(_, s)| s.done()).map(|(n, _)| *n);
        match oldest_done {
            Some(n) => {
                inner.1.remove(&n);
                Ok(())
            }
            None => Err(AgentError::FailedPrecondition(format!(
                "{MAX_SESSIONS} sessions are running, the most one guest holds; wait for one to end"
            ))),
        }
    }

    /// The next session's number.
    fn next(&self) -> u64 {
        let mut inner = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        inner.0 += 1;
        inner.0
    }

    fn get(&self, id: &str) -> Result<Arc<Session>> {
        let n = id
            .strip_prefix('s')
            .and_then(|n| n.parse::<u64>().ok())
            .ok_or_else(|| AgentError::InvalidArgument(format!("{id:?} is not a session id")))?;
        self.inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .get(&n)
            .cloned()
            .ok_or_else(|| {
                AgentError::NotFound(format!(
                    "no session {id:?} in this guest (only the last {MAX_SESSIONS} are kept)"
                ))
            })
    }
}

impl AgentService {
    pub(super) async fn start_session(
        &self,
        req: StartSessionRequest,
    ) -> Result<StartSessionResponse> {
        self.sessions.make_room()?;
        let n = self.sessions.next();
        let exec_id = format!("burrow-session-{n}");
        let exec = ExecProcessRequest {
            container_id: req.container_id.clone(),
            exec_id: exec_id.clone(),
            oci_process: req.oci_process,
            ..Default::default()
        };
        let pid = self.exec(exec).await?.pid;
        let c = self.container(&req.container_id)?;
        let p = c.process(&exec_id)?;
        let session = Arc::new(Session {
            out: Mutex::new(Output {
                ring: Ring::new(MAX_SESSION_BUFFER),
                exit: None,
                timed_out: false,
                done: false,
            }),
            changed: watch::Sender::new(0),
        });
        let room = self.sessions.make_room();
        if let Err(e) = room {
            let _ = p.signal(libc::SIGKILL);
            c.processes
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(&exec_id);
            return Err(e);
        }
        self.sessions
            .inner
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .1
            .insert(n, session.clone());
        let timeout = (req.timeout_secs > 0).then(|| Duration::from_secs(req.timeout_secs));
        tokio::spawn(run(session, c, p, timeout));
        tracing::info!(container = %req.container_id, session = n, pid, "session started");
        Ok(StartSessionResponse {
            session_id: format!("s{n}"),
            pid,
            ..Default::default()
        })
    }

    pub(super) async fn read_session(
        &self,
        req: ReadSessionRequest,
    ) -> Result<ReadSessionResponse> {
        let s = self.sessions.get(&req.session_id)?;
        let max = crate::fs::chunk_len(req.max_bytes);
        let wait = Duration::from_millis(u64::from(req.wait_ms.min(MAX_SESSION_WAIT_MS)));
        let mut rx = s.changed.subscribe();
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            {
                let out = s.out.lock().unwrap_or_else(|p| p.into_inner());
                if out.done || out.ring.end() > req.offset || wait.is_zero() {
                    return Ok(answer(&out, req.offset, max));
                }
            }
            match tokio::time::timeout_at(deadline, rx.changed()).await {
                Ok(Ok(())) => {}
                // The deadline passed (or the session went): what there is.
                _ => {
                    let out = s.out.lock().unwrap_or_else(|p| p.into_inner());
                    return Ok(answer(&out, req.offset, max));
                }
            }
        }
    }
}

fn answer(out: &Output, offset: u64, max: usize) -> ReadSessionResponse {
    let (start, data) = out.ring.read(offset, max);
    let end = out.ring.end();
    let mut r = ReadSessionResponse {
        dropped: start.saturating_sub(offset),
        start,
        end,
        // Done only once the caller has had everything.
        done: out.done && start + data.len() as u64 >= end,
        timed_out: out.timed_out,
        data,
        ..Default::default()
    };
    if let (true, Some(st)) = (r.done, out.exit) {
        r.exit_code = st.code;
        r.signal = st.signal;
    }
    r
}

/// Drain `p`'s output into `s` until it exited (killed at `timeout`) and
/// its output ended; then forget the process.
async fn run(s: Arc<Session>, c: Arc<Container>, p: Arc<Process>, timeout: Option<Duration>) {
    let mut drain = std::pin::pin!(async {
        tokio::join!(pump(&s, &p.stdout), pump(&s, &p.stderr));
    });
    let exited = async {
        match timeout {
            Some(t) => match tokio::time::timeout(t, p.wait()).await {
                Ok(st) => st,
                Err(_) => {
                    s.update(|o| o.timed_out = true);
                    let _ = p.signal(libc::SIGKILL);
                    p.wait().await
                }
            },
            None => p.wait().await,
        }
    };
    let mut drained = false;
    let mut exited = std::pin::pin!(exited);
    let status = loop {
        tokio::select! {
            st = &mut exited => break st,
            () = &mut drain, if !drained => drained = true,
        }
    };
    if !drained {
        let _ = tokio::time::timeout(OUTPUT_GRACE, &mut drain).await;
    }
    s.update(|o| {
        o.exit = Some(status.unwrap_or(ExitStatus {
            code: 255,
            signal: 0,
        }));
        o.done = true;
    });
    c.processes
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&p.exec_id);
}

async fn pump(s: &Session, stream: &Stream) {
    loop {
        match stream.read(PUMP_CHUNK).await {
            Ok(Some(data)) => s.update(|o| o.ring.push(&data)),
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("session output: {e}");
                return;
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_ring_keeps_the_last_bytes_by_offset() {
        let mut r = Ring::new(8);
        r.push(b"hello");
        assert_eq!(r.read(0, 100), (0, b"hello".to_vec()));
        assert_eq!(r.read(3, 1), (3, b"l".to_vec()));
        r.push(b" world");
        assert_eq!(r.end(), 11);
        // The first 3 bytes are gone: a read from 0 starts at 3.
        assert_eq!(r.read(0, 100), (3, b"lo world".to_vec()));
        assert_eq!(r.read(11, 100), (11, vec![]));
        assert_eq!(r.read(50, 100), (11, vec![]));
        // One push larger than the ring keeps its tail.
        r.push(b"0123456789abc");
        assert_eq!((r.end(), r.read(0, 100)), (24, (16, b"56789abc".to_vec())));
    }

    #[test]
    fn an_answer_is_done_only_when_all_output_was_read() {
        let mut out = Output {
            ring: Ring::new(4),
            exit: Some(ExitStatus { code: 3, signal: 0 }),
            timed_out: false,
            done: true,
        };
        out.ring.push(b"abcdef");
        let a = answer(&out, 0, 1);
        assert_eq!(
            (a.start, a.dropped, a.data.as_slice(), a.done),
            (2, 2, &b"c"[..], false)
        );
        let a = answer(&out, 3, 10);
        assert_eq!(
            (a.data.as_slice(), a.end, a.done, a.exit_code),
            (&b"def"[..], 6, true, 3)
        );
    }

    #[test]
    fn session_ids_are_checked() {
        let s = Sessions::default();
        assert!(matches!(s.get("x1"), Err(AgentError::InvalidArgument(_))));
        assert!(matches!(s.get("s1"), Err(AgentError::NotFound(_))));
    }
}
