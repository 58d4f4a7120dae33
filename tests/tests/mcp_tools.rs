//! `burrow mcp` with a real MCP client (rmcp's, over stdio) against a real
//! sandbox started through containerd (`ctr run -d`): initialize,
//! tools/list with schemas and annotations, a call of every tool, paging
//! through about 1 MB of output by reference, a planted fake key redacted
//! from everything, and a clear error for a sandbox that does not exist.
//! Run inside hack/testhost.

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::Duration;

use base64::Engine;
use burrow_tests::containerd::{Containerd, LONG};
use rmcp::model::{CallToolRequestParams, CallToolResult, ContentBlock};
use rmcp::service::RunningService;
use rmcp::transport::TokioChildProcess;
use rmcp::{RoleClient, ServiceExt};
use serde_json::{json, Value};

const ID: &str = "t-mcp";
/// The sandbox MCP `restore` makes from a checkpoint of [`ID`], and the
/// copy `fork` makes.
const RESTORED: &str = "t-mcp-restored";
const FORKED: &str = "t-mcp-fork-1";
/// A fake AWS access key id, planted in output and in a file.
const FAKE_KEY: &str = "AKIAZZZZEXAMPLEKEY42";

type Client = RunningService<RoleClient, ()>;

/// The text blocks of a result, and whether it is an error.
fn texts(r: &CallToolResult) -> (Vec<String>, bool) {
    let t = r
        .content
        .iter()
        .filter_map(|c| match c {
            ContentBlock::Text(t) => Some(t.text.clone()),
            _ => None,
        })
        .collect();
    (t, r.is_error == Some(true))
}

/// Call `tool` with `args`; its text (all blocks joined) and error flag.
async fn call(client: &Client, tool: &'static str, args: Value) -> (String, bool) {
    let Value::Object(args) = args else {
        panic!("arguments must be an object")
    };
    let r = client
        .call_tool(CallToolRequestParams::new(tool).with_arguments(args))
        .await
        .unwrap_or_else(|e| panic!("{tool}: {e}"));
    let (t, err) = texts(&r);
    (t.concat(), err)
}

/// Call `tool` and insist it succeeded; its text.
async fn ok(client: &Client, tool: &'static str, args: Value) -> String {
    let (text, err) = call(client, tool, args).await;
    assert!(!err, "{tool} failed: {text}");
    text
}

