//! What the browser calls do with the page, in DevTools protocol terms.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::cdp::{Cdp, CdpError, CLOSED_EVENT};
use super::{CALL_TIMEOUT, START_TIMEOUT};
use crate::error::{invalid, AgentError, Result};

fn cdp_err(what: &str) -> impl FnOnce(CdpError) -> AgentError + '_ {
    move |e| match e {
        CdpError::Timeout => AgentError::DeadlineExceeded(format!("{what}: {e}")),
        CdpError::TooLarge => AgentError::OutOfRange(format!("{what}: {e}")),
        _ => AgentError::FailedPrecondition(format!("{what}: {e}")),
    }
}

/// Wait for Chromium, open a page and attach to it; returns the page's
/// CDP session id.
pub async fn open(cdp: &Cdp, viewport: (u32, u32)) -> Result<String> {
    let v = cdp
        .call(None, "Browser.getVersion", json!({}), START_TIMEOUT)
        .await
        .map_err(cdp_err("wait for chromium"))?;
    let product = v.get("product").and_then(|p| p.as_str()).unwrap_or("?");
    tracing::info!(product, "chromium answers");
    let t = cdp
        .call(
            None,
            "Target.createTarget",
            json!({"url": "about:blank"}),
            START_TIMEOUT,
        )
        .await
        .map_err(cdp_err("open a page"))?;
    let target = t
        .get("targetId")
        .and_then(Value::as_str)
        .ok_or_else(|| AgentError::Internal("Target.createTarget gave no targetId".into()))?;
    let a = cdp
        .call(
            None,
            "Target.attachToTarget",
            json!({"targetId": target, "flatten": true}),
            START_TIMEOUT,
        )
        .await
        .map_err(cdp_err("attach to the page"))?;
    let page = a
        .get("sessionId")
        .and_then(Value::as_str)
        .ok_or_else(|| AgentError::Internal("Target.attachToTarget gave no sessionId".into()))?
        .to_string();
    for (method, params) in [
        ("Page.enable", json!({})),
        ("Page.setLifecycleEventsEnabled", json!({"enabled": true})),
        ("Runtime.enable", json!({})),
    ] {
        cdp.call(Some(&page), method, params, START_TIMEOUT)
            .await
            .map_err(cdp_err(method))?;
    }
    set_viewport(cdp, &page, viewport).await?;
    Ok(page)
}

pub async fn set_viewport(cdp: &Cdp, page: &str, (width, height): (u32, u32)) -> Result<()> {
    cdp.call(
        Some(page),
        "Emulation.setDeviceMetricsOverride",
        json!({"width": width, "height": height, "deviceScaleFactor": 1, "mobile": false}),
        CALL_TIMEOUT,
    )
    .await
    .map_err(cdp_err("set the viewport"))?;
    Ok(())
}

/// Navigate and wait for the load event; returns the final URL and title.
pub async fn navigate(
    cdp: &Cdp,
    page: &str,
    url: &str,
    timeout: Duration,
) -> Result<(String, String)> {
    let deadline = Instant::now() + timeout;
    let mut events = cdp.subscribe();
    let r = cdp
        .call(Some(page), "Page.navigate", json!({"url": url}), timeout)
        .await
        .map_err(|e| match e {
            CdpError::Protocol { message, .. } => {
                invalid(format!("cannot navigate to {url:?}: {message}"))
            }
            CdpError::Timeout => AgentError::DeadlineExceeded(format!(
                "navigating to {url:?} timed out after {timeout:?}"
            )),
            e => cdp_err("navigate")(e),
        })?;
    if let Some(err) = r
        .get("errorText")
        .and_then(Value::as_str)
        .filter(|e| !e.is_empty())
    {
        return Err(AgentError::FailedPrecondition(format!(
            "loading {url:?} failed: {err}"
        )));
    }
    // A navigation within the document (e.g. to a #fragment) has no loader
    // and no load event.
    if let Some(loader) = r.get("loaderId").and_then(Value::as_str) {
        let frame = r.get("frameId").and_then(Value::as_str).unwrap_or_default();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let ev = match tokio::time::timeout(left, events.recv()).await {
                Err(_) => {
                    return Err(AgentError::DeadlineExceeded(format!(
                        "{url:?} did not finish loading in {timeout:?}"
                    )))
                }
                Ok(Err(tokio::sync::broadcast::error::RecvError::Lagged(_))) => continue,
                Ok(Err(_)) => return Err(AgentError::FailedPrecondition("chromium exited".into())),
                Ok(Ok(ev)) => ev,
            };
            if ev.method == CLOSED_EVENT {
                return Err(AgentError::FailedPrecondition(
                    "chromium exited while loading the page".into(),
                ));
            }
            if ev.session.as_deref() != Some(page) {
                continue;
            }
            let p = &ev.params;
            match ev.method.as_str() {
                "Page.lifecycleEvent"
                    if p.get("name").and_then(Value::as_str) == Some("load")
                        && p.get("loaderId").and_then(Value::as_str) == Some(loader) =>
                {
                    break
                }
                "Page.loadEventFired" if frame.is_empty() => break,
                "Inspector.targetCrashed" => {
                    return Err(AgentError::FailedPrecondition(
                        "the page crashed while loading".into(),
                    ))
                }
                _ => {}
            }
        }
    }
    let v = evaluate(cdp, page, "[location.href, document.title]").await?;
    let s = |i: usize| {
        v.get(i)
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string()
    };
    Ok((s(0), s(1)))
}

