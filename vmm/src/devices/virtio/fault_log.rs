//! Warnings a guest can cause, logged so that a guest repeating one
//! cannot push the others out of the VMM's capped log.
//!
//! Each distinct message is logged the first time, then again when it
//! has been seen 10, 100, 1000... times, with the count. At most
//! [`MAX_KINDS`] distinct messages are remembered (a guest can vary the
//! numbers in a message); past that, messages are counted together and
//! logged at the same powers of ten. They are logged with the target
//! `guest` (`RUST_LOG=guest=error` hides them).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

/// Distinct messages remembered.
pub const MAX_KINDS: usize = 256;
/// Longest message kept (a guest-chosen value could make one long).
const MAX_MESSAGE: usize = 512;

#[derive(Default)]
struct Seen {
    counts: HashMap<u64, u64>,
    others: u64,
}

static SEEN: Mutex<Option<Seen>> = Mutex::new(None);

/// Log `args` as a warning about the guest, unless it is a repeat.
pub fn warn(args: std::fmt::Arguments<'_>) {
    let mut msg = args.to_string();
    if msg.len() > MAX_MESSAGE {
        msg.truncate(msg.floor_char_boundary(MAX_MESSAGE));
        msg.push('…');
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    msg.hash(&mut h);
    let key = h.finish();
    let said = {
        let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
        let seen = seen.get_or_insert_with(Seen::default);
        count(seen, key)
    };
    match said {
        Said::First => tracing::warn!(target: "guest", "{msg}"),
        Said::Repeat(n) => tracing::warn!(target: "guest", "{msg} (seen {n} times)"),
        Said::Others(n) => tracing::warn!(
            target: "guest",
            "{msg} ({n} guest faults of kinds past the first {MAX_KINDS})"
        ),
        Said::Nothing => tracing::debug!(target: "guest", "{msg}"),
    }
}

#[derive(Debug, PartialEq)]
enum Said {
    First,
    Repeat(u64),
    Others(u64),
    Nothing,
}

fn count(seen: &mut Seen, key: u64) -> Said {
    if let Some(n) = seen.counts.get_mut(&key) {
        *n = n.saturating_add(1);
        return if power_of_ten(*n) {
            Said::Repeat(*n)
        } else {
            Said::Nothing
        };
    }
    if seen.counts.len() < MAX_KINDS {
        seen.counts.insert(key, 1);
        return Said::First;
    }
    seen.others = seen.others.saturating_add(1);
    if seen.others == 1 || power_of_ten(seen.others) {
        Said::Others(seen.others)
    } else {
        Said::Nothing
    }
}

fn power_of_ten(mut n: u64) -> bool {
    if n < 10 {
        return false;
    }
    while n.is_multiple_of(10) {
        n /= 10;
    }
    n == 1
}

/// `guest_warn!("...", args)`: a warning the guest caused, through
/// [`warn`].
#[macro_export]
macro_rules! guest_warn {
    ($($arg:tt)*) => {
        $crate::devices::virtio::fault_log::warn(format_args!($($arg)*))
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeat_is_logged_at_powers_of_ten() {
        let mut s = Seen::default();
        let said: Vec<Said> = (0..1000).map(|_| count(&mut s, 7)).collect();
        assert_eq!(said[0], Said::First);
        let loud: Vec<(usize, &Said)> = said
            .iter()
            .enumerate()
            .filter(|(_, s)| **s != Said::Nothing)
            .collect();
        assert_eq!(
            loud,
            vec![
                (0, &Said::First),
                (9, &Said::Repeat(10)),
                (99, &Said::Repeat(100)),
                (999, &Said::Repeat(1000)),
            ]
        );
    }

    #[test]
    fn past_the_kinds_kept_messages_are_counted_together() {
        let mut s = Seen::default();
        for k in 0..MAX_KINDS as u64 {
            assert_eq!(count(&mut s, k), Said::First);
        }
        assert_eq!(count(&mut s, 1_000_000), Said::Others(1));
        assert_eq!(count(&mut s, 1_000_001), Said::Nothing);
        // One kept before the set filled still counts on its own.
        assert_eq!(count(&mut s, 3), Said::Nothing);
        for k in 2..10 {
            let said = count(&mut s, 2_000_000 + k);
            assert_eq!(said == Said::Others(10), k == 9, "{k}: {said:?}");
        }
        assert_eq!(s.counts.len(), MAX_KINDS);
    }

    #[test]
    fn a_long_message_is_cut() {
        warn(format_args!("{}", "é".repeat(4 * MAX_MESSAGE)));
    }
}