#[test]
fn mcp_client_calls_every_tool_pages_output_and_sees_no_secret() {
    let c = Containerd::nested("mcp-tools");
    let r = c.ctr(&Containerd::run_args(&["-d"], ID, &["sleep", "100000"]));
    assert_eq!(r.code, Some(0), "{r:?}\n{}", c.diagnostics());
    c.wait_status(ID, "RUNNING", LONG);

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(session(&c));

    // The audit log has every call, the planted key redacted from it.
    let r = c.burrow(&["audit", ID, "--json"]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(!r.stdout.contains(FAKE_KEY), "{}", r.stdout);
    let entries: Vec<Value> = r
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let tools: Vec<&str> = entries.iter().filter_map(|e| e["tool"].as_str()).collect();
    for t in ["exec", "read", "write", "edit", "ls"] {
        assert!(tools.contains(&t), "no {t} in {tools:?}");
    }
    assert!(
        entries
            .iter()
            .any(|e| e["tool"] == "exec" && e["exit_status"] == 3),
        "{}",
        r.stdout
    );
    assert!(
        entries
            .iter()
            .any(|e| e["tool"] == "read" && e["ok"] == false),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains("[REDACTED:aws-access-key]"),
        "{}",
        r.stdout
    );

    for id in [ID, RESTORED, FORKED] {
        assert_eq!(c.ctr(&["task", "kill", "-s", "SIGKILL", id]).code, Some(0));
        c.wait_status(id, "STOPPED", LONG);
        c.ctr(&["task", "delete", id]);
        c.ctr(&["containers", "rm", id]);
    }
    // Whatever the failed restore left.
    c.ctr(&["task", "delete", "-f", "t-mcp-r2"]);
    c.ctr(&["containers", "rm", "t-mcp-r2"]);
}

/// An MCP session with `burrow mcp` for containerd `c`.
async fn connect(c: &Containerd) -> Client {
    let mut cmd = tokio::process::Command::new(burrow_tests::workspace_bin("burrow"));
    cmd.arg("mcp")
        .arg("--address")
        .arg(c.socket())
        .env("BURROW_CONFIG", c.dir.join("burrow.toml"));
    ().serve(TokioChildProcess::new(cmd).unwrap())
        .await
        .unwrap()
}

async fn session(c: &Containerd) {
    let client = connect(c).await;

    // initialize: the server says who it is and that it has tools.
    let info = client.peer_info().unwrap();
    assert_eq!(
        info.server_info.as_ref().map(|i| i.name.as_str()),
        Some("burrow")
    );
    assert!(info.capabilities.tools.is_some(), "{info:?}");

    // tools/list: every tool, each with a schema and its hints.
    let tools = client.list_all_tools().await.unwrap();
    let mut names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "browser_click",
            "browser_navigate",
            "browser_screenshot",
            "browser_snapshot",
            "browser_type",
            "checkpoint",
            "edit_file",
            "exec",
            "exec_read",
            "fork",
            "list_dir",
            "read_file",
            "read_output",
            "restore",
            "sandboxes_list",
            "write_file"
        ]
    );
    let tool = |n: &str| tools.iter().find(|t| t.name == n).unwrap();
    let hints = |n: &str| {
        let a = tool(n).annotations.clone().unwrap();
        (a.read_only_hint, a.destructive_hint)
    };
    assert_eq!(hints("read_file"), (Some(true), None));
    assert_eq!(hints("exec"), (Some(false), Some(true)));
    assert_eq!(hints("write_file"), (Some(false), Some(true)));
    assert_eq!(hints("edit_file"), (Some(false), Some(false)));
    // restore and fork make new sandboxes and change none.
    assert_eq!(hints("restore"), (Some(false), Some(false)));
    assert_eq!(hints("fork"), (Some(false), Some(false)));
    let restore_schema = serde_json::to_value(&*tool("restore").input_schema).unwrap();
    assert_eq!(
        restore_schema["required"],
        json!(["checkpoint", "new_sandbox", "sandbox"]),
        "{restore_schema}"
    );
    let exec_schema = serde_json::to_value(&*tool("exec").input_schema).unwrap();
    assert_eq!(
        exec_schema["required"],
        json!(["sandbox", "command"]),
        "{exec_schema}"
    );

    // sandboxes_list names ours, running.
    let list = ok(&client, "sandboxes_list", json!({})).await;
    assert!(
        list.lines()
            .any(|l| l.starts_with(ID) && l.ends_with("running")),
        "{list}"
    );

    // exec: status and both streams.
    let out = ok(
        &client,
        "exec",
        json!({"sandbox": ID, "command": "echo hi; echo oops >&2; exit 3"}),
    )
    .await;
    assert!(out.starts_with("exit status: 3\n"), "{out}");
    assert!(out.contains("--- stdout (3 bytes) ---\nhi\n"), "{out}");
    assert!(out.contains("--- stderr (5 bytes) ---\noops\n"), "{out}");
    let out = ok(
        &client,
        "exec",
        json!({"sandbox": ID, "command": "echo $G in $(pwd)", "cwd": "/tmp", "env": {"G": "hello"}}),
    )
    .await;
    assert!(out.contains("hello in /tmp\n"), "{out}");

    // exec with detach: a session id at once; exec_read reads it by offset
    // (a planted key redacted there too) until its status.
    let out = ok(
        &client,
        "exec",
        json!({"sandbox": ID, "command": format!("echo first; sleep 2; echo 'k {FAKE_KEY}'; exit 4"), "detach": true}),
    )
    .await;
    let session = out
        .strip_prefix("started session ")
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or_else(|| panic!("{out}"))
        .to_string();
    let mut all = String::new();
    let mut from = 0u64;
    let end = loop {
        let page = ok(
            &client,
            "exec_read",
            json!({"sandbox": ID, "session": session, "from": from, "wait_secs": 30, "max_bytes": 64}),
        )
        .await;
        let (text, note) = page
            .rsplit_once("[session ")
            .unwrap_or_else(|| panic!("{page}"));
        all.push_str(text);
        if note.contains("exited with status") {
            break note.to_string();
        }
        from = note
            .rsplit_once("from=")
            .map(|(_, n)| {
                n.chars()
                    .take_while(char::is_ascii_digit)
                    .collect::<String>()
            })
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{page}"));
    };
    assert!(end.contains("exited with status 4"), "{end}");
    assert!(
        all.starts_with("first\n") && all.contains("REDACTED"),
        "{all}"
    );
    assert!(!all.contains(FAKE_KEY), "{all}");

    // About 1 MB of output with a fake key in the middle: 8 KiB inline,
    // the whole of it paged by reference, the key redacted everywhere.
    let cmd = format!("seq 1 70000; echo 'key {FAKE_KEY} here'; seq 70001 160000");
    let out = ok(
        &client,
        "exec",
        json!({"sandbox": ID, "command": cmd, "timeout_secs": 600}),
    )
    .await;
    assert!(out.len() < 9 * 1024, "{} bytes inline", out.len());
    assert!(out.contains("[truncated: showing 8192 of "), "{out}");
    assert!(!out.contains(FAKE_KEY), "{out}");
    let reference = out
        .split("ref=\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .unwrap()
        .to_string();
    let mut expected: String = (1..=70000).map(|i| format!("{i}\n")).collect();
    expected.push_str("key [REDACTED:aws-access-key] here\n");
    expected.extend((70001..=160000).map(|i| format!("{i}\n")));
    assert!(expected.len() > 1_000_000);
    let (mut offset, mut all, mut pages) = (0usize, String::new(), 0);
    loop {
        let args = json!({"ref": reference, "stream": "stdout", "offset": offset, "length": 32768});
        let Value::Object(args) = args else {
            unreachable!()
        };
        let r = client
            .call_tool(CallToolRequestParams::new("read_output").with_arguments(args))
            .await
            .unwrap();
        let (t, err) = texts(&r);
        assert!(!err, "{t:?}");
        let [page, note] = &t[..] else {
            panic!("{t:?}")
        };
        assert!(!page.contains(FAKE_KEY));
        all.push_str(page);
        pages += 1;
        if note.ends_with("the end]") {
            break;
        }
        offset = note
            .rsplit("offset=")
            .next()
            .and_then(|s| s.trim_end_matches(']').parse().ok())
            .unwrap_or_else(|| panic!("no next offset in {note}"));
        assert!(pages < 100, "paging does not end");
    }
    assert_eq!(all.len(), expected.len());
    assert!(all == expected, "the pages do not add up to the output");

    // Files: write, read a line range, a unique edit, an ambiguous one.
    let lines: String = (1..=1200).map(|i| format!("line {i}\n")).collect();
    let w = ok(
        &client,
        "write_file",
        json!({"sandbox": ID, "path": "/tmp/n.txt", "content": lines}),
    )
    .await;
    assert!(w.contains("wrote 10893 bytes"), "{w}");
    let r = ok(
        &client,
        "read_file",
        json!({"sandbox": ID, "path": "/tmp/n.txt", "start_line": 1000, "end_line": 1001}),
    )
    .await;
    assert!(r.starts_with("line 1000\nline 1001\n"), "{r}");
    assert!(
        r.contains("lines 1000-1001 of 1200, 199 remain; next: start_line=1002"),
        "{r}"
    );
    let e = ok(&client, "edit_file", json!({"sandbox": ID, "path": "/tmp/n.txt", "old_string": "line 7\n", "new_string": "LINE SEVEN\n"})).await;
    assert!(e.contains("replaced at line 7"), "{e}");
    let (e, err) = call(
        &client,
        "edit_file",
        json!({"sandbox": ID, "path": "/tmp/n.txt", "old_string": "line 1", "new_string": "x"}),
    )
    .await;
    assert!(err && e.contains("times"), "{e}");
    let r = ok(
        &client,
        "read_file",
        json!({"sandbox": ID, "path": "/tmp/n.txt", "start_line": 6, "end_line": 8}),
    )
    .await;
    assert!(r.starts_with("line 6\nLINE SEVEN\nline 8\n"), "{r}");

    // A .env file and a key in a file: redacted when read.
    let env = format!("DATABASE_URL=postgres://u:pw@db/x\nAWS_ACCESS_KEY_ID={FAKE_KEY}\n");
    ok(
        &client,
        "write_file",
        json!({"sandbox": ID, "path": "/app/.env", "content": env}),
    )
    .await;
    let r = ok(
        &client,
        "read_file",
        json!({"sandbox": ID, "path": "/app/.env"}),
    )
    .await;
    assert!(!r.contains(FAKE_KEY) && !r.contains("pw@db"), "{r}");
    assert!(r.starts_with("DATABASE_URL=[REDACTED:env-value]\n"), "{r}");
    assert!(r.contains("secret(s) redacted"), "{r}");

    // list_dir shows the files with their sizes.
    let l = ok(&client, "list_dir", json!({"sandbox": ID, "path": "/app"})).await;
    assert!(
        l.lines()
            .any(|l| l.ends_with(" .env") && l.starts_with("-rw-r--r--")),
        "{l}"
    );

    // checkpoint: written, the sandbox runs on.
    let cp = ok(
        &client,
        "checkpoint",
        json!({"sandbox": ID, "name": "mcp-cp1"}),
    )
    .await;
    assert!(
        cp.contains("checkpoint mcp-cp1 of t-mcp written to "),
        "{cp}"
    );
    let out = ok(
        &client,
        "exec",
        json!({"sandbox": ID, "command": "cat /tmp/n.txt | wc -l; echo after > /tmp/after"}),
    )
    .await;
    assert!(out.contains("1200"), "{out}");

    // restore: a new sandbox from the checkpoint, as it was then (the file
    // written before it, not the one after); the source is untouched.
    let r = ok(
        &client,
        "restore",
        json!({"checkpoint": "mcp-cp1", "new_sandbox": RESTORED, "sandbox": ID}),
    )
    .await;
    assert!(
        r.contains("restored checkpoint mcp-cp1 into a new sandbox t-mcp-restored"),
        "{r}"
    );
    let out = ok(
        &client,
        "exec",
        json!({"sandbox": RESTORED, "command": "wc -l < /tmp/n.txt; cat /tmp/after || echo no-after"}),
    )
    .await;
    assert!(out.contains("1200\n") && out.contains("no-after"), "{out}");
    let out = ok(
        &client,
        "exec",
        json!({"sandbox": ID, "command": "cat /tmp/after"}),
    )
    .await;
    assert!(out.contains("after"), "{out}");
    // A checkpoint that does not exist, and a bad new id: clear errors.
    let (e, err) = call(
        &client,
        "restore",
        json!({"checkpoint": "mcp-nosuch", "new_sandbox": "t-mcp-r2", "sandbox": ID}),
    )
    .await;
    assert!(err && e.contains("mcp-nosuch"), "{e}");
    let (e, err) = call(
        &client,
        "restore",
        json!({"checkpoint": "mcp-cp1", "new_sandbox": "../x", "sandbox": ID}),
    )
    .await;
    assert!(err && e.contains("invalid sandbox id"), "{e}");

    // fork: a copy of the sandbox as it is now (with /tmp/after), its own
    // writes its own.
    let f = ok(&client, "fork", json!({"sandbox": ID, "copies": 1})).await;
    assert!(
        f.contains("forked t-mcp into 1 running copies:\nt-mcp-fork-1\n"),
        "{f}"
    );
    let out = ok(
        &client,
        "exec",
        json!({"sandbox": FORKED, "command": "cat /tmp/after; echo copy > /tmp/after"}),
    )
    .await;
    assert!(out.contains("--- stdout (6 bytes) ---\nafter\n"), "{out}");
    let out = ok(
        &client,
        "exec",
        json!({"sandbox": ID, "command": "cat /tmp/after"}),
    )
    .await;
    assert!(out.contains("after\n") && !out.contains("copy"), "{out}");
    let (e, err) = call(&client, "fork", json!({"sandbox": ID, "copies": 0})).await;
    assert!(err && e.contains("1 to 8"), "{e}");
    let (e, err) = call(&client, "fork", json!({"sandbox": "t-nosuch"})).await;
    assert!(err && e.contains("no sandbox"), "{e}");

    // This sandbox did not ask for a browser: browser tools say so.
    let (e, err) = call(&client, "browser_snapshot", json!({"sandbox": ID})).await;
    assert!(
        err && e.contains("has no browser") && e.contains("io.burrow.browser=true"),
        "{e}"
    );

    // A sandbox that does not exist: a clear tool error, not a crash.
    let (e, err) = call(
        &client,
        "exec",
        json!({"sandbox": "t-nosuch", "command": "true"}),
    )
    .await;
    assert!(err, "{e}");
    assert_eq!(
        e,
        "there is no sandbox \"t-nosuch\" in namespace \"default\""
    );
    let (e, err) = call(
        &client,
        "read_file",
        json!({"sandbox": ID, "path": "/tmp/nope"}),
    )
    .await;
    assert!(err && e.contains("/tmp/nope"), "{e}");

    tokio::time::timeout(Duration::from_secs(30), client.cancel())
        .await
        .unwrap()
        .unwrap();
}

