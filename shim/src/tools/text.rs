//! Shaping what the guest returns for the tools: output capped to its head
//! and tail, a file's lines paged, one exact replacement in a text.

/// A stream's output kept to its first and last `cap / 2` bytes, counting
/// what fell between.
#[derive(Debug)]
pub struct Capped {
    half: usize,
    head: Vec<u8>,
    tail: Vec<u8>,
    seen: u64,
}

impl Capped {
    pub fn new(cap: usize) -> Self {
        Self {
            half: (cap / 2).max(1),
            head: Vec::new(),
            tail: Vec::new(),
            seen: 0,
        }
    }

    pub fn push(&mut self, mut data: &[u8]) {
        self.seen = self.seen.saturating_add(data.len() as u64);
        let room = self.half.saturating_sub(self.head.len());
        if room > 0 {
            let (now, rest) = data.split_at(room.min(data.len()));
            self.head.extend_from_slice(now);
            data = rest;
        }
        self.tail.extend_from_slice(data);
        // Trim in batches: at most twice the half is held.
        if self.tail.len() > 2 * self.half {
            let drop = self.tail.len() - self.half;
            self.tail.drain(..drop);
        }
    }

    /// The text (a cut marked where it is) and how many bytes were cut.
    pub fn finish(mut self) -> (String, u64) {
        if self.tail.len() > self.half {
            let drop = self.tail.len() - self.half;
            self.tail.drain(..drop);
        }
        let kept = (self.head.len() + self.tail.len()) as u64;
        let cut = self.seen.saturating_sub(kept);
        let mut text = String::from_utf8_lossy(&self.head).into_owned();
        if cut > 0 {
            text.push_str(&format!("\n[... {cut} bytes cut ...]\n"));
        }
        text.push_str(&String::from_utf8_lossy(&self.tail));
        (text, cut)
    }
}

/// Lines `first..=last` of a file fed to it in chunks, at most `cap` bytes
/// of them, while it counts all the file's lines.
#[derive(Debug)]
pub struct LinePager {
    first: u64,
    last: u64,
    cap: usize,
    /// The line the next byte belongs to (1-based).
    line: u64,
    /// Bytes seen since the last newline.
    partial: bool,
    text: Vec<u8>,
    /// Where the line being added starts in `text`.
    line_start: usize,
    shown_first: u64,
    shown_last: u64,
    /// No more lines are added (the cap was reached).
    full: bool,
    line_cut: bool,
}

/// What a [`LinePager`] kept.
#[derive(Debug, PartialEq, Eq)]
pub struct Page {
    pub text: String,
    /// First and last line in `text` (0 when none).
    pub first: u64,
    pub last: u64,
    /// Lines in what was fed.
    pub lines: u64,
    pub line_cut: bool,
}

impl LinePager {
    pub fn new(first: u64, last: u64, cap: usize) -> Self {
        Self {
            first: first.max(1),
            last,
            cap,
            line: 1,
            partial: false,
            text: Vec::new(),
            line_start: 0,
            shown_first: 0,
            shown_last: 0,
            full: false,
            line_cut: false,
        }
    }

    pub fn feed(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            if self.line > self.last || self.full {
                // Past what is shown: only count.
                let nl = data.iter().filter(|b| **b == b'\n').count() as u64;
                self.line = self.line.saturating_add(nl);
                self.partial = data.last() != Some(&b'\n');
                return;
            }
            let (piece, rest) = match data.iter().position(|b| *b == b'\n') {
                Some(i) => data.split_at(i + 1),
                None => (data, &[][..]),
            };
            if self.line >= self.first {
                self.add(piece);
            }
            self.partial = true;
            if piece.last() == Some(&b'\n') {
                self.line = self.line.saturating_add(1);
                self.partial = false;
            }
            data = rest;
        }
    }

    /// Add part of line `self.line` (it is in range).
    fn add(&mut self, piece: &[u8]) {
        if self.shown_last != self.line {
            self.line_start = self.text.len();
            self.shown_last = self.line;
            if self.shown_first == 0 {
                self.shown_first = self.line;
            }
        }
        let room = self.cap.saturating_sub(self.text.len());
        if piece.len() <= room {
            self.text.extend_from_slice(piece);
            return;
        }
        self.full = true;
        if self.line_start > 0 {
            // This line does not fit after the others: the next page
            // starts with it.
            self.text.truncate(self.line_start);
            self.shown_last = self.line.saturating_sub(1);
        } else {
            // The first line alone is longer than the cap: its start.
            self.text
                .extend_from_slice(piece.get(..room).unwrap_or_default());
            self.line_cut = true;
        }
    }

    pub fn finish(self) -> Page {
        let lines = if self.partial {
            self.line
        } else {
            self.line.saturating_sub(1)
        };
        Page {
            text: String::from_utf8_lossy(&self.text).into_owned(),
            first: self.shown_first,
            last: self.shown_last,
            lines,
            line_cut: self.line_cut,
        }
    }
}