/// Accept every JavaScript dialog (alert, confirm, prompt, beforeunload)
/// the page opens, as nobody is there to answer it and the page would
/// hang until one is. Runs until the pipe closes or the session ends.
pub async fn dismiss_dialogs(
    cdp: std::sync::Weak<Cdp>,
    mut events: tokio::sync::broadcast::Receiver<super::cdp::Event>,
    page: String,
) {
    use tokio::sync::broadcast::error::RecvError;
    loop {
        let ev = match events.recv().await {
            Ok(ev) => ev,
            Err(RecvError::Lagged(_)) => continue,
            Err(RecvError::Closed) => return,
        };
        if ev.method == CLOSED_EVENT {
            return;
        }
        if ev.method != "Page.javascriptDialogOpening" || ev.session.as_deref() != Some(&page) {
            continue;
        }
        let Some(cdp) = cdp.upgrade() else { return };
        let kind = ev
            .params
            .get("type")
            .and_then(|t| t.as_str())
            .unwrap_or("?");
        tracing::info!(kind, "accepting a JavaScript dialog");
        if let Err(e) = cdp
            .call(
                Some(&page),
                "Page.handleJavaScriptDialog",
                json!({"accept": true, "promptText": ""}),
                CALL_TIMEOUT,
            )
            .await
        {
            tracing::warn!("could not close a JavaScript dialog: {e}");
        }
    }
}

/// Evaluate `expr` in the page and return its value (JSON).
async fn evaluate(cdp: &Cdp, page: &str, expr: &str) -> Result<Value> {
    let r = cdp
        .call(
            Some(page),
            "Runtime.evaluate",
            json!({"expression": expr, "returnByValue": true, "awaitPromise": true, "userGesture": true}),
            CALL_TIMEOUT,
        )
        .await
        .map_err(cdp_err("evaluate in the page"))?;
    if let Some(ex) = r.get("exceptionDetails") {
        let msg = ex
            .pointer("/exception/description")
            .or_else(|| ex.get("text"))
            .and_then(Value::as_str)
            .unwrap_or("exception")
            .chars()
            .take(1000)
            .collect::<String>();
        return Err(AgentError::InvalidArgument(format!("in the page: {msg}")));
    }
    Ok(r.pointer("/result/value").cloned().unwrap_or(Value::Null))
}

pub async fn screenshot(cdp: &Cdp, page: &str) -> Result<(Vec<u8>, u32, u32)> {
    let r = cdp
        .call(
            Some(page),
            "Page.captureScreenshot",
            json!({"format": "png", "fromSurface": true}),
            CALL_TIMEOUT,
        )
        .await
        .map_err(cdp_err("take a screenshot"))?;
    let b64 = r
        .get("data")
        .and_then(Value::as_str)
        .ok_or_else(|| AgentError::Internal("Page.captureScreenshot gave no data".into()))?;
    let max = burrow_protocol::MAX_SCREENSHOT_BYTES;
    if b64.len() / 4 * 3 > max + 3 {
        return Err(AgentError::OutOfRange(format!(
            "the screenshot is about {} bytes, more than {max}: ask for a smaller width and height",
            b64.len() / 4 * 3
        )));
    }
    let png = base64_decode(b64.as_bytes())
        .ok_or_else(|| AgentError::Internal("Chromium's screenshot is not valid base64".into()))?;
    let (w, h) = png_size(&png)
        .ok_or_else(|| AgentError::Internal("Chromium's screenshot is not a PNG".into()))?;
    Ok((png, w, h))
}

