//! DNS names in the egress allow-list: resolved on the host (the shim's
//! own resolver, never the guest's), when the sandbox's NIC is wired and
//! then every [`REFRESH`] by a task that reloads the namespace's table
//! when the answers change. A sandbox without names starts no task.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Duration;

use super::egress::{self, Egress, Resolved};

/// How often the names are resolved again.
pub const REFRESH: Duration = Duration::from_secs(60);
/// How long one name may take to resolve.
const LOOKUP_TIMEOUT: Duration = Duration::from_secs(5);
/// Most addresses kept per name.
const MAX_ADDRS: usize = 16;

/// Resolve `egress`'s names. A name that does not resolve keeps what
/// `previous` had for it (a passing resolver failure does not cut a
/// sandbox off), else it stands for nothing.
pub async fn resolve(egress: &Egress, previous: &Resolved) -> Resolved {
    let mut out = Resolved::new();
    for name in egress.names() {
        let lookup =
            tokio::time::timeout(LOOKUP_TIMEOUT, tokio::net::lookup_host((name.as_str(), 0)));
        let addrs: Option<BTreeSet<_>> = match lookup.await {
            Ok(Ok(it)) => Some(it.map(|a| a.ip()).take(MAX_ADDRS).collect()),
            Ok(Err(e)) => {
                tracing::warn!("egress allow-list: resolving {name}: {e}");
                None
            }
            Err(_) => {
                tracing::warn!(
                    "egress allow-list: resolving {name}: no answer in {LOOKUP_TIMEOUT:?}"
                );
                None
            }
        };
        let addrs = addrs
            .filter(|a| !a.is_empty())
            .or_else(|| previous.get(&name).cloned())
            .unwrap_or_default();
        out.insert(name, addrs);
    }
    out
}

/// The task that keeps the names current; it ends when dropped.
pub struct Refresher(tokio::task::JoinHandle<()>);

impl Drop for Refresher {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Start re-resolving `egress`'s names every [`REFRESH`], reloading the
/// table in `netns` (tap joined to `cni_if`) when they change; `None` when
/// there are no names.
pub fn refresher(
    netns: PathBuf,
    egress: Egress,
    cni_if: String,
    mut current: Resolved,
    node: egress::Node,
) -> Option<Refresher> {
    if egress.names().is_empty() {
        return None;
    }
    Some(Refresher(tokio::spawn(async move {
        loop {
            tokio::time::sleep(REFRESH).await;
            let now = resolve(&egress, &current).await;
            if now == current {
                continue;
            }
            // One nft transaction: the chains are flushed and refilled
            // together, and the flows recorded stay (connections to
            // what a name resolved to before go on).
            let script = egress.ruleset(super::net::TAP_NAME, &cni_if, &now, &node);
            let r = super::net::in_netns(&netns, move |_| {
                Box::pin(async move { egress::nft(&script) })
            })
            .await;
            match r {
                Ok(()) => {
                    tracing::info!("egress allow-list: names now resolve to {now:?}");
                    current = now;
                }
                Err(e) => tracing::warn!("egress allow-list: reloading the table: {e}"),
            }
        }
    })))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn names_resolve_on_the_host_and_a_failure_keeps_the_last_answer() {
        let mut egress: Egress = "no-such-name.invalid:80, 10.0.0.0/8".parse().unwrap();
        if let Egress::Allow(list) = &mut egress {
            // Resolvable without a network (/etc/hosts), though not a
            // name the annotation takes (no dot).
            list.push(super::super::egress::Allow {
                dest: super::super::egress::Dest::Name("localhost".into()),
                port: Some(80),
            });
        }
        let r = resolve(&egress, &Resolved::new()).await;
        assert!(
            r["localhost"].contains(&"127.0.0.1".parse().unwrap()),
            "{r:?}"
        );
        assert!(r["no-such-name.invalid"].is_empty(), "{r:?}");
        let mut before = Resolved::new();
        before.insert(
            "no-such-name.invalid".into(),
            ["10.1.1.1".parse().unwrap()].into(),
        );
        let again = resolve(&egress, &before).await;
        assert_eq!(
            again["no-such-name.invalid"],
            before["no-such-name.invalid"]
        );
    }

    #[tokio::test]
    async fn no_names_no_task() {
        let open = refresher(
            "/x".into(),
            Egress::Open,
            "eth0".into(),
            Resolved::new(),
            Default::default(),
        );
        assert!(open.is_none());
        let cidrs: Egress = "10.0.0.0/8:443".parse().unwrap();
        assert!(refresher(
            "/x".into(),
            cidrs,
            "eth0".into(),
            Resolved::new(),
            Default::default()
        )
        .is_none());
    }
}