/// `text` with its one occurrence of `old` replaced by `new`, and the line
/// the replacement starts on; an error saying why when `old` is empty or
/// occurs zero or several times.
pub fn replace_unique(text: &str, old: &str, new: &str) -> Result<(String, u64), String> {
    if old.is_empty() {
        return Err("the text to replace is empty".into());
    }
    let mut at = text.match_indices(old).map(|(i, _)| i);
    let Some(i) = at.next() else {
        return Err("the text to replace was not found; nothing changed".into());
    };
    let more = at.count();
    if more > 0 {
        return Err(format!(
            "the text to replace occurs {} times, not once; give more context to make it unique; nothing changed",
            more + 1
        ));
    }
    let line = text
        .get(..i)
        .map_or(0, |b| b.bytes().filter(|c| *c == b'\n').count() as u64)
        + 1;
    Ok((text.replacen(old, new, 1), line))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn capped_keeps_head_and_tail_and_counts_the_cut() {
        let mut c = Capped::new(8);
        c.push(b"ab");
        assert_eq!(c.finish(), ("ab".to_string(), 0));
        let mut c = Capped::new(8);
        for chunk in [&b"0123"[..], b"456789", b"abcdef", b"XYZW"] {
            c.push(chunk);
        }
        let (text, cut) = c.finish();
        assert_eq!(cut, 20 - 8);
        assert_eq!(text, "0123\n[... 12 bytes cut ...]\nXYZW");
        // Exactly the cap: nothing cut.
        let mut c = Capped::new(8);
        c.push(b"01234567");
        assert_eq!(c.finish(), ("01234567".to_string(), 0));
    }

    fn page(data: &[&[u8]], first: u64, last: u64, cap: usize) -> Page {
        let mut p = LinePager::new(first, last, cap);
        for d in data {
            p.feed(d);
        }
        p.finish()
    }

    #[test]
    fn pager_selects_lines_across_chunks_and_counts_all() {
        let p = page(&[b"one\ntw", b"o\nthree\nfour"], 2, 3, 1000);
        assert_eq!(p.text, "two\nthree\n");
        assert_eq!((p.first, p.last, p.lines), (2, 3, 4));
        let p = page(&[b"a\nb\n"], 1, 500, 1000);
        assert_eq!((p.text.as_str(), p.last, p.lines), ("a\nb\n", 2, 2));
        let p = page(&[b""], 1, 500, 1000);
        assert_eq!((p.first, p.last, p.lines), (0, 0, 0));
        // Past the end: nothing shown, all counted.
        let p = page(&[b"a\nb\n"], 5, 9, 1000);
        assert_eq!((p.text.as_str(), p.first, p.lines), ("", 0, 2));
        let all: String = (1..=1200).map(|i| format!("line {i}\n")).collect();
        let p = page(&[all.as_bytes()], 501, 1000, 1 << 20);
        assert_eq!((p.first, p.last, p.lines), (501, 1000, 1200));
        assert!(p.text.starts_with("line 501\n") && p.text.ends_with("line 1000\n"));
    }

    #[test]
    fn pager_stops_at_the_cap_on_a_line_boundary_or_cuts_a_long_first_line() {
        // Lines that do not fit wait for the next page.
        let p = page(&[b"aaaa\nbbbb\ncccc\n"], 1, 3, 12);
        assert_eq!((p.text.as_str(), p.last, p.lines), ("aaaa\nbbbb\n", 2, 3));
        assert!(!p.line_cut);
        // A first line longer than the cap is cut.
        let p = page(&[b"0123", b"456789\nx\n"], 1, 3, 6);
        assert_eq!((p.text.as_str(), p.first, p.last), ("012345", 1, 1));
        assert!(p.line_cut);
        assert_eq!(p.lines, 2);
    }

    #[test]
    fn replace_unique_refuses_zero_or_several_matches() {
        assert_eq!(
            replace_unique("a\nfoo\nb", "foo", "bar").unwrap(),
            ("a\nbar\nb".to_string(), 2)
        );
        let e = replace_unique("x x", "x", "y").unwrap_err();
        assert!(
            e.contains("2 times") && e.contains("nothing changed"),
            "{e}"
        );
        let e = replace_unique("abc", "z", "y").unwrap_err();
        assert!(e.contains("not found"), "{e}");
        assert!(replace_unique("abc", "", "y").is_err());
    }
}
