//! Reading `ps` output from inside a guest.

/// `ps -o pid,comm[,...]` rows after its header: (pid, comm).
pub fn ps_rows(lines: &[&str]) -> Vec<(u32, String)> {
    let mut rows = lines
        .iter()
        .skip_while(|l| l.split_whitespace().take(2).collect::<Vec<_>>() != ["PID", "COMMAND"]);
    assert!(rows.next().is_some(), "no `ps` header in {lines:?}");
    rows.filter_map(|l| Some((ps_pid(l)?, l.split_whitespace().nth(1)?.to_string())))
        .collect()
}

/// The PID a `ps` row starts with.
pub fn ps_pid(line: &str) -> Option<u32> {
    line.split_whitespace().next()?.parse().ok()
}
