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
            encoding: None,
            offset: None,
            length: None,
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

/// A fake shim for sandbox `s1` serving one `burrow cp` request: a
/// download of `file` (its `offset`/`length` applied) or an upload, whose
/// bytes it returns with the request line.
fn fake_copy_shim(
    root: &std::path::Path,
    file: Vec<u8>,
) -> std::thread::JoinHandle<(String, Vec<u8>)> {
    use burrow_vmm_api::sandbox_tools::{frame, CopyInfo, DownloadRequest};
    use std::io::Read;
    let dir = root.join("default").join("s1");
    std::fs::create_dir_all(&dir).unwrap();
    let _ = std::fs::remove_file(control_socket(&dir));
    let l = std::os::unix::net::UnixListener::bind(control_socket(&dir)).unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        let reply = |t| burrow_vmm_api::to_line(&SandboxReply::tool("running", Ok(t)));
        let req: SandboxRequest = serde_json::from_str(line.trim()).unwrap();
        let mut got = Vec::new();
        match req {
            SandboxRequest::Download(DownloadRequest { path, offset, length }) => {
                let from = (offset as usize).min(file.len());
                let to = length.map_or(file.len(), |l| (from + l as usize).min(file.len()));
                let info = CopyInfo {
                    path,
                    size: (to - from) as u64,
                    mode: 0o644,
                    file_size: Some(file.len() as u64),
                };
                s.write_all(&reply(ToolReply::Ready(info.clone()))).unwrap();
                for chunk in file[from..to].chunks(7) {
                    s.write_all(&frame::header(chunk.len())).unwrap();
                    s.write_all(chunk).unwrap();
                }
                s.write_all(&frame::header(0)).unwrap();
                s.write_all(&reply(ToolReply::Copied(info))).unwrap();
            }
            SandboxRequest::Upload(u) => {
                let info = CopyInfo {
                    path: u.path,
                    size: u.size.unwrap(),
                    mode: 0o644,
                    file_size: None,
                };
                s.write_all(&reply(ToolReply::Ready(info.clone()))).unwrap();
                loop {
                    let mut h = [0u8; 4];
                    r.read_exact(&mut h).unwrap();
                    let n = frame::parse(h).unwrap();
                    if n == 0 {
                        break;
                    }
                    let mut b = vec![0u8; n];
                    r.read_exact(&mut b).unwrap();
                    got.extend(b);
                }
                s.write_all(&reply(ToolReply::Copied(info))).unwrap();
            }
            other => panic!("not a copy: {other:?}"),
        }
        (line, got)
    })
}

#[tokio::test]
async fn binary_files_are_read_in_base64_ranges_and_written_from_base64() {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let d = tempfile::tempdir().unwrap();
    let b = Burrow::new(d.path().to_path_buf(), "default".into());
    let png: Vec<u8> = (0..=255u8).cycle().take(10_000).collect();
    let read = |offset, length| ReadFileArgs {
        sandbox: "s1".into(),
        path: "/tmp/shot.png".into(),
        start_line: None,
        end_line: None,
        encoding: Some("base64".into()),
        offset,
        length,
    };
    // A range in the middle: its bytes, and where to go on.
    let shim = fake_copy_shim(d.path(), png.clone());
    let r = b.read_file(Parameters(read(Some(5000), Some(1000)))).await.unwrap();
    let (line, _) = shim.join().unwrap();
    let [data, note] = &blocks(&r)[..] else {
        panic!("{r:?}")
    };
    assert_eq!(b64.decode(data).unwrap(), &png[5000..6000]);
    assert_eq!(note, "[/tmp/shot.png: bytes 5000..6000 of 10000, base64; next: offset=6000]");
    // The margin around the range is read, not returned.
    assert!(line.contains("\"offset\":904") && line.contains("\"length\":9192"), "{line}");
    // The last range says so.
    let shim = fake_copy_shim(d.path(), png.clone());
    let r = b.read_file(Parameters(read(Some(9000), None))).await.unwrap();
    shim.join().unwrap();
    let [data, note] = &blocks(&r)[..] else {
        panic!("{r:?}")
    };
    assert_eq!(b64.decode(data).unwrap(), &png[9000..]);
    assert!(note.ends_with("bytes 9000..10000 of 10000, base64; the end]"), "{note}");
    // A secret just past the range's end is seen, and the range withheld.
    let mut secret = png.clone();
    secret.splice(1010..1010, b"AKIAABCDEFGHIJKLMNOP".iter().copied());
    let shim = fake_copy_shim(d.path(), secret);
    let r = b.read_file(Parameters(read(Some(0), Some(1000)))).await.unwrap();
    shim.join().unwrap();
    let (shown, err) = text(&r);
    assert!(err && shown.contains("withheld") && !shown.contains("AKIA"), "{shown}");
    // Write: the decoded bytes go up as an upload of their size.
    let shim = fake_copy_shim(d.path(), Vec::new());
    let r = b
        .write_file(Parameters(WriteFileArgs {
            sandbox: "s1".into(),
            path: "/tmp/a.bin".into(),
            content: None,
            content_base64: Some(b64.encode(&png[..300])),
        }))
        .await
        .unwrap();
    let (line, got) = shim.join().unwrap();
    assert_eq!(text(&r), ("wrote 300 bytes to /tmp/a.bin".into(), false));
    assert!(line.contains("\"cmd\":\"upload\"") && line.contains("\"size\":300"), "{line}");
    assert_eq!(got, &png[..300]);
    // Both or neither content, bad base64, too much: clear errors.
    for (content, content_base64) in [
        (Some("x".to_string()), Some("eA==".to_string())),
        (None, None),
        (None, Some("!!".into())),
        (None, Some(b64.encode(vec![0u8; MAX_WRITE + 1]))),
    ] {
        let r = b
            .write_file(Parameters(WriteFileArgs {
                sandbox: "s1".into(),
                path: "/tmp/a.bin".into(),
                content,
                content_base64,
            }))
            .await
            .unwrap();
        assert!(text(&r).1, "{r:?}");
    }
}
