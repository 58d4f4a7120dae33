//! `burrow exec ID --detach -- CMD` and `burrow exec ID --attach SESSION
//! [--from N] [--wait S]`: a command whose output the guest's agent keeps
//! (the last 1 MiB, stdout and stderr together) for a caller that reads it
//! by offset whenever it comes back, after a hibernation and wake or a
//! checkpoint and restore too. Nothing of a session is kept on the host.

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use burrow_vmm_api::sandbox_control::SandboxRequest;
use burrow_vmm_api::sandbox_tools::{
    AttachRequest, ExecRequest, SessionOutput, ToolReply, MAX_ATTACH_WAIT_SECS, SESSION_BUFFER,
};

use crate::tools::{Target, WAKE_ALLOWANCE};

/// Start `req` as a detached session; print its id.
pub fn detach(target: &Target, req: ExecRequest) -> Result<i32> {
    let ToolReply::Detach(s) = target.ask(&SandboxRequest::Detach(req), WAKE_ALLOWANCE)? else {
        bail!("the shim answered detach with another tool's result");
    };
    println!("{}", s.session);
    eprintln!(
        "burrow: session {} started (pid {}); read its output with: burrow exec {} --attach {}",
        s.session, s.pid, target.id, s.session
    );
    Ok(0)
}

/// Print session `session`'s output from `from`, following it until the
/// command ends (its status); with `wait`, only until all output there is
/// is printed and either some was or `wait` seconds passed (then 0, with a
/// note on where to read on).
pub fn attach(target: &Target, session: &str, mut from: u64, wait: Option<u64>) -> Result<i32> {
    let deadline = wait.map(|w| Instant::now() + Duration::from_secs(w));
    let mut stdout = std::io::stdout().lock();
    let mut printed = false;
    loop {
        let left = deadline.map_or(MAX_ATTACH_WAIT_SECS, |d| {
            d.saturating_duration_since(Instant::now())
                .as_secs()
                .min(MAX_ATTACH_WAIT_SECS)
        });
        let req = SandboxRequest::Attach(AttachRequest {
            session: session.into(),
            from,
            wait_secs: left,
            max_bytes: None,
            whole_lines: false,
        });
        let limit = Duration::from_secs(left) + WAKE_ALLOWANCE;
        let ToolReply::Attach(out) = target.ask(&req, limit)? else {
            bail!("the shim answered attach with another tool's result");
        };
        stdout.write_all(out.output.as_bytes())?;
        stdout.flush()?;
        printed |= out.next > out.from;
        for note in notes(&out) {
            eprintln!("burrow: {note}");
        }
        from = out.next;
        if let Some(status) = out.status() {
            return Ok(status);
        }
        let caught_up = out.next >= out.end;
        if caught_up && deadline.is_some_and(|d| printed || Instant::now() >= d) {
            eprintln!(
                "burrow: session {session} is running; read on with: burrow exec {} --attach {session} --from {from}",
                target.id
            );
            return Ok(0);
        }
    }
}

/// What a piece of session output says besides the output.
pub fn notes(out: &SessionOutput) -> Vec<String> {
    let mut notes = Vec::new();
    if out.dropped > 0 {
        notes.push(format!(
            "{} bytes of output before offset {} were dropped (a session keeps its last {} KiB)",
            out.dropped,
            out.from,
            SESSION_BUFFER / 1024
        ));
    }
    if out.done && out.timed_out {
        notes.push("killed at its --timeout: exit status 124".into());
    }
    notes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notes_say_what_was_dropped_and_a_timeout() {
        assert!(notes(&SessionOutput::default()).is_empty());
        let out = SessionOutput {
            from: 2_000_000,
            dropped: 1_500_000,
            done: true,
            timed_out: true,
            ..Default::default()
        };
        assert_eq!(
            notes(&out),
            [
                "1500000 bytes of output before offset 2000000 were dropped (a session keeps its last 1024 KiB)",
                "killed at its --timeout: exit status 124"
            ]
        );
    }
}