const BROWSER_ID: &str = "t-mcp-browser";

/// A page with a button and an input that say what happened to them (a
/// data: URL: no file or server needed).
const PAGE: &str = "data:text/html,<title>mcp page</title><h1>Hello MCP</h1>\
<p id=out>not clicked</p>\
<button onclick=\"document.getElementById('out').textContent='button clicked'\">Press</button>\
<input id=name placeholder=\"Your name\" \
oninput=\"document.getElementById('out').textContent='typed: '+this.value\">";

#[test]
fn mcp_browser_tools_on_a_sandbox_that_asked_for_a_browser() {
    let image = burrow_tests::asset_from_env("BURROW_BROWSER_IMAGE", "rootfs/browser-image");
    // Top-level keys go before NESTED_CONFIG's [memory_mib] table.
    let config = format!(
        "browser_image = {:?}\n{}",
        image.display().to_string(),
        burrow_tests::containerd::NESTED_CONFIG
    );
    let c = Containerd::start("mcp-browser", &config);
    let flags = [
        "-d",
        "--annotation",
        "io.burrow.browser=true",
        "--annotation",
        "io.burrow.memory_mib=2048",
    ];
    // A browser sandbox starts from a template too (its own shape: the
    // image is the template's first disk). The first one builds it; the one
    // the MCP client drives is then restored from it, the way most
    // sandboxes start. Chromium starts once, in that one: each start takes
    // minutes in the nested test host (agent_browser drives a browser in a
    // cold-booted VM).
    let builder = "t-mcp-browser-0";
    let r = c.ctr(&Containerd::run_args(&flags, builder, &["sleep", "100000"]));
    assert_eq!(r.code, Some(0), "{r:?}\n{}", c.diagnostics());
    c.wait_status(builder, "RUNNING", LONG);
    c.assert_started_as_configured(builder);
    let r = c.ctr(&Containerd::run_args(
        &flags,
        BROWSER_ID,
        &["sleep", "100000"],
    ));
    assert_eq!(r.code, Some(0), "{r:?}\n{}", c.diagnostics());
    c.wait_status(BROWSER_ID, "RUNNING", LONG);
    c.assert_started_as_configured(BROWSER_ID);
    if burrow_tests::containerd::templates_on() {
        let phases = c.start_phases(BROWSER_ID);
        assert!(
            phases.starts_with("created from a template (restored)"),
            "{phases}"
        );
    }

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let client = connect(&c).await;
        let url = PAGE.replace(' ', "%20");
        let nav = ok(
            &client,
            "browser_navigate",
            json!({"sandbox": BROWSER_ID, "url": url, "timeout_secs": 300}),
        )
        .await;
        assert!(nav.contains("title: mcp page\n"), "{nav}");
        assert!(
            nav.contains("Hello MCP") && nav.contains("not clicked"),
            "{nav}"
        );

        let snap = ok(&client, "browser_snapshot", json!({"sandbox": BROWSER_ID})).await;
        assert!(snap.contains("[1] button \"Press\"\n"), "{snap}");
        assert!(snap.contains("[2] input[text] \"Your name\""), "{snap}");

        let after = ok(
            &client,
            "browser_click",
            json!({"sandbox": BROWSER_ID, "index": 1}),
        )
        .await;
        assert!(after.contains("button clicked"), "{after}");
        let after = ok(
            &client,
            "browser_type",
            json!({"sandbox": BROWSER_ID, "index": 2, "text": "Ada"}),
        )
        .await;
        assert!(after.contains("typed: Ada"), "{after}");
        // The indexes hold for the page's life.
        let snap = ok(&client, "browser_snapshot", json!({"sandbox": BROWSER_ID})).await;
        assert!(snap.contains("[1] button \"Press\"\n"), "{snap}");
        let (e, err) = call(
            &client,
            "browser_click",
            json!({"sandbox": BROWSER_ID, "index": 99}),
        )
        .await;
        assert!(err && e.contains("data-burrow-idx"), "{e}");

        // A screenshot comes back as an image of the asked size.
        let Value::Object(args) = json!({"sandbox": BROWSER_ID, "width": 640, "height": 480})
        else {
            unreachable!()
        };
        let r = client
            .call_tool(CallToolRequestParams::new("browser_screenshot").with_arguments(args))
            .await
            .unwrap();
        let image = r
            .content
            .iter()
            .find_map(|c| match c {
                ContentBlock::Image(i) => Some(i.clone()),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no image in {r:?}"));
        assert_eq!(image.mime_type, "image/png");
        let png = base64::engine::general_purpose::STANDARD
            .decode(image.data.as_bytes())
            .unwrap();
        let decoder = png::Decoder::new(&png[..]);
        let info = decoder.read_info().unwrap();
        assert_eq!((info.info().width, info.info().height), (640, 480));

        // A page that never loads (a listener in the guest that accepts and
        // never answers; its stdin held open so that it never closes the
        // connection either): a clear error within its timeout, and the
        // sandbox and its browser keep working. The container shares the
        // guest's network namespace with the browser.
        let out = ok(
            &client,
            "exec",
            json!({"sandbox": BROWSER_ID, "command": "sleep 100000 | nc -l -p 8000 >/dev/null", "detach": true}),
        )
        .await;
        assert!(out.starts_with("started session "), "{out}");
        // Listening on port 8000 (state 0A; busybox nc listens on [::], which
        // takes 127.0.0.1 too) before the browser tries it.
        let wait = "i=0; until grep -q ':1F40 0*:0000 0A' /proc/net/tcp /proc/net/tcp6; do \
            i=$((i+1)); [ $i -gt 300 ] && exit 1; sleep 0.2; done";
        let out = ok(&client, "exec", json!({"sandbox": BROWSER_ID, "command": wait})).await;
        assert!(out.starts_with("exit status: 0"), "no listener on 8000: {out}");
        let start = std::time::Instant::now();
        let (e, err) = call(
            &client,
            "browser_navigate",
            json!({"sandbox": BROWSER_ID, "url": "http://127.0.0.1:8000/", "timeout_secs": 10}),
        )
        .await;
        let took = start.elapsed();
        assert!(
            err && (e.contains("timed out") || e.contains("did not finish loading")),
            "{e}"
        );
        assert!(e.contains("127.0.0.1:8000"), "{e}");
        // 10 s, with room for the nested test host's slowness.
        assert!(took < Duration::from_secs(60), "the error took {took:?}");
        let out = ok(
            &client,
            "exec",
            json!({"sandbox": BROWSER_ID, "command": "echo alive"}),
        )
        .await;
        assert!(out.contains("alive"), "{out}");
        let nav = ok(
            &client,
            "browser_navigate",
            json!({"sandbox": BROWSER_ID, "url": url, "timeout_secs": 120}),
        )
        .await;
        assert!(nav.contains("title: mcp page\n"), "{nav}");
        client.cancel().await.unwrap();
    });

    // The CLI verbs reach the same page.
    let r = c.burrow(&["browse", BROWSER_ID, "--text"]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(r.stdout.contains("[1] button \"Press\""), "{r:?}");
    let out = c.dir.join("shot.png");
    let r = c.burrow(&["screenshot", BROWSER_ID, "--out", out.to_str().unwrap()]);
    assert_eq!(r.code, Some(0), "{r:?}");
    assert!(std::fs::read(&out).unwrap().starts_with(b"\x89PNG"));

    let third = restored_browser_sandbox(&c, &flags, BROWSER_ID, &image);

    for id in [builder, BROWSER_ID, &third] {
        c.ctr(&["task", "kill", "-s", "SIGKILL", id]);
        c.wait_status(id, "STOPPED", LONG);
        c.ctr(&["task", "delete", id]);
        c.ctr(&["containers", "rm", id]);
    }
}

/// A named checkpoint of browser sandbox `source` (a template-born VM: its
/// rootfs in a block slot, the browser image its disk) restored as a new
/// sandbox: each disk comes back where it was. The restored guest reads
/// the file written before the checkpoint, its browser shows the page it
/// had and works on, and its writes go to its own disk, never into the
/// shared browser image (`image`, unchanged). Returns the new id.
fn restored_browser_sandbox(c: &Containerd, flags: &[&str], source: &str, image: &Path) -> String {
    c.exec_ok(source, "mark", &["sh", "-c", "echo before-checkpoint > /root-mark"]);
    let before = std::fs::metadata(image).unwrap();
    let state = c.burrow_state().display().to_string();
    let r = c.burrow(&["sandbox", "checkpoint", "--state-dir", &state, source, "browser-cp"]);
    assert_eq!(r.code, Some(0), "{r:?}\n{}", c.diagnostics());
    let restored = "t-mcp-browser-3";
    let restore = "io.burrow.restore=browser-cp";
    let mut with_restore = flags.to_vec();
    with_restore.extend(["--annotation", restore]);
    let r = c.ctr(&Containerd::run_args(&with_restore, restored, &["sleep", "100000"]));
    assert_eq!(r.code, Some(0), "{r:?}\n{}", c.diagnostics());
    c.wait_status(restored, "RUNNING", LONG);
    let mark = c.exec_ok(restored, "read", &["cat", "/root-mark"]);
    assert_eq!(mark.trim(), "before-checkpoint");
    c.exec_ok(restored, "write", &["sh", "-c", "head -c 1048576 /dev/urandom > /after && sync"]);
    let r = c.burrow(&["browse", restored, "--text"]);
    assert!(
        r.stdout.contains("[1] button \"Press\""),
        "the page it had: {r:?}"
    );
    let page = "data:text/html,<title>third</title><button>restored</button>";
    let r = c.burrow(&["browse", restored, page, "--text", "--timeout", "300"]);
    assert!(r.stdout.contains("[1] button \"restored\""), "{r:?}\n{}", c.diagnostics());
    let after = std::fs::metadata(image).unwrap();
    assert_eq!(
        (after.len(), after.modified().unwrap()),
        (before.len(), before.modified().unwrap()),
        "the shared browser image {} was written",
        image.display()
    );
    std::fs::remove_dir_all(c.snapshot_dir().join(".checkpoints").join("browser-cp")).unwrap();
    restored.to_string()
}
