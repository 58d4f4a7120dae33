//! A Chrome DevTools Protocol client over `--remote-debugging-pipe`:
//! JSON messages, each ended by a NUL byte, written to Chromium's fd 3 and
//! read from its fd 4.
//!
//! One reader task routes replies (`{"id": N, ...}`) to the call waiting
//! for them and broadcasts events (`{"method": ...}`). Every buffer is
//! bounded: a message over [`MAX_MESSAGE`] is skipped (and the call it
//! answers fails), and nothing Chromium sends is trusted to be well formed.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::unix::pipe;
use tokio::sync::{broadcast, oneshot};

/// Largest message read from Chromium (a 4096x4096 PNG screenshot in
/// base64 can come close; anything larger is dropped).
pub const MAX_MESSAGE: usize = 64 << 20;

/// Events buffered for slow listeners before the oldest are dropped.
const EVENT_BACKLOG: usize = 512;

/// Why a call failed.
#[derive(Debug, Clone)]
pub enum CdpError {
    /// Chromium answered with a protocol error.
    Protocol { code: i64, message: String },
    /// The pipe is closed (Chromium exited) or broke.
    Closed(String),
    /// No answer in time.
    Timeout,
    /// The answer was larger than [`MAX_MESSAGE`].
    TooLarge,
}

impl std::fmt::Display for CdpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CdpError::Protocol { code, message } => write!(f, "{message} (CDP error {code})"),
            CdpError::Closed(why) => write!(f, "the DevTools pipe closed: {why}"),
            CdpError::Timeout => f.write_str("Chromium did not answer in time"),
            CdpError::TooLarge => write!(f, "Chromium's answer was over {MAX_MESSAGE} bytes"),
        }
    }
}

/// An event Chromium sent.
#[derive(Debug, Clone)]
pub struct Event {
    pub method: String,
    /// The CDP session (page) it belongs to; None for the browser.
    pub session: Option<String>,
    pub params: Value,
}

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<Value, CdpError>>>>>;

pub struct Cdp {
    writer: tokio::sync::Mutex<pipe::Sender>,
    pending: Pending,
    events: broadcast::Sender<Event>,
    next_id: AtomicU64,
    dead: Arc<AtomicBool>,
    reader: tokio::task::JoinHandle<()>,
}

impl Drop for Cdp {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

impl Cdp {
    /// Talk to Chromium through `to_chromium` (its fd 3) and
    /// `from_chromium` (its fd 4).
    pub fn new(to_chromium: OwnedFd, from_chromium: OwnedFd) -> std::io::Result<Self> {
        let writer = pipe::Sender::from_owned_fd(to_chromium)?;
        let reader = pipe::Receiver::from_owned_fd(from_chromium)?;
        let pending: Pending = Arc::new(Mutex::new(HashMap::new()));
        let (events, _) = broadcast::channel(EVENT_BACKLOG);
        let dead = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(read_loop(
            reader,
            pending.clone(),
            events.clone(),
            dead.clone(),
        ));
        Ok(Cdp {
            writer: tokio::sync::Mutex::new(writer),
            pending,
            events,
            next_id: AtomicU64::new(1),
            dead,
            reader: task,
        })
    }

