//! The browser tool in a real VM: burrow-vmm boots the guest kernel with
//! the agent initramfs and the browser image (rootfs/browser-image) as a
//! read-only disk; the test writes an HTML page into the guest, has
//! headless Chromium render it, and checks its text, a screenshot (a PNG of
//! the asked size with the page's red box in it), a click and typing. Run
//! inside hack/testhost (or on a host with hardware KVM).

#![allow(clippy::unwrap_used)] // test code

use std::time::{Duration, Instant};

use burrow_protocol::agent::*;
use burrow_protocol::ttrpc::{self, context};
use burrow_protocol::AgentClient;
use burrow_tests::agent_vm::{self, Disk};

/// Guest code runs 10-20x slower in the nested test host.
const BOOT_TIMEOUT: Duration = Duration::from_secs(400);

/// Chromium's first start in a nested test host can take minutes.
fn ctx() -> context::Context {
    context::with_duration(Duration::from_secs(900))
}

const PAGE: &str = r#"<!doctype html>
<html><head><title>burrow browser test</title>
<style>
  body { margin: 0; background: #ffffff; font: 20px sans-serif; }
  #box { position: absolute; left: 40px; top: 200px; width: 200px; height: 100px; background: #e03020; }
  #btn { position: absolute; left: 300px; top: 200px; width: 120px; height: 40px; }
  #name { position: absolute; left: 300px; top: 260px; width: 200px; }
  #alert { position: absolute; left: 440px; top: 200px; width: 120px; height: 40px; }
</style></head>
<body>
<h1>Hello from the guest</h1>
<p id="out">not clicked</p>
<p id="echo">nothing typed</p>
<div id="box"></div>
<button id="btn" onclick="document.getElementById('out').textContent = 'button clicked'">Press</button>
<button id="alert" onclick="alert('hello'); document.getElementById('out').textContent = 'alert answered'">Alert</button>
<input id="name">
<script>
  document.getElementById('name').addEventListener('input',
    e => document.getElementById('echo').textContent = 'typed: ' + e.target.value);
</script>
</body></html>
"#;

fn code_of<T: std::fmt::Debug>(r: ttrpc::Result<T>) -> ttrpc::Code {
    match r {
        Err(ttrpc::Error::RpcStatus(s)) => s.code(),
        other => panic!("expected an RPC status error, got {other:?}"),
    }
}

async fn text(c: &AgentClient, max: u32) -> BrowserTextResponse {
    let mut r = BrowserTextRequest::new();
    r.max_bytes = max;
    c.browser_text(ctx(), &r).await.unwrap()
}

async fn read_guest_file(c: &AgentClient, path: &str) -> String {
    let mut r = ReadFileRequest::new();
    r.path = path.into();
    String::from_utf8_lossy(&c.read_file(ctx(), &r).await.unwrap().data).into_owned()
}

/// The guest's processes whose name starts with "chrom" (the browser,
/// its zygotes and renderers): "pid name", and whether it runs under a
/// seccomp filter.
async fn chromium_processes(c: &AgentClient) -> Vec<(String, bool)> {
    let mut ls = ListDirRequest::new();
    ls.path = "/proc".into();
    let mut found = Vec::new();
    for e in c.list_dir(ctx(), &ls).await.unwrap().entries {
        if e.name.bytes().all(|b| b.is_ascii_digit()) {
            let mut r = ReadFileRequest::new();
            r.path = format!("/proc/{}/status", e.name);
            // A process may be gone by now.
            if let Ok(st) = c.read_file(ctx(), &r).await {
                let st = String::from_utf8_lossy(&st.data).into_owned();
                if let Some(name) = st.strip_prefix("Name:\tchrom") {
                    let name = name.lines().next().unwrap_or_default();
                    found.push((
                        format!("{} chrom{name}", e.name),
                        st.contains("\nSeccomp:\t2"),
                    ));
                }
            }
        }
    }
    found
}

/// Decode a PNG into (width, height, RGBA pixels).
fn decode_png(data: &[u8]) -> (u32, u32, Vec<u8>) {
    let mut decoder = png::Decoder::new(data);
    decoder.set_transformations(png::Transformations::EXPAND | png::Transformations::STRIP_16);
    let mut reader = decoder.read_info().expect("a valid PNG header");
    let mut buf = vec![0u8; reader.output_buffer_size()];
    let info = reader.next_frame(&mut buf).expect("a valid PNG image");
    buf.truncate(info.buffer_size());
    let rgba: Vec<u8> = match info.color_type {
        png::ColorType::Rgba => buf,
        png::ColorType::Rgb => buf
            .chunks(3)
            .flat_map(|p| [p[0], p[1], p[2], 255])
            .collect(),
        png::ColorType::GrayscaleAlpha => buf
            .chunks(2)
            .flat_map(|p| [p[0], p[0], p[0], p[1]])
            .collect(),
        png::ColorType::Grayscale => buf.iter().flat_map(|&g| [g, g, g, 255]).collect(),
        other => panic!("unexpected PNG colour type {other:?}"),
    };
    (info.width, info.height, rgba)
}

fn pixel(rgba: &[u8], width: u32, x: u32, y: u32) -> [u8; 3] {
    let i = ((y * width + x) * 4) as usize;
    [rgba[i], rgba[i + 1], rgba[i + 2]]
}

#[test]
fn browser_renders_a_local_page_in_a_vm() {
    let image = burrow_tests::asset_from_env("BURROW_BROWSER_IMAGE", "rootfs/browser-image");
    let dir = burrow_tests::scratch_dir("agent-browser");
    // The image is the only disk: /dev/vda in the guest. No `quiet`: the
    // kernel's messages are in the serial log shown when the test fails.
    let mut vm = agent_vm::boot(
        &dir,
        2048,
        &[Disk {
            path: &image,
            read_only: true,
        }],
        "burrow.browser=/dev/vda RUST_LOG=info,burrow_agent::browser=debug",
    );
    let st = agent_vm::drive(&mut vm, BOOT_TIMEOUT, |c| async move {
        let h = c.health(ctx(), &HealthRequest::new()).await.unwrap();
        assert!(h.pid1, "agent is not PID 1");

        // The page, written into the guest with the file API; Chromium
        // sees the guest's files under /guest.
        let mut w = WriteFileRequest::new();
        w.path = "/tmp/www/page.html".into();
        w.data = PAGE.as_bytes().to_vec();
        w.make_parents = true;
        c.write_file(ctx(), &w).await.unwrap();

        let t0 = Instant::now();
        let mut nav = BrowserNavigateRequest::new();
        nav.url = "file:///guest/tmp/www/page.html".into();
        nav.timeout_ms = 300_000;
        let r = c.browser_navigate(ctx(), &nav).await.unwrap();
        eprintln!("first navigate (starts chromium): {:?}", t0.elapsed());
        assert_eq!(r.title, "burrow browser test");
        assert_eq!(r.url, "file:///guest/tmp/www/page.html");

        let t = text(&c, 0).await;
        assert!(t.text.contains("Hello from the guest"), "{:?}", t.text);
        assert!(t.text.contains("not clicked"), "{:?}", t.text);
        assert!(!t.truncated);
        let short = text(&c, 5).await;
        assert_eq!(short.text, "Hello");
        assert!(short.truncated);

        // A screenshot of the asked size with the red box where the page
        // puts it, on a white page.
        let t0 = Instant::now();
        let mut shot = BrowserScreenshotRequest::new();
        shot.width = 800;
        shot.height = 600;
        let s = c.browser_screenshot(ctx(), &shot).await.unwrap();
        eprintln!("screenshot: {} bytes in {:?}", s.png.len(), t0.elapsed());
        assert_eq!((s.width, s.height), (800, 600));
        let (w, h, rgba) = decode_png(&s.png);
        assert_eq!((w, h), (800, 600));
        let mut colours = std::collections::HashSet::new();
        for px in rgba.chunks(4) {
            colours.insert([px[0], px[1], px[2]]);
        }
        assert!(
            colours.len() > 1,
            "the screenshot is one colour: {colours:?}"
        );
        let red = pixel(&rgba, w, 140, 250);
        assert!(
            red[0] > 180 && red[1] < 100 && red[2] < 100,
            "box pixel is {red:?}, want red"
        );
        let white = pixel(&rgba, w, 700, 550);
        assert!(
            white.iter().all(|&v| v > 240),
            "background pixel is {white:?}, want white"
        );

        // Click and type by CSS selector.
        let mut click = BrowserClickRequest::new();
        click.selector = "#btn".into();
        c.browser_click(ctx(), &click).await.unwrap();
        let t = text(&c, 0).await;
        assert!(t.text.contains("button clicked"), "{:?}", t.text);
        // A JavaScript dialog does not hang the page: the agent accepts it.
        click.selector = "#alert".into();
        c.browser_click(ctx(), &click).await.unwrap();
        let t = text(&c, 0).await;
        assert!(t.text.contains("alert answered"), "{:?}", t.text);
        let mut ty = BrowserTypeRequest::new();
        ty.selector = "input#name".into();
        ty.text = "burrow".into();
        c.browser_type(ctx(), &ty).await.unwrap();
        let t = text(&c, 0).await;
        assert!(t.text.contains("typed: burrow"), "{:?}", t.text);

        // Clear errors, and the session survives them.
        click.selector = "#no-such-element".into();
        assert_eq!(
            code_of(c.browser_click(ctx(), &click).await),
            ttrpc::Code::NOT_FOUND
        );
        click.selector = "##".into();
        assert_eq!(
            code_of(c.browser_click(ctx(), &click).await),
            ttrpc::Code::INVALID_ARGUMENT
        );
        nav.url = "file:///guest/tmp/www/missing.html".into();
        assert_eq!(
            code_of(c.browser_navigate(ctx(), &nav).await),
            ttrpc::Code::FAILED_PRECONDITION
        );
        nav.url = "data:text/html,<title>second</title><p>still here</p>".into();
        let r = c.browser_navigate(ctx(), &nav).await.unwrap();
        assert_eq!(r.title, "second");
        assert!(text(&c, 0).await.text.contains("still here"));

        // Chromium runs with its sandbox: renderers have a seccomp filter.
        let procs = chromium_processes(&c).await;
        assert!(
            procs.iter().any(|p| p.1),
            "no chromium process under seccomp: {procs:?}"
        );

        // Close stops every Chromium process and unmounts the image.
        c.browser_close(ctx(), &BrowserCloseRequest::new())
            .await
            .unwrap();
        let mounts = read_guest_file(&c, "/proc/mounts").await;
        assert!(
            !mounts.contains("/run/burrow/browser"),
            "still mounted after close:\n{mounts}"
        );
        let t0 = Instant::now();
        loop {
            let left = chromium_processes(&c).await;
            if left.is_empty() {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "left after close: {left:?}"
            );
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        c.power_off(ctx(), &PowerOffRequest::new()).await.unwrap();
    });
    assert_eq!(st.code(), Some(0), "{}", vm.diagnostics());
    let _ = std::fs::remove_dir_all(&dir);
}
