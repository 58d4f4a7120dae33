//! The MCP tools against a fake shim control socket: exec's inline cap,
//! paging through the whole output by reference, redaction, and errors.

#![allow(clippy::unwrap_used)]

use std::io::{BufRead, BufReader, Write};

use burrow_vmm_api::sandbox_control::{control_socket, SandboxReply};
use burrow_vmm_api::sandbox_tools::{ExecOutput, ReadOutput};

use super::*;

/// The text of a tool result, and whether it is an error.
fn text(r: &CallToolResult) -> (String, bool) {
    let mut s = String::new();
    for c in &r.content {
        if let ContentBlock::Text(t) = c {
            s.push_str(&t.text);
        }
    }
    (s, r.is_error == Some(true))
}

/// The text blocks of a tool result.
fn blocks(r: &CallToolResult) -> Vec<String> {
    r.content
        .iter()
        .filter_map(|c| match c {
            ContentBlock::Text(t) => Some(t.text.clone()),
            _ => None,
        })
        .collect()
}

/// A fake shim for sandbox `s1` answering each request with the next of
/// `replies`; the requests it saw.
fn fake_shim(
    root: &std::path::Path,
    replies: Vec<ToolReply>,
) -> std::thread::JoinHandle<Vec<String>> {
    let dir = root.join("default").join("s1");
    std::fs::create_dir_all(&dir).unwrap();
    let l = std::os::unix::net::UnixListener::bind(control_socket(&dir)).unwrap();
    std::thread::spawn(move || {
        let mut seen = Vec::new();
        for reply in replies {
            let (mut s, _) = l.accept().unwrap();
            let mut line = String::new();
            BufReader::new(&s).read_line(&mut line).unwrap();
            seen.push(line);
            let r = SandboxReply::tool("running", Ok(reply));
            s.write_all(&burrow_vmm_api::to_line(&r)).unwrap();
        }
        seen
    })
}

#[tokio::test]
async fn exec_output_is_capped_paged_by_reference_and_redacted() {
    let d = tempfile::tempdir().unwrap();
    // 1 MB of numbered lines with a fake key in the middle of it.
    let mut big = String::new();
    for i in 0..80_000 {
        big.push_str(&format!("line {i:07}\n"));
        if i == 40_000 {
            big.push_str("AWS_KEY AKIAABCDEFGHIJKLMNOP\n");
        }
    }
    let shim = fake_shim(
        d.path(),
        vec![
            ToolReply::Exec(ExecOutput {
                stdout: big.clone(),
                stderr: "warning: ghp_0123456789abcdefghijklmnopqrstuvwxyzAB\n".into(),
                exit_code: Some(2),
                ..Default::default()
            }),
            ToolReply::Read(ReadOutput {
                text: "A=1\nSECRET=swordfish\n".into(),
                first: 1,
                last: 2,
                total: Some(2),
                line_cut: false,
            }),
        ],
    );
    let b = Burrow::new(d.path().to_path_buf(), "default".into());
    let r = b
        .exec(Parameters(ExecArgs {
            sandbox: "s1".into(),
            command: "seq".into(),
            cwd: None,
            env: Default::default(),
            timeout_secs: Some(5),
            detach: false,
        }))
        .await
        .unwrap();
    let (shown, err) = text(&r);
    assert!(!err, "{shown}");
    assert!(shown.starts_with("exit status: 2\n"), "{shown}");
    assert!(
        shown.len() < output::INLINE + 1024,
        "{} bytes inline",
        shown.len()
    );
    assert!(shown.contains("[truncated: showing "), "{shown}");
    assert!(!shown.contains("ghp_0123"), "{shown}");
    assert!(shown.contains("[REDACTED:github-token]"), "{shown}");
    assert!(shown.contains("secret(s) redacted"), "{shown}");
    let reference = shown
        .split("ref=\"")
        .nth(1)
        .and_then(|s| s.split('"').next())
        .unwrap()
        .to_string();

    // Page through all of stdout: every line comes back, the key redacted.
    let (mut offset, mut all) = (0, String::new());
    loop {
        let r = b
            .read_output(Parameters(ReadOutputArgs {
                reference: reference.clone(),
                stream: "stdout".into(),
                offset,
                length: Some(output::MAX_PAGE),
            }))
            .await
            .unwrap();
        assert_ne!(r.is_error, Some(true), "{r:?}");
        let [page, note] = &blocks(&r)[..] else {
            panic!("{r:?}")
        };
        all.push_str(page);
        if note.ends_with("the end]") {
            break;
        }
        offset = note
            .rsplit("offset=")
            .next()
            .and_then(|s| s.trim_end_matches(']').parse().ok())
            .unwrap();
    }
    let expected = big.replace("AKIAABCDEFGHIJKLMNOP", "[REDACTED:aws-access-key]");
    assert_eq!(all.len(), expected.len());
    assert!(all == expected, "the pages do not add up to the output");

    // A .env file loses every value.
    let r = b
        .read_file(Parameters(ReadFileArgs {
            sandbox: "s1".into(),
            path: "/app/.env".into(),
            start_line: None,
            end_line: None,
        }))
        .await
        .unwrap();
    let (shown, _) = text(&r);
    assert!(
        shown.starts_with("A=[REDACTED:env-value]\nSECRET=[REDACTED:env-value]\n"),
        "{shown}"
    );
    assert!(shown.contains("lines 1-2 of 2, 0 remain"), "{shown}");

    let seen = shim.join().unwrap();
    assert!(seen[0].contains("\"max_output\":2097152"), "{}", seen[0]);
    assert!(
        seen[0].contains("[\"/bin/sh\",\"-c\",\"seq\"]"),
        "{}",
        seen[0]
    );
}

#[tokio::test]
async fn a_missing_sandbox_and_a_lost_reference_are_clear_errors() {
    let d = tempfile::tempdir().unwrap();
    let b = Burrow::new(d.path().to_path_buf(), "default".into());
    let r = b
        .list_dir(Parameters(PathArgs {
            sandbox: "nope".into(),
            path: "/".into(),
        }))
        .await
        .unwrap();
    let (shown, err) = text(&r);
    assert!(err);
    assert_eq!(
        shown,
        "there is no sandbox \"nope\" in namespace \"default\""
    );
    let r = b
        .read_output(Parameters(ReadOutputArgs {
            reference: "out-9".into(),
            stream: "stdout".into(),
            offset: 0,
            length: None,
        }))
        .await
        .unwrap();
    let (shown, err) = text(&r);
    assert!(
        err && shown.contains("no output \"out-9\" is kept"),
        "{shown}"
    );
    let r = b.sandboxes_list(Parameters(NoArgs {})).await.unwrap();
    assert_eq!(text(&r).0, "no sandboxes in namespace \"default\"\n");
}
