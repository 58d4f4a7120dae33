//! The browser tool with the agent in test mode on this machine: a quick
//! check of the DevTools driving without booting a VM. It needs the browser
//! image unpacked or mounted, so it is ignored by default:
//!
//! ```sh
//! mkdir -p /mnt/burrow-browser
//! mount -o loop,ro "$(rootfs/browser-image | tail -n1)" /mnt/burrow-browser
//! BURROW_BROWSER_ROOT=/mnt/burrow-browser cargo test -p burrow-agent --test browser_local -- --ignored
//! ```
//!
//! The VM test (tests/tests/agent_browser.rs) is the one hack/test runs.

use std::time::{Duration, Instant};

use burrow_protocol::agent::*;
use burrow_protocol::ttrpc::{self, context};
use burrow_protocol::AgentClient;

mod support;

fn ctx() -> context::Context {
    context::with_duration(Duration::from_secs(300))
}

/// Fail unless the page's text contains `want`.
async fn assert_page_shows(c: &AgentClient, want: &str) {
    let text = c
        .browser_text(ctx(), &BrowserTextRequest::new())
        .await
        .expect("text")
        .text;
    assert!(text.contains(want), "want {want:?} in {text:?}");
}

#[tokio::test]
#[ignore = "needs BURROW_BROWSER_ROOT, a mounted browser image (see the module docs)"]
async fn browser_in_test_mode() {
    let root = std::env::var("BURROW_BROWSER_ROOT").expect("BURROW_BROWSER_ROOT");
    let dir = tempfile::tempdir().expect("tempdir");
    let page = dir.path().join("page.html");
    std::fs::write(
        &page,
        "<title>local</title><body style='margin:0'><p id=o>before</p>\
         <button id=b onclick=\"o.textContent='after'\">b</button>\
         <button id=a onclick=\"alert('hi'); o.textContent='alerted'\">a</button><input id=i \
         oninput=\"o.textContent='typed '+this.value\"></body>",
    )
    .expect("write the page");
    let browser = ["--browser".as_ref(), root.as_ref()];
    let log = "info,burrow_agent::browser=debug";
    let (mut child, c) = support::spawn_agent(dir.path(), &browser, log).await;

    let t0 = Instant::now();
    let mut nav = BrowserNavigateRequest::new();
    nav.url = format!("file:///guest{}", page.display());
    let r = c.browser_navigate(ctx(), &nav).await.expect("navigate");
    eprintln!("navigate with start: {:?}", t0.elapsed());
    assert_eq!(r.title, "local");
    let mut shot = BrowserScreenshotRequest::new();
    shot.width = 640;
    shot.height = 480;
    let s = c
        .browser_screenshot(ctx(), &shot)
        .await
        .expect("screenshot");
    assert!(s.png.starts_with(b"\x89PNG\r\n\x1a\n"));
    assert_eq!((s.width, s.height), (640, 480));
    let mut click = BrowserClickRequest::new();
    click.selector = "#b".into();
    c.browser_click(ctx(), &click).await.expect("click");
    assert_page_shows(&c, "after").await;
    // An alert must not hang the page: the agent accepts dialogs.
    click.selector = "#a".into();
    c.browser_click(ctx(), &click)
        .await
        .expect("click the alert button");
    assert_page_shows(&c, "alerted").await;
    let mut ty = BrowserTypeRequest::new();
    ty.selector = "#i".into();
    ty.text = "xyz".into();
    c.browser_type(ctx(), &ty).await.expect("type");
    assert_page_shows(&c, "typed xyz").await;
    click.selector = "#nothing".into();
    match c.browser_click(ctx(), &click).await {
        Err(ttrpc::Error::RpcStatus(s)) => assert_eq!(s.code(), ttrpc::Code::NOT_FOUND),
        other => panic!("want NOT_FOUND, got {other:?}"),
    }
    // Chromium runs sandboxed: its renderers have a seccomp filter.
    let mut sandboxed = Vec::new();
    for e in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let status = std::fs::read_to_string(e.path().join("status")).unwrap_or_default();
        if status.starts_with("Name:\tchrom") && status.contains("\nSeccomp:\t2") {
            sandboxed.push(e.file_name());
        }
    }
    assert!(
        !sandboxed.is_empty(),
        "no chromium process runs under seccomp"
    );
    c.browser_close(ctx(), &BrowserCloseRequest::new())
        .await
        .expect("close");
    let _ = child.kill();
    let _ = child.wait();
}
