//! The tools the control socket offers a platform (`burrow exec|read|
//! write|ls|edit`), on top of the [`Sandbox`] calls: what they need beyond
//! forwarding one call to the guest. The VM side (which container, the
//! file calls to its agent) is [`crate::vm::tools`].

pub mod session;
pub mod text;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;

use burrow_vmm_api::sandbox_tools::{ExecInput, ExecOutput, ExecRequest};

use crate::sandbox::{ExecConfig, ExitStatus, Result, Sandbox, SandboxError, Stream};
use text::Capped;

/// How long a killed command may take to die.
const KILL_GRACE: Duration = Duration::from_secs(30);
/// How long output may take to reach its end once the command exited.
const OUTPUT_GRACE: Duration = Duration::from_secs(5);

/// The OCI process a tool's `exec` runs: the container's own `process`
/// (user, environment, capabilities) with the request's arguments, working
/// directory and extra environment, on a terminal only if it asks for one.
pub fn exec_process(
    container_process: Option<&serde_json::Value>,
    req: &ExecRequest,
) -> Result<serde_json::Value> {
    if req.args.is_empty() {
        return Err(SandboxError::InvalidArgument("no command to run".into()));
    }
    let mut p = match container_process {
        Some(serde_json::Value::Object(o)) => o.clone(),
        _ => serde_json::Map::new(),
    };
    p.insert("args".into(), req.args.clone().into());
    p.insert("terminal".into(), req.tty.into());
    p.remove("consoleSize");
    if let (true, Some((rows, cols))) = (req.tty, req.tty_size) {
        p.insert(
            "consoleSize".into(),
            serde_json::json!({"height": rows, "width": cols}),
        );
    }
    if let Some(cwd) = &req.cwd {
        if !cwd.starts_with('/') {
            return Err(SandboxError::InvalidArgument(format!(
                "the working directory {cwd:?} is not absolute"
            )));
        }
        p.insert("cwd".into(), cwd.clone().into());
    } else if !p.contains_key("cwd") {
        p.insert("cwd".into(), "/".into());
    }
    let mut env: Vec<String> = p
        .get("env")
        .and_then(|e| e.as_array())
        .map(|a| {
            a.iter()
                .filter_map(|v| v.as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default();
    for kv in &req.env {
        let key = match kv.split_once('=') {
            Some((k, _)) if !k.is_empty() => k,
            _ => {
                return Err(SandboxError::InvalidArgument(format!(
                    "environment entry {kv:?} is not KEY=VALUE"
                )))
            }
        };
        env.retain(|e| e.split_once('=').map_or(e.as_str(), |(k, _)| k) != key);
        env.push(kv.clone());
    }
    p.insert("env".into(), env.into());
    Ok(serde_json::Value::Object(p))
}

/// Where a tool exec's output goes: kept (capped), or passed on as it
/// comes to a caller that streams it.
#[derive(Clone)]
pub enum Sink {
    /// Each stream capped to this many bytes (its head and tail).
    Keep(usize),
    /// Each piece as it is read, in order; a bounded channel, so a slow
    /// reader slows the command's output (its pipe fills), and memory stays
    /// bounded. The command is killed when the receiver goes.
    Stream(mpsc::Sender<(Stream, Vec<u8>)>),
}

/// Run `process` as exec `exec_id` in container `id` of `sb`, collect its
/// output (each stream capped to `cap` bytes, its head and tail), kill it
/// at `timeout`, and forget it.
pub async fn run_exec<S: Sandbox + ?Sized>(
    sb: Arc<S>,
    id: &str,
    exec_id: &str,
    process: serde_json::Value,
    timeout: Duration,
    cap: usize,
) -> Result<ExecOutput> {
    run_exec_to(sb, id, exec_id, process, timeout, Sink::Keep(cap), None).await
}

/// [`run_exec`] with the output going to `sink`; with [`Sink::Stream`]
/// the result carries no output. With `input`, the command gets a stdin
/// (on its terminal, if it has one) fed from it ([`feed`]).
pub async fn run_exec_to<S: Sandbox + ?Sized>(
    sb: Arc<S>,
    id: &str,
    exec_id: &str,
    process: serde_json::Value,
    timeout: Duration,
    sink: Sink,
    input: Option<mpsc::Receiver<ExecInput>>,
) -> Result<ExecOutput> {
    let tty = process.get("terminal").and_then(|t| t.as_bool()) == Some(true);
    let cfg = ExecConfig {
        process,
        stdin: input.is_some(),
    };
    sb.exec_process(id, exec_id, &cfg).await?;
    let feeder = input.map(|rx| {
        tokio::spawn(feed(
            sb.clone(),
            id.to_string(),
            exec_id.to_string(),
            tty,
            rx,
        ))
    });
    let cap = match &sink {
        Sink::Keep(cap) => *cap,
        Sink::Stream(_) => 0,
    };
    let streamed = match &sink {
        Sink::Stream(tx) => Some(tx.clone()),
        Sink::Keep(_) => None,
    };
    let out = Arc::new(Mutex::new(Capped::new(cap)));
    let err = Arc::new(Mutex::new(Capped::new(cap)));
    let drains = [(Stream::Stdout, &out), (Stream::Stderr, &err)].map(|(stream, buf)| {
        tokio::spawn(drain(
            sb.clone(),
            id.to_string(),
            exec_id.to_string(),
            stream,
            buf.clone(),
            streamed.clone(),
        ))
    });
    drop(streamed);
    // A streaming caller that went away: the command goes too.
    let gone = async {
        match &sink {
            Sink::Stream(tx) => tx.closed().await,
            Sink::Keep(_) => std::future::pending().await,
        }
    };
    let mut timed_out = false;
    let waited = tokio::select! {
        st = tokio::time::timeout(timeout, sb.wait(id, exec_id)) => st,
        () = gone => {
            tracing::info!("{id}/{exec_id}: the caller went away: killing the command");
            let _ = sb.signal(id, exec_id, libc::SIGKILL as u32, false).await;
            Ok(tokio::time::timeout(KILL_GRACE, sb.wait(id, exec_id))
                .await
                .unwrap_or_else(|_| {
                    Err(SandboxError::Timeout("the command did not die when killed".into()))
                }))
        }
    };
    drop(sink);
    if let Some(f) = feeder {
        f.abort();
    }
    let status = match waited {
        Ok(st) => st,
        Err(_) => {
            timed_out = true;
            let killed = sb.signal(id, exec_id, libc::SIGKILL as u32, false).await;
            match tokio::time::timeout(KILL_GRACE, sb.wait(id, exec_id)).await {
                Ok(st) => st,
                Err(_) => Err(killed.err().unwrap_or_else(|| {
                    SandboxError::Timeout("the command did not die when killed".into())
                })),
            }
        }
    };
    let aborts = drains.each_ref().map(|d| d.abort_handle());
    let complete = tokio::time::timeout(OUTPUT_GRACE, async {
        let mut all = true;
        for d in drains {
            all &= matches!(d.await, Ok(Ok(())));
        }
        all
    })
    .await
    .unwrap_or(false);
    for a in aborts {
        a.abort();
    }
    if status.is_ok() {
        if let Err(e) = sb.delete_process(id, exec_id).await {
            tracing::warn!("{id}/{exec_id}: forgetting a tool's exec: {e}");
        }
    }
    let status = status?;
    let take = |b: Arc<Mutex<Capped>>| {
        std::mem::replace(
            &mut *b.lock().unwrap_or_else(|p| p.into_inner()),
            Capped::new(0),
        )
        .finish()
    };
    let (stdout, stdout_cut) = take(out);
    let (stderr, stderr_cut) = take(err);
    let (exit_code, signal) = match status {
        ExitStatus::Code(c) => (Some(c), None),
        ExitStatus::Signal(s) => (None, Some(s)),
    };
    Ok(ExecOutput {
        stdout,
        stderr,
        stdout_cut,
        stderr_cut,
        exit_code,
        signal,
        timed_out,
        output_open: !complete,
    })
}

/// Feed an interactive command its caller's `input` until the command
/// ends (the task is aborted then): data to its stdin, whole, waiting
/// while the guest's buffer is full (so a flood waits in the bounded
/// channel and the caller's socket, not in memory); resizes to its
/// terminal; the end of input as the terminal's EOF character on a
/// terminal (after a partial line twice: the first ends the line), else by
/// closing its stdin. Once its stdin is gone, later data is dropped.
async fn feed<S: Sandbox + ?Sized>(
    sb: Arc<S>,
    id: String,
    exec_id: String,
    tty: bool,
    mut input: mpsc::Receiver<ExecInput>,
) {
    let mut open = true;
    let mut line_start = true;
    while let Some(i) = input.recv().await {
        let to_stdin = !matches!(i, ExecInput::Resize { .. });
        let eof = matches!(i, ExecInput::Eof);
        let r = match i {
            ExecInput::Data { data } if open && !data.is_empty() => {
                line_start = matches!(data.last(), Some(b'\n' | b'\r'));
                crate::stdio::forward(&*sb, &id, &exec_id, &data).await
            }
            ExecInput::Resize { rows, cols } if tty => {
                sb.resize_pty(&id, &exec_id, rows.into(), cols.into())
                    .await
            }
            ExecInput::Eof if open && tty => {
                let eof: &[u8] = if line_start { b"\x04" } else { b"\x04\x04" };
                crate::stdio::forward(&*sb, &id, &exec_id, eof).await
            }
            ExecInput::Eof if open => sb.close_stdin(&id, &exec_id).await,
            _ => Ok(()),
        };
        match r {
            Err(e) if to_stdin => {
                tracing::debug!("{id}/{exec_id}: stdin: {e}; dropping further input");
                open = false;
            }
            Err(e) => tracing::debug!("{id}/{exec_id}: resize: {e}"),
            Ok(()) => open &= !eof,
        }
    }
}

/// Read one output stream of a process into `buf` (or pass it on to `tx`)
/// until its end.
async fn drain<S: Sandbox + ?Sized>(
    sb: Arc<S>,
    id: String,
    exec_id: String,
    stream: Stream,
    buf: Arc<Mutex<Capped>>,
    tx: Option<mpsc::Sender<(Stream, Vec<u8>)>>,
) -> Result<()> {
    loop {
        let chunk = sb.read_output(&id, &exec_id, stream).await?;
        match &tx {
            Some(tx) if !chunk.data.is_empty() => {
                if tx.send((stream, chunk.data)).await.is_err() {
                    return Err(SandboxError::Unavailable("the caller went away".into()));
                }
            }
            Some(_) => {}
            None => buf
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(&chunk.data),
        }
        if chunk.eof {
            return Ok(());
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::fake::FakeSandbox;
    use crate::sandbox::ContainerConfig;
    use burrow_vmm_api::sandbox_tools::MAX_EXEC_OUTPUT;

    fn req(args: &[&str]) -> ExecRequest {
        ExecRequest {
            args: args.iter().map(|s| s.to_string()).collect(),
            cwd: None,
            env: vec![],
            timeout_secs: 1,
            max_output: None,
            ..Default::default()
        }
    }

    #[test]
    fn the_process_is_the_containers_with_the_requests_changes() {
        let base = serde_json::json!({
            "args": ["sleep", "1000"], "cwd": "/app", "terminal": true,
            "user": {"uid": 1000, "gid": 1000}, "env": ["PATH=/bin", "A=old"],
        });
        let mut r = req(&["sh", "-c", "true"]);
        r.env = vec!["A=new".into(), "B=x=y".into()];
        let p = exec_process(Some(&base), &r).unwrap();
        assert_eq!(p["args"], serde_json::json!(["sh", "-c", "true"]));
        assert_eq!(p["cwd"], "/app");
        assert_eq!(p["terminal"], false);
        assert_eq!(p["user"]["uid"], 1000);
        assert_eq!(p["env"], serde_json::json!(["PATH=/bin", "A=new", "B=x=y"]));
        r.cwd = Some("/tmp".into());
        assert_eq!(exec_process(Some(&base), &r).unwrap()["cwd"], "/tmp");
        assert_eq!(exec_process(None, &req(&["ls"])).unwrap()["cwd"], "/");
        r.cwd = Some("tmp".into());
        assert!(exec_process(Some(&base), &r).is_err());
        assert!(exec_process(Some(&base), &req(&[])).is_err());
        let mut bad = req(&["ls"]);
        bad.env = vec!["=x".into()];
        assert!(exec_process(None, &bad).is_err());
        bad.env = vec!["NOEQ".into()];
        assert!(exec_process(None, &bad).is_err());
    }

    async fn fake() -> Arc<FakeSandbox> {
        let sb = Arc::new(FakeSandbox::default());
        sb.create_container(&ContainerConfig {
            id: "c1".into(),
            bundle: "/b".into(),
            spec: serde_json::json!({"process": {"args": ["sleep"]}}),
            rootfs: vec![],
            stdin: false,
        })
        .await
        .unwrap();
        sb
    }

    /// `args` run as exec `exec_id` in the fake's container c1.
    async fn run(
        sb: &Arc<FakeSandbox>,
        exec_id: &str,
        args: &[&str],
        limit: Duration,
    ) -> ExecOutput {
        let p = exec_process(None, &req(args)).unwrap();
        run_exec(sb.clone(), "c1", exec_id, p, limit, MAX_EXEC_OUTPUT)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn exec_returns_output_and_status_and_forgets_the_process() {
        let sb = fake().await;
        let out = run(&sb, "t1", &["echo", "hi", "there"], Duration::from_secs(5)).await;
        assert_eq!(out.stdout, "hi there\n");
        assert_eq!(
            (out.status(), out.timed_out, out.output_open),
            (0, false, false)
        );
        assert!(
            sb.calls().contains(&"delete c1/t1".to_string()),
            "{:?}",
            sb.calls()
        );
        let out = run(&sb, "t2", &["echo", "err", "oops"], Duration::from_secs(5)).await;
        assert_eq!((out.stdout.as_str(), out.stderr.as_str()), ("", "oops\n"));
        let out = run(&sb, "t3", &["exit", "3"], Duration::from_secs(5)).await;
        assert_eq!(out.status(), 3);
    }

    #[test]
    fn a_terminal_only_when_asked_sized_as_asked() {
        let mut r = req(&["tty"]);
        assert_eq!(exec_process(None, &r).unwrap()["terminal"], false);
        r.tty = true;
        let p = exec_process(None, &r).unwrap();
        assert_eq!(p["terminal"], true);
        assert!(p.get("consoleSize").is_none());
        r.tty_size = Some((40, 120));
        let p = exec_process(None, &r).unwrap();
        assert_eq!(
            p["consoleSize"],
            serde_json::json!({"height": 40, "width": 120})
        );
    }

    #[tokio::test]
    async fn a_streamed_exec_passes_its_output_on_and_returns_none() {
        let sb = fake().await;
        let (tx, mut rx) = mpsc::channel(8);
        let p = exec_process(None, &req(&["echo", "hi", "there"])).unwrap();
        let out = run_exec_to(
            sb.clone(),
            "c1",
            "s1",
            p,
            Duration::from_secs(5),
            Sink::Stream(tx),
            None,
        )
        .await
        .unwrap();
        assert_eq!((out.stdout.as_str(), out.status()), ("", 0));
        let mut got = Vec::new();
        while let Ok((stream, data)) = rx.try_recv() {
            assert_eq!(stream, Stream::Stdout);
            got.extend(data);
        }
        assert_eq!(got, b"hi there\n");
        // A caller that went away: the command is killed.
        let (tx, rx) = mpsc::channel(8);
        drop(rx);
        let p = exec_process(None, &req(&["sleep"])).unwrap();
        let out = run_exec_to(
            sb.clone(),
            "c1",
            "s2",
            p,
            Duration::from_secs(30),
            Sink::Stream(tx),
            None,
        )
        .await
        .unwrap();
        assert_eq!(out.signal, Some(9), "{out:?}");
        assert!(!out.timed_out);
    }

    #[tokio::test]
    async fn a_command_past_its_timeout_is_killed() {
        let sb = fake().await;
        let out = run(&sb, "t1", &["sleep"], Duration::from_millis(200)).await;
        assert!(out.timed_out, "{out:?}");
        assert_eq!(out.signal, Some(9));
        assert!(
            sb.calls().contains(&"signal c1/t1".to_string()),
            "{:?}",
            sb.calls()
        );
    }

    /// Run `r` in the fake's container c1 as exec `exec_id`, streaming,
    /// with `input` sent to it: its result and its stdout.
    async fn run_fed(
        sb: &Arc<FakeSandbox>,
        exec_id: &str,
        r: &ExecRequest,
        input: Vec<ExecInput>,
        limit: Duration,
    ) -> (ExecOutput, Vec<u8>) {
        let (tx, mut rx) = mpsc::channel(8);
        let (in_tx, in_rx) = mpsc::channel(2);
        tokio::spawn(async move {
            for i in input {
                in_tx.send(i).await.unwrap();
            }
            // The caller stays connected until the command ends.
            in_tx.closed().await;
        });
        let p = exec_process(None, r).unwrap();
        let run = run_exec_to(sb.clone(), "c1", exec_id, p, limit, Sink::Stream(tx), Some(in_rx));
        let collect = async {
            let mut got = Vec::new();
            while let Some((_, data)) = rx.recv().await {
                got.extend(data);
            }
            got
        };
        let (out, got) = tokio::join!(run, collect);
        (out.unwrap(), got)
    }

    #[tokio::test]
    async fn an_interactive_exec_gets_its_input_whole_then_its_end() {
        let sb = fake().await;
        let data = |d: &[u8]| ExecInput::Data { data: d.to_vec() };
        // A pipe: the data in order (the fake takes 3 bytes a call), a
        // resize ignored (no terminal), the end closes stdin: cat exits 0.
        let input = vec![
            data(b"hello "),
            ExecInput::Resize { rows: 40, cols: 120 },
            data(b"world\n"),
            ExecInput::Eof,
            data(b"dropped"),
        ];
        let (out, got) = run_fed(&sb, "i1", &req(&["cat"]), input, Duration::from_secs(5)).await;
        assert_eq!((out.status(), out.timed_out), (0, false), "{out:?}");
        assert_eq!(got, b"hello world\n");
        let calls = sb.calls();
        assert!(calls.contains(&"close_stdin c1/i1".to_string()), "{calls:?}");
        assert!(!calls.iter().any(|c| c.starts_with("resize")), "{calls:?}");
        // A terminal: resizes reach it, and the end of input is ^D (twice
        // after a partial line); the command decides what that means.
        let mut r = req(&["cat"]);
        r.tty = true;
        let input = vec![
            data(b"ab"),
            ExecInput::Resize { rows: 40, cols: 120 },
            ExecInput::Eof,
        ];
        let (out, got) = run_fed(&sb, "i2", &r, input, Duration::from_millis(500)).await;
        assert!(out.timed_out, "cat on a terminal ignores ^D here: {out:?}");
        assert_eq!(got, b"ab\x04\x04");
        let calls = sb.calls();
        assert!(calls.contains(&"resize 40x120 c1/i2".to_string()), "{calls:?}");
        assert!(!calls.contains(&"close_stdin c1/i2".to_string()), "{calls:?}");
    }
}
