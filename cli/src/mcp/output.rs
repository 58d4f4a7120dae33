//! Command output shaped for a model: a few KiB inline (its head and tail,
//! the cut said as "[truncated: showing N of M bytes ...]"), the whole of
//! it (already redacted) kept on the host in a bounded store, and pages of
//! it by the reference the model passes back to `read_output`.

use std::collections::VecDeque;

/// Bytes of output shown inline in one tool result, all streams together.
pub const INLINE: usize = 8 * 1024;
/// Default and largest page `read_output` returns.
pub const PAGE: usize = 8 * 1024;
pub const MAX_PAGE: usize = 32 * 1024;
/// What the store keeps: at most this many outputs and bytes; the oldest
/// go first.
const MAX_KEPT: usize = 64;
const MAX_KEPT_BYTES: usize = 64 << 20;

/// `s` cut at most at `at`, on a character boundary at or before it.
fn floor(s: &str, at: usize) -> usize {
    s.floor_char_boundary(at)
}

/// `text` (stream `name` of output `reference`) within `budget` bytes: all
/// of it, or its head and tail around a line saying what is left out and
/// how to page through it.
pub fn inline(text: &str, budget: usize, name: &str, reference: &str) -> String {
    if text.len() <= budget {
        return text.to_string();
    }
    let head = floor(text, budget / 4);
    let tail = text.ceil_char_boundary(text.len() - (budget - head));
    let shown = head + (text.len() - tail);
    format!(
        "{}\n[truncated: showing {shown} of {} bytes of {name} (the first {head} and the last {}); \
         the rest: read_output ref=\"{reference}\" stream=\"{name}\" offset={head}]\n{}",
        &text[..head],
        text.len(),
        text.len() - tail,
        &text[tail..]
    )
}

/// Per-stream budgets for stdout and stderr of `lens` bytes within
/// [`INLINE`]: each gets its length if both fit, else stderr at most a
/// quarter and stdout the rest.
pub fn budgets(stdout: usize, stderr: usize) -> (usize, usize) {
    if stdout + stderr <= INLINE {
        return (stdout, stderr);
    }
    let err = stderr.min(INLINE / 4).max(INLINE.saturating_sub(stdout));
    let err = err.min(stderr);
    (INLINE - err, err)
}

/// One kept output.
struct Kept {
    reference: String,
    stdout: String,
    stderr: String,
}

/// Outputs kept on the host for paging, bounded in count and bytes.
#[derive(Default)]
pub struct Store {
    next: u64,
    kept: VecDeque<Kept>,
    bytes: usize,
}

/// One page of a kept output.
#[derive(Debug, PartialEq, Eq)]
pub struct Page {
    pub text: String,
    pub offset: usize,
    pub end: usize,
    pub total: usize,
}

impl Page {
    /// The line after the page that says where it is and what is next.
    pub fn note(&self, reference: &str, stream: &str) -> String {
        if self.end >= self.total {
            format!(
                "[{reference} {stream}: bytes {}-{} of {}; the end]",
                self.offset, self.end, self.total
            )
        } else {
            format!(
                "[truncated: showing bytes {}-{} of {} of {stream}; next: read_output ref=\"{reference}\" stream=\"{stream}\" offset={}]",
                self.offset, self.end, self.total, self.end
            )
        }
    }
}

impl Store {
    /// Keep an output; its reference.
    pub fn keep(&mut self, stdout: String, stderr: String) -> String {
        self.next += 1;
        let reference = format!("out-{}", self.next);
        self.bytes += stdout.len() + stderr.len();
        self.kept.push_back(Kept {
            reference: reference.clone(),
            stdout,
            stderr,
        });
        while self.kept.len() > MAX_KEPT || (self.bytes > MAX_KEPT_BYTES && self.kept.len() > 1) {
            if let Some(old) = self.kept.pop_front() {
                self.bytes -= old.stdout.len() + old.stderr.len();
            }
        }
        reference
    }