/// The visible interactive elements of the page, one a line:
/// `[12] button "Submit"`, in document order. An element keeps the index
/// it was first given (its `data-burrow-idx` attribute) for the life of
/// the document; new ones get the next numbers. The expression's value is
/// the list in `t`.
pub const ELEMENTS: &str = r#"const q = 'a[href],button,input:not([type=hidden]),textarea,select,summary,[role=button],[role=link],[role=checkbox],[role=radio],[role=tab],[role=menuitem],[role=textbox],[role=combobox],[contenteditable=""],[contenteditable=true],[onclick]';
const root = document.documentElement;
let next = Number(root ? root.getAttribute('data-burrow-next') || '1' : '1');
const lines = [];
for (const el of document.querySelectorAll(q)) {
  const r = el.getBoundingClientRect(), st = getComputedStyle(el);
  if (r.width <= 0 || r.height <= 0 || st.visibility === 'hidden' || st.display === 'none') continue;
  let idx = el.getAttribute('data-burrow-idx');
  if (!idx) { idx = String(next++); el.setAttribute('data-burrow-idx', idx); }
  const tag = el.tagName.toLowerCase();
  const kind = el.getAttribute('role') || (tag === 'a' ? 'link' : tag === 'input' ? 'input[' + (el.type || 'text') + ']' : tag);
  const name = (el.getAttribute('aria-label') || el.innerText || el.value || el.placeholder || el.title || el.name || '').replace(/\s+/g, ' ').trim().slice(0, 100);
  lines.push('[' + idx + '] ' + kind + ' ' + JSON.stringify(name));
}
if (root) root.setAttribute('data-burrow-next', String(next));
const t = lines.join('\n') + (lines.length ? '\n' : '');"#;

/// Body text (or with `elements`, the [`ELEMENTS`] list), at most `max`
/// bytes (cut at a character boundary).
pub async fn text(cdp: &Cdp, page: &str, max: usize, elements: bool) -> Result<(String, bool)> {
    // Cut in the page too, so a huge page never crosses the pipe whole:
    // `max` UTF-16 units are at least `max` bytes of UTF-8.
    let body = if elements {
        ELEMENTS
    } else {
        "const e = document.body || document.documentElement; const t = e ? e.innerText || '' : '';"
    };
    let expr = format!("(() => {{ {body} return [t.length > {max}, t.slice(0, {max})]; }})()");
    let v = evaluate(cdp, page, &expr).await?;
    let mut truncated = v.get(0).and_then(Value::as_bool).unwrap_or(false);
    let mut t = v
        .get(1)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    if t.len() > max {
        t.truncate(t.floor_char_boundary(max));
        truncated = true;
    }
    Ok((t, truncated))
}

/// A JavaScript function call on the first element matching `selector`
/// (`body` sees it as `el`); null when nothing matches.
fn on_element(selector: &str, body: &str) -> Result<String> {
    let sel = serde_json::to_string(selector).map_err(|e| invalid(format!("selector: {e}")))?;
    Ok(format!(
        "(() => {{ const el = document.querySelector({sel}); if (!el) return null; {body} }})()"
    ))
}

fn no_element(selector: &str) -> AgentError {
    AgentError::NotFound(format!("no element matches the selector {selector:?}"))
}

