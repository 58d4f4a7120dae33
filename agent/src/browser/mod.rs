//! The browser tool: one headless Chromium page in the guest, driven over
//! the DevTools protocol, that lives across calls.
//!
//! The first browser call mounts the browser image (see [`launch`]) and
//! starts Chromium; later calls reuse its page. If Chromium died in
//! between, the next call starts a new one. `BrowserClose` and the agent's
//! shutdown stop it and unmount the image.

mod cdp;
mod launch;
mod page;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

pub use launch::Source;

use crate::error::{AgentError, Result};
use cdp::Cdp;

/// How long Chromium may take to start and answer (guests in a nested
/// test host run 10-20x slower than on hardware).
const START_TIMEOUT: Duration = Duration::from_secs(300);
/// Default and largest wait for a page's load event.
const DEFAULT_NAV_TIMEOUT: Duration = Duration::from_secs(30);
const MAX_NAV_TIMEOUT: Duration = Duration::from_secs(600);
/// Bound on any other DevTools call.
const CALL_TIMEOUT: Duration = Duration::from_secs(120);
/// Viewport before any screenshot asks for another.
const DEFAULT_VIEWPORT: (u32, u32) = (1280, 800);
const MAX_VIEWPORT: u32 = 4096;
/// Longest URL and CSS selector accepted.
const MAX_URL: usize = 64 << 10;
const MAX_SELECTOR: usize = 4096;

pub struct Browser {
    source: Option<Source>,
    bundle: PathBuf,
    /// Run Chromium with its sandbox (user namespaces); off only for hosts
    /// that cannot give it one.
    sandbox: bool,
    session: tokio::sync::Mutex<Option<Session>>,
}

struct Session {
    chromium: launch::Chromium,
    cdp: Arc<Cdp>,
    /// Answers the page's JavaScript dialogs.
    dialogs: tokio::task::JoinHandle<()>,
    /// The CDP session id of our page.
    page: String,
    viewport: (u32, u32),
}

impl Drop for Session {
    fn drop(&mut self) {
        self.dialogs.abort();
    }
}

impl Session {
    fn alive(&self) -> bool {
        self.chromium.exited().is_none() && !self.cdp.is_dead()
    }
}

impl Browser {
    pub fn new(source: Option<Source>, state_dir: PathBuf, sandbox: bool) -> Self {
        Browser {
            source,
            bundle: state_dir.join("browser"),
            sandbox,
            session: tokio::sync::Mutex::new(None),
        }
    }

    /// Run `f` on the live session, starting Chromium first if needed.
    async fn with_session<T>(&self, f: impl AsyncFnOnce(&mut Session) -> Result<T>) -> Result<T> {
        let mut guard = self.session.lock().await;
        if let Some(s) = guard.as_mut() {
            if !s.alive() {
                tracing::warn!(
                    "chromium exited ({:?}); starting a new one. Its last words: {}",
                    s.chromium.exited(),
                    s.chromium.stderr_tail()
                );
                launch::stop(&mut s.chromium).await;
                *guard = None;
            }
        }
        if guard.is_none() {
            *guard = Some(self.start().await?);
        }
        let Some(session) = guard.as_mut() else {
            return Err(AgentError::Internal("no browser session".into()));
        };
        let result = f(session).await;
        if result.is_err() && !session.alive() {
            let tail = session.chromium.stderr_tail();
            launch::stop(&mut session.chromium).await;
            *guard = None;
            return Err(AgentError::FailedPrecondition(format!(
                "chromium died: {}; its stderr ends with: {tail}",
                result.err().map(|e| e.to_string()).unwrap_or_default()
            )));
        }
        result
    }