    /// Events from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// Send `method` (to the page `session`, or the browser when None) and
    /// wait up to `timeout` for its result.
    pub async fn call(
        &self,
        session: Option<&str>,
        method: &str,
        params: Value,
        timeout: Duration,
    ) -> Result<Value, CdpError> {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let mut msg = json!({ "id": id, "method": method, "params": params });
        if let Some(s) = session {
            msg["sessionId"] = Value::String(s.to_string());
        }
        let mut bytes = serde_json::to_vec(&msg)
            .map_err(|e| CdpError::Closed(format!("cannot encode {method}: {e}")))?;
        bytes.push(0);
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(id, tx);
        // The reader sets `dead` before it fails what is pending, so either
        // it sees this call or we see `dead`.
        if self.is_dead() {
            lock(&self.pending).remove(&id);
            return Err(CdpError::Closed("Chromium has exited".into()));
        }
        let sent = tokio::time::timeout(timeout, async {
            self.writer.lock().await.write_all(&bytes).await
        })
        .await;
        match sent {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                lock(&self.pending).remove(&id);
                return Err(CdpError::Closed(format!("write {method}: {e}")));
            }
            Err(_) => {
                lock(&self.pending).remove(&id);
                return Err(CdpError::Timeout);
            }
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(CdpError::Closed("the reader stopped".into())),
            Err(_) => {
                lock(&self.pending).remove(&id);
                Err(CdpError::Timeout)
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

async fn read_loop(
    mut reader: pipe::Receiver,
    pending: Pending,
    events: broadcast::Sender<Event>,
    dead: Arc<AtomicBool>,
) {
    let mut msg: Vec<u8> = Vec::new();
    // Set while skipping the rest of an oversized message.
    let mut skipping = false;
    let mut buf = vec![0u8; 64 << 10];
    let why = loop {
        let n = match reader.read(&mut buf).await {
            Ok(0) => break "Chromium closed it".to_string(),
            Ok(n) => n,
            Err(e) => break format!("read: {e}"),
        };
        let mut chunk = buf.get(..n).unwrap_or_default();
        while !chunk.is_empty() {
            let end = chunk.iter().position(|&b| b == 0);
            let (part, rest) = match end {
                Some(i) => (
                    chunk.get(..i).unwrap_or_default(),
                    chunk.get(i + 1..).unwrap_or_default(),
                ),
                None => (chunk, &[][..]),
            };
            if !skipping {
                if msg.len() + part.len() > MAX_MESSAGE {
                    tracing::warn!("skipping a DevTools message over {MAX_MESSAGE} bytes");
                    if let Some(id) = leading_id(&msg) {
                        if let Some(tx) = lock(&pending).remove(&id) {
                            let _ = tx.send(Err(CdpError::TooLarge));
                        }
                    }
                    msg = Vec::new();
                    skipping = true;
                } else {
                    msg.extend_from_slice(part);
                }
            }
            if end.is_some() {
                if !skipping {
                    dispatch(&msg, &pending, &events);
                }
                msg.clear();
                msg.shrink_to(1 << 20);
                skipping = false;
            }
            chunk = rest;
        }
    };
    tracing::debug!("DevTools pipe closed: {why}");
    dead.store(true, Ordering::SeqCst);
    let waiting: Vec<_> = lock(&pending).drain().collect();
    for (_, tx) in waiting {
        let _ = tx.send(Err(CdpError::Closed(why.clone())));
    }
    let _ = events.send(Event {
        method: CLOSED_EVENT.into(),
        session: None,
        params: Value::Null,
    });
}

/// Broadcast when the pipe closes, so that event waiters stop waiting.
pub const CLOSED_EVENT: &str = "burrow.pipeClosed";

/// The id of a reply whose start is `{"id":N,` (how Chromium writes them).
fn leading_id(msg: &[u8]) -> Option<u64> {
    let rest = msg.strip_prefix(b"{\"id\":")?;
    let digits: Vec<u8> = rest
        .iter()
        .take(20)
        .take_while(|b| b.is_ascii_digit())
        .copied()
        .collect();
    std::str::from_utf8(&digits).ok()?.parse().ok()
}

fn dispatch(msg: &[u8], pending: &Pending, events: &broadcast::Sender<Event>) {
    let Ok(mut v) = serde_json::from_slice::<Value>(msg) else {
        tracing::warn!(
            "Chromium sent a message that is not JSON ({} bytes)",
            msg.len()
        );
        return;
    };
    if let Some(id) = v.get("id").and_then(Value::as_u64) {
        let Some(tx) = lock(pending).remove(&id) else {
            return;
        };
        let result = if let Some(err) = v.get("error") {
            Err(CdpError::Protocol {
                code: err.get("code").and_then(Value::as_i64).unwrap_or(0),
                message: err
                    .get("message")
                    .and_then(Value::as_str)
                    .unwrap_or("unknown error")
                    .chars()
                    .take(1000)
                    .collect(),
            })
        } else {
            Ok(v.get_mut("result").map(Value::take).unwrap_or(Value::Null))
        };
        let _ = tx.send(result);
    } else if let Some(method) = v.get("method").and_then(Value::as_str) {
        let event = Event {
            method: method.to_string(),
            session: v
                .get("sessionId")
                .and_then(Value::as_str)
                .map(str::to_string),
            params: v.get_mut("params").map(Value::take).unwrap_or(Value::Null),
        };
        // No listener is fine.
        let _ = events.send(event);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leading_id_parses_chromium_replies() {
        assert_eq!(leading_id(br#"{"id":42,"result":{}}"#), Some(42));
        assert_eq!(leading_id(br#"{"method":"x"}"#), None);
        assert_eq!(leading_id(b""), None);
    }

    #[tokio::test]
    async fn calls_events_and_a_closed_pipe() {
        let (to_r, to_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        let (from_r, from_w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
        let cdp = Arc::new(Cdp::new(to_w, from_r).unwrap());
        let mut events = cdp.subscribe();
        // A fake Chromium: answer the first request, send an event, close.
        let fake = tokio::task::spawn_blocking(move || {
            let mut got = Vec::new();
            let mut b = [0u8; 4096];
            while !got.contains(&0) {
                let n = nix::unistd::read(&to_r, &mut b).unwrap();
                assert!(n > 0);
                got.extend_from_slice(&b[..n]);
            }
            let req: Value = serde_json::from_slice(&got[..got.len() - 1]).unwrap();
            assert_eq!(req["method"], "Browser.getVersion");
            assert_eq!(req["sessionId"], "S");
            let reply = format!(
                "{{\"id\":{},\"result\":{{\"product\":\"x\"}}}}\0{{\"method\":\"Page.loadEventFired\",\"sessionId\":\"S\",\"params\":{{}}}}\0{{\"id\":999,\"error\":{{\"code\":-32000,\"message\":\"nope\"}}}}\0",
                req["id"]
            );
            nix::unistd::write(&from_w, reply.as_bytes()).unwrap();
            drop(from_w);
        });
        let r = cdp
            .call(
                Some("S"),
                "Browser.getVersion",
                json!({}),
                Duration::from_secs(10),
            )
            .await
            .unwrap();
        assert_eq!(r["product"], "x");
        let ev = events.recv().await.unwrap();
        assert_eq!(ev.method, "Page.loadEventFired");
        assert_eq!(ev.session.as_deref(), Some("S"));
        assert_eq!(events.recv().await.unwrap().method, CLOSED_EVENT);
        fake.await.unwrap();
        assert!(cdp.is_dead());
        let err = cdp
            .call(
                None,
                "Browser.getVersion",
                json!({}),
                Duration::from_secs(10),
            )
            .await
            .unwrap_err();
        assert!(matches!(err, CdpError::Closed(_)), "{err:?}");
    }
}