/// Click the middle of the first element matching `selector` with real
/// mouse events (scrolled into view first).
pub async fn click(cdp: &Cdp, page: &str, selector: &str) -> Result<()> {
    let expr = on_element(
        selector,
        "el.scrollIntoView({block: 'center', inline: 'center'}); \
         const r = el.getBoundingClientRect(); \
         return [r.left + r.width / 2, r.top + r.height / 2, r.width, r.height];",
    )?;
    let v = evaluate(cdp, page, &expr).await?;
    if v.is_null() {
        return Err(no_element(selector));
    }
    let n = |i: usize| v.get(i).and_then(Value::as_f64).unwrap_or(0.0);
    let (x, y, w, h) = (n(0), n(1), n(2), n(3));
    if w <= 0.0 || h <= 0.0 {
        return Err(AgentError::FailedPrecondition(format!(
            "the element {selector:?} is not visible (size {w}x{h})"
        )));
    }
    for (kind, buttons) in [("mouseMoved", 0), ("mousePressed", 1), ("mouseReleased", 0)] {
        let mut ev = json!({"type": kind, "x": x, "y": y, "buttons": buttons});
        if kind != "mouseMoved" {
            ev["button"] = json!("left");
            ev["clickCount"] = json!(1);
        }
        cdp.call(Some(page), "Input.dispatchMouseEvent", ev, CALL_TIMEOUT)
            .await
            .map_err(cdp_err("click"))?;
    }
    Ok(())
}

/// Focus the first element matching `selector` and insert `text` at its
/// caret, as typing (or pasting) would.
pub async fn type_text(cdp: &Cdp, page: &str, selector: &str, text: &str) -> Result<()> {
    let expr = on_element(
        selector,
        "el.scrollIntoView({block: 'center'}); el.focus(); return document.activeElement === el;",
    )?;
    match evaluate(cdp, page, &expr).await? {
        Value::Null => return Err(no_element(selector)),
        Value::Bool(true) => {}
        _ => {
            return Err(AgentError::FailedPrecondition(format!(
                "the element {selector:?} cannot take the focus"
            )))
        }
    }
    cdp.call(
        Some(page),
        "Input.insertText",
        json!({"text": text}),
        CALL_TIMEOUT,
    )
    .await
    .map_err(cdp_err("type"))?;
    Ok(())
}

/// Standard base64 (with or without padding); None if malformed.
fn base64_decode(s: &[u8]) -> Option<Vec<u8>> {
    fn val(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    let s = s
        .strip_suffix(b"==")
        .or_else(|| s.strip_suffix(b"="))
        .unwrap_or(s);
    let mut out = Vec::with_capacity(s.len() / 4 * 3 + 3);
    for chunk in s.chunks(4) {
        let mut acc = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            acc |= val(c)? << (18 - 6 * i);
        }
        let bytes = acc.to_be_bytes();
        match chunk.len() {
            4 => out.extend_from_slice(bytes.get(1..4)?),
            3 => out.extend_from_slice(bytes.get(1..3)?),
            2 => out.extend_from_slice(bytes.get(1..2)?),
            _ => return None,
        }
    }
    Some(out)
}

/// Width and height from a PNG's IHDR chunk.
fn png_size(png: &[u8]) -> Option<(u32, u32)> {
    if png.get(..8)? != b"\x89PNG\r\n\x1a\n" || png.get(12..16)? != b"IHDR" {
        return None;
    }
    let be = |r: std::ops::Range<usize>| Some(u32::from_be_bytes(png.get(r)?.try_into().ok()?));
    Some((be(16..20)?, be(20..24)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips() {
        assert_eq!(base64_decode(b"aGVsbG8=").unwrap(), b"hello");
        assert_eq!(base64_decode(b"aGVsbG8h").unwrap(), b"hello!");
        assert_eq!(base64_decode(b"aGk=").unwrap(), b"hi");
        assert_eq!(base64_decode(b"").unwrap(), b"");
        assert!(base64_decode(b"a").is_none());
        assert!(base64_decode(b"a$==").is_none());
    }

    #[test]
    fn png_size_reads_ihdr() {
        let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
        png.extend_from_slice(&640u32.to_be_bytes());
        png.extend_from_slice(&480u32.to_be_bytes());
        assert_eq!(png_size(&png), Some((640, 480)));
        assert_eq!(png_size(b"GIF89a"), None);
    }

    #[test]
    fn selectors_are_quoted() {
        let js = on_element("a\"); alert(1); (\"", "return 1;").unwrap();
        assert!(
            js.contains(r#"document.querySelector("a\"); alert(1); (\"")"#),
            "{js}"
        );
    }
}