    /// The page of `stream` ("stdout"/"stderr") of output `reference` from
    /// `offset`, at most `len` bytes (at most [`MAX_PAGE`]).
    pub fn page(
        &self,
        reference: &str,
        stream: &str,
        offset: usize,
        len: usize,
    ) -> Result<Page, String> {
        let kept = self
            .kept
            .iter()
            .find(|k| k.reference == reference)
            .ok_or_else(|| {
                format!(
                    "no output {reference:?} is kept (only the last {MAX_KEPT} are, up to {} MiB)",
                    MAX_KEPT_BYTES >> 20
                )
            })?;
        let text = match stream {
            // A page's text is kept as its "stdout".
            "stdout" | "text" => &kept.stdout,
            "stderr" => &kept.stderr,
            other => return Err(format!("stream {other:?} is not stdout, stderr or text")),
        };
        if offset > text.len() {
            return Err(format!(
                "offset {offset} is past the end of {stream} ({} bytes)",
                text.len()
            ));
        }
        let start = floor(text, offset);
        let end = floor(text, start + len.clamp(1, MAX_PAGE));
        let end = if end == start && start < text.len() {
            // One character longer than the page: take it whole.
            text[start..]
                .chars()
                .next()
                .map_or(start, |c| start + c.len_utf8())
        } else {
            end
        };
        Ok(Page {
            text: text[start..end].to_string(),
            offset: start,
            end,
            total: text.len(),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn short_output_is_whole_and_long_output_says_what_is_left_out() {
        assert_eq!(inline("hi\n", 100, "stdout", "out-1"), "hi\n");
        let long: String = (0..100_000)
            .map(|i| char::from(b'a' + (i % 26) as u8))
            .collect();
        let shown = inline(&long, INLINE, "stdout", "out-7");
        assert!(shown.len() < INLINE + 300, "{}", shown.len());
        assert!(shown.starts_with(&long[..2048]));
        assert!(shown.ends_with(&long[long.len() - 6144..]));
        assert!(
            shown.contains("[truncated: showing 8192 of 100000 bytes of stdout (the first 2048 and the last 6144); the rest: read_output ref=\"out-7\" stream=\"stdout\" offset=2048]"),
            "{}",
            &shown[2040..2300]
        );
        // Never a cut inside a character.
        let wide = "é".repeat(10_000);
        let shown = inline(&wide, 1001, "stderr", "r");
        assert!(
            shown.contains("[truncated: showing 1000 of 20000"),
            "{shown}"
        );
    }

    #[test]
    fn budgets_share_the_inline_room() {
        assert_eq!(budgets(10, 20), (10, 20));
        assert_eq!(budgets(100_000, 10), (INLINE - 10, 10));
        assert_eq!(budgets(10, 100_000), (10, INLINE - 10));
        assert_eq!(budgets(100_000, 100_000), (INLINE - INLINE / 4, INLINE / 4));
    }

    #[test]
    fn pages_walk_the_whole_output_and_old_outputs_go() {
        let mut s = Store::default();
        let out: String = (0..1_000_000)
            .map(|i| char::from(b'0' + (i % 10) as u8))
            .collect();
        let r = s.keep(out.clone(), "err".into());
        let (mut offset, mut all) = (0, String::new());
        loop {
            let p = s.page(&r, "stdout", offset, MAX_PAGE).unwrap();
            all.push_str(&p.text);
            if p.end == p.total {
                assert!(p.note(&r, "stdout").ends_with("the end]"));
                break;
            }
            assert!(p.note(&r, "stdout").contains(&format!("offset={}]", p.end)));
            offset = p.end;
        }
        assert_eq!(all, out);
        assert_eq!(s.page(&r, "stderr", 1, 100).unwrap().text, "rr");
        assert!(s.page(&r, "stdin", 0, 1).is_err());
        assert!(s.page(&r, "stdout", 2_000_000, 1).is_err());
        assert!(s
            .page("out-99", "stdout", 0, 1)
            .unwrap_err()
            .contains("no output"));
        // Pages are cut on character boundaries.
        let r2 = s.keep("ééé".into(), String::new());
        let p = s.page(&r2, "stdout", 1, 3).unwrap();
        assert_eq!((p.text.as_str(), p.offset, p.end), ("é", 0, 2));
        // Only MAX_KEPT are kept.
        for _ in 0..MAX_KEPT {
            s.keep("x".into(), String::new());
        }
        assert!(s.page(&r, "stdout", 0, 1).is_err());
        assert_eq!(s.kept.len(), MAX_KEPT);
    }
}