    async fn start(&self) -> Result<Session> {
        let source = self.source.as_ref().ok_or_else(|| {
            AgentError::FailedPrecondition(
                "this guest has no browser image: attach rootfs/browser-image as a disk \
                 and boot with burrow.browser=/dev/vdX on the kernel command line"
                    .into(),
            )
        })?;
        let started = std::time::Instant::now();
        let mut chromium =
            launch::start(source, &self.bundle, DEFAULT_VIEWPORT, self.sandbox).await?;
        let (Some(to), Some(from)) = (chromium.to_chromium.take(), chromium.from_chromium.take())
        else {
            launch::stop(&mut chromium).await;
            return Err(AgentError::Internal("DevTools pipe missing".into()));
        };
        let cdp = match Cdp::new(to, from) {
            Ok(c) => Arc::new(c),
            Err(e) => {
                launch::stop(&mut chromium).await;
                return Err(AgentError::io("DevTools pipe", e));
            }
        };
        let events = cdp.subscribe();
        match page::open(&cdp, DEFAULT_VIEWPORT).await {
            Ok(page) => {
                let dialogs = tokio::spawn(page::dismiss_dialogs(
                    Arc::downgrade(&cdp),
                    events,
                    page.clone(),
                ));
                tracing::info!(ms = started.elapsed().as_millis() as u64, "browser ready");
                Ok(Session {
                    chromium,
                    cdp,
                    dialogs,
                    page,
                    viewport: DEFAULT_VIEWPORT,
                })
            }
            Err(e) => {
                // Give a dying Chromium a moment so its exit and last words
                // make the error.
                let _ = tokio::time::timeout(
                    Duration::from_secs(2),
                    chromium.exit.wait_for(Option::is_some),
                )
                .await;
                let exited = chromium.exited();
                let tail = chromium.stderr_tail();
                launch::stop(&mut chromium).await;
                Err(AgentError::FailedPrecondition(format!(
                    "chromium did not start ({e}; exit: {exited:?}); its stderr ends with: {tail}"
                )))
            }
        }
    }

    pub async fn navigate(&self, url: &str, timeout_ms: u32) -> Result<(String, String)> {
        if url.is_empty() || url.len() > MAX_URL || url.contains('\0') {
            return Err(crate::error::invalid(format!(
                "url must be 1 to {MAX_URL} bytes without NUL"
            )));
        }
        let timeout = if timeout_ms == 0 {
            DEFAULT_NAV_TIMEOUT
        } else {
            Duration::from_millis(u64::from(timeout_ms)).min(MAX_NAV_TIMEOUT)
        };
        self.with_session(async |s| page::navigate(&s.cdp, &s.page, url, timeout).await)
            .await
    }

    /// PNG bytes and their width and height.
    pub async fn screenshot(&self, width: u32, height: u32) -> Result<(Vec<u8>, u32, u32)> {
        if width > MAX_VIEWPORT || height > MAX_VIEWPORT {
            return Err(crate::error::invalid(format!(
                "width and height must be at most {MAX_VIEWPORT}"
            )));
        }
        self.with_session(async |s| {
            let want = (
                if width == 0 { s.viewport.0 } else { width },
                if height == 0 { s.viewport.1 } else { height },
            );
            if want != s.viewport {
                page::set_viewport(&s.cdp, &s.page, want).await?;
                s.viewport = want;
            }
            page::screenshot(&s.cdp, &s.page).await
        })
        .await
    }

    /// The page's body text, or with `elements` its list of visible
    /// interactive elements ([`page::ELEMENTS`]).
    pub async fn text(&self, max_bytes: u32, elements: bool) -> Result<(String, bool)> {
        let max = usize::try_from(max_bytes)
            .ok()
            .filter(|&m| m > 0 && m <= burrow_protocol::MAX_CHUNK)
            .unwrap_or(burrow_protocol::MAX_CHUNK);
        self.with_session(async |s| page::text(&s.cdp, &s.page, max, elements).await)
            .await
    }

    pub async fn click(&self, selector: &str) -> Result<()> {
        check_selector(selector)?;
        self.with_session(async |s| page::click(&s.cdp, &s.page, selector).await)
            .await
    }

    pub async fn type_text(&self, selector: &str, text: &str) -> Result<()> {
        check_selector(selector)?;
        if text.len() > burrow_protocol::MAX_CHUNK {
            return Err(crate::error::invalid(format!(
                "text must be at most {} bytes",
                burrow_protocol::MAX_CHUNK
            )));
        }
        self.with_session(async |s| page::type_text(&s.cdp, &s.page, selector, text).await)
            .await
    }

    /// Stop Chromium and unmount the image; nothing to do if none runs.
    pub async fn close(&self) {
        let mut guard = self.session.lock().await;
        if let Some(mut s) = guard.take() {
            // Ask politely first, so Chromium tidies up its children.
            let _ = s
                .cdp
                .call(
                    None,
                    "Browser.close",
                    serde_json::json!({}),
                    Duration::from_secs(5),
                )
                .await;
            let _ = tokio::time::timeout(
                Duration::from_secs(5),
                s.chromium.exit.wait_for(Option::is_some),
            )
            .await;
            launch::stop(&mut s.chromium).await;
        }
    }
}

fn check_selector(selector: &str) -> Result<()> {
    if selector.is_empty() || selector.len() > MAX_SELECTOR {
        return Err(crate::error::invalid(format!(
            "selector must be 1 to {MAX_SELECTOR} bytes"
        )));
    }
    Ok(())
}
