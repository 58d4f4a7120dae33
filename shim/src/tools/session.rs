//! Detached sessions as the control socket answers them: the agent's
//! `ReadSession` reply, checked and turned into [`SessionOutput`] text.

use burrow_protocol::agent::ReadSessionResponse;
use burrow_vmm_api::sandbox_tools::SessionOutput;

use crate::sandbox::{Result, SandboxError};

/// The reply's output as text, ending on a whole character: an incomplete
/// UTF-8 sequence at the end of a running session's output is left for
/// the next read (its offset says where); other invalid bytes become
/// U+FFFD. `from` is where the caller asked to start; with `whole_lines`
/// a running session's piece ends after its last newline (in a piece of
/// `max` bytes without one, after its last space or tab) when it has one.
pub fn session_output(
    from: u64,
    r: ReadSessionResponse,
    max: usize,
    whole_lines: bool,
) -> Result<SessionOutput> {
    let end_of_data = r.start.saturating_add(r.data.len() as u64);
    if from > r.end && r.data.is_empty() {
        return Err(SandboxError::OutOfRange(format!(
            "offset {from} is past the end of the session's output ({} bytes so far)",
            r.end
        )));
    }
    if r.start < from || end_of_data > r.end {
        return Err(SandboxError::Internal(format!(
            "the agent answered session output at {}..{end_of_data} of {} for a read from {from}",
            r.start, r.end
        )));
    }
    let mut data = r.data;
    if whole_lines && !r.done {
        let full = data.len() >= max;
        let cut = data.iter().rposition(|&b| b == b'\n').or_else(|| {
            full.then(|| data.iter().rposition(|&b| b == b' ' || b == b'\t'))
                .flatten()
        });
        if let Some(at) = cut {
            data.truncate(at + 1);
        }
    }
    if !r.done {
        if let Err(e) = std::str::from_utf8(&data) {
            if e.error_len().is_none() {
                data.truncate(e.valid_up_to());
            }
        }
    }
    let next = r.start + data.len() as u64;
    let done = r.done && next >= r.end;
    Ok(SessionOutput {
        output: String::from_utf8_lossy(&data).into_owned(),
        from: r.start,
        next,
        end: r.end,
        dropped: r.dropped,
        done,
        exit_code: (done && r.signal == 0).then_some(r.exit_code),
        signal: (done && r.signal != 0).then_some(r.signal),
        timed_out: r.timed_out,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn reply(start: u64, data: &[u8], end: u64, done: bool) -> ReadSessionResponse {
        ReadSessionResponse {
            data: data.to_vec(),
            start,
            end,
            done,
            exit_code: 3,
            ..Default::default()
        }
    }

    #[test]
    fn a_split_character_waits_for_the_next_read() {
        let euro = "€".as_bytes();
        let out = session_output(
            10,
            reply(10, &[b'a', euro[0], euro[1]], 20, false),
            64,
            false,
        )
        .unwrap();
        assert_eq!((out.output.as_str(), out.next, out.done), ("a", 11, false));
        assert_eq!(out.status(), None);
        let out = session_output(11, reply(11, euro, 14, true), 64, false).unwrap();
        assert_eq!(
            (out.output.as_str(), out.next, out.status()),
            ("€", 14, Some(3))
        );
        // Invalid in the middle, or at the very end of a finished one: U+FFFD.
        let out = session_output(0, reply(0, &[0xff, b'x', euro[0]], 3, true), 64, false).unwrap();
        assert_eq!(out.output, "\u{fffd}x\u{fffd}");
        assert!(out.done);
    }

    #[test]
    fn whole_lines_keep_a_secret_in_one_piece() {
        let r = || reply(0, b"ok\nkey AKIA1234", 100, false);
        let out = session_output(0, r(), 64, true).unwrap();
        assert_eq!((out.output.as_str(), out.next), ("ok\n", 3));
        // Without a newline: a full piece ends at a space, a short one as it is.
        let r = || reply(3, b"key AKIA1234", 100, false);
        assert_eq!(session_output(3, r(), 12, true).unwrap().output, "key ");
        assert_eq!(
            session_output(3, r(), 64, true).unwrap().output,
            "key AKIA1234"
        );
        // Done: all of it.
        let out = session_output(0, reply(0, b"a\nb", 3, true), 64, true).unwrap();
        assert_eq!((out.output.as_str(), out.done), ("a\nb", true));
        assert!(!session_output(0, r(), 64, false).unwrap().output.is_empty());
    }

    #[test]
    fn a_reply_out_of_bounds_is_refused() {
        assert!(session_output(5, reply(4, b"x", 10, false), 64, false).is_err());
        assert!(session_output(0, reply(0, b"xyz", 2, false), 64, false).is_err());
        let past = session_output(50, reply(20, b"", 20, false), 64, false).unwrap_err();
        assert!(past.to_string().contains("past the end"), "{past}");
        // Dropped bytes: it starts later than asked.
        let mut r = reply(100, b"x", 101, false);
        r.dropped = 100;
        let out = session_output(0, r, 64, false).unwrap();
        assert_eq!((out.from, out.dropped, out.next), (100, 100, 101));
    }
}
