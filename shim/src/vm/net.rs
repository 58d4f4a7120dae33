//! The sandbox's network: when the container's spec names a network
//! namespace (CRI pods, `ctr run --with-ns network:PATH`), the VM gets a
//! NIC that carries that namespace's traffic.
//!
//! Inside the namespace (a thread of ours that `setns`es into it, so
//! neither the shim nor the VMM moves there) we open a tap, `burrow0`,
//! with virtio-net headers, and connect it to the namespace's CNI
//! interface (`eth0`, or the only other interface there) much as Kata's
//! `tcfilter` model does with tc redirects, here with nftables: a `netdev`
//! chain on each one's ingress forwards (`fwd to`) what arrives to the
//! other, the tap's applying the egress policy and both recording the
//! flows it lets out ([`super::egress`]). No bridge, no MAC learning, any
//! CNI plugin works. The guest's NIC takes the CNI
//! interface's MAC (the neighbours' ARP caches stay right) and the agent
//! gives it the interface's MTU, addresses and routes ([`GuestNet`]).
//!
//! The tap's file descriptor stays open in the shim for the sandbox's
//! life and is passed to every burrow-vmm it starts (`--net fd=N`), so the
//! tap, its chain and the flows recorded outlive a VMM restart (hibernate
//! and wake). [`SandboxNet::teardown`] removes the table and closes it,
//! which removes the tap.
//!
//! Links, addresses and routes go over rtnetlink; the nftables table is
//! loaded with `nft -f -` (nftables on the node).

use std::fs::File;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use burrow_protocol::net::{Cidr, GuestNet, Route};
use burrow_vmm_api::{Mac, NetArg, TapSource};
use futures::TryStreamExt;
use rtnetlink::packet_route::address::{AddressAttribute, AddressScope};
use rtnetlink::packet_route::link::{LinkAttribute, LinkMessage};
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteProtocol,
};
use rtnetlink::{Handle, LinkUnspec, RouteMessageBuilder};
use serde_json::Value;

use super::egress::{self, Egress, Resolved};
use super::egress_dns::{self, Refresher};
use super::netns::{self, Holder};
use crate::sandbox::{Result, SandboxError};

/// The tap's name inside the sandbox's namespace.
pub const TAP_NAME: &str = "burrow0";

/// The network namespace the spec puts the container in, if it names one
/// by path (a spec asking for a new, unnamed namespace gets none: the
/// guest has loopback only, as before).
pub fn netns_path(spec: &Value) -> Option<PathBuf> {
    spec.get("linux")?
        .get("namespaces")?
        .as_array()?
        .iter()
        .find(|ns| ns.get("type").and_then(Value::as_str) == Some("network"))?
        .get("path")?
        .as_str()
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
}

/// A sandbox's NIC, set up in its namespace.
pub struct SandboxNet {
    netns: PathBuf,
    tap: OwnedFd,
    /// The CNI interface the tap is joined to.
    cni_if: String,
    egress: Egress,
    pub guest: GuestNet,
    /// Set when the shim made the namespace ([`netns`]).
    fresh: Option<Fresh>,
    /// Keeps the allow-list's DNS names current, when it has any.
    refresh: Option<Refresher>,
}

/// A namespace the shim made: CNI may fill it between create and start.
struct Fresh {
    holder: Holder,
    /// The MAC the VM's NIC booted with (the guest takes the CNI
    /// interface's when it is wired).
    boot_mac: [u8; 6],
    /// Whether start looked for a CNI interface already.
    looked: bool,
}

impl std::fmt::Debug for SandboxNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} <-> {TAP_NAME} in {} (egress {:?}): {}",
            self.cni_if,
            self.netns.display(),
            self.egress,
            self.guest
        )
    }
}

fn net_err(what: &str, e: impl std::fmt::Display) -> SandboxError {
    SandboxError::FailedPrecondition(format!("sandbox network: {what}: {e}"))
}

impl SandboxNet {
    /// Create the tap in `netns`, join it to the CNI interface and read
    /// what the guest's NIC needs.
    pub async fn setup(netns: &Path, egress: Egress) -> Result<Self> {
        let path = netns.to_path_buf();
        let rules = egress.clone();
        let resolved = egress_dns::resolve(&egress, &Resolved::new()).await;
        let names = resolved.clone();
        let node_addrs = node_addresses().await?;
        let (tap, cni_if, guest, node) = in_netns(netns, move |h| {
            Box::pin(async move {
                let cni = cni_interface(&h)
                    .await?
                    .ok_or_else(|| net_err("the namespace", "has no interface but lo"))?;
                let guest = read_config(&h, &cni).await?;
                let node = egress::Node::new(node_addrs, &gateways(&guest));
                let tap = open_tap(TAP_NAME)?;
                wire(&h, &cni, &guest, &rules, &names, &node).await?;
                Ok((tap, name_of(&cni), guest, node))
            })
        })
        .await?;
        let refresh =
            egress_dns::refresher(path.clone(), egress.clone(), cni_if.clone(), resolved, node);
        let net = Self {
            netns: path,
            tap,
            cni_if,
            egress,
            guest,
            fresh: None,
            refresh,
        };
        tracing::info!("sandbox network: {net:?}");
        Ok(net)
    }

    /// Make a namespace for the sandbox ([`netns`]) with the tap in it,
    /// down and joined to nothing until [`Self::wire_fresh`] finds what CNI
    /// added.
    pub async fn setup_fresh(egress: Egress) -> Result<Self> {
        let holder = Holder::spawn()?;
        let path = holder.path();
        // Down until wired: a tap that is up sends the guest its own IPv6
        // chatter, waking the VMM of an idle sandbox. The guest's frames
        // to a down tap are dropped (and the guest's NIC is down too).
        let tap = in_netns(&path, |_| Box::pin(async { open_tap(TAP_NAME) })).await?;
        let boot_mac = netns::random_mac();
        let net = Self {
            netns: path,
            tap,
            cni_if: String::new(),
            egress,
            guest: GuestNet {
                mac: boot_mac,
                mtu: 1500,
                ..Default::default()
            },
            fresh: Some(Fresh {
                holder,
                boot_mac,
                looked: false,
            }),
            refresh: None,
        };
        tracing::info!("sandbox network: {net:?}");
        Ok(net)
    }

    /// The task pid to report: the holder's, when the shim made the
    /// namespace.
    pub fn holder_pid(&self) -> Option<u32> {
        self.fresh.as_ref().map(|f| f.holder.pid())
    }

    /// Once, at the first start of a sandbox whose namespace the shim made:
    /// if CNI added an interface since create, join the tap to it and
    /// return the guest NIC's boot MAC and the configuration it now needs.
    pub async fn wire_fresh(&mut self) -> Result<Option<([u8; 6], GuestNet)>> {
        let Some(fresh) = self.fresh.as_mut().filter(|f| !f.looked) else {
            return Ok(None);
        };
        fresh.looked = true;
        let boot_mac = fresh.boot_mac;
        let rules = self.egress.clone();
        let resolved = egress_dns::resolve(&self.egress, &Resolved::new()).await;
        let names = resolved.clone();
        let node_addrs = node_addresses().await?;
        let found = in_netns(&self.netns, move |h| {
            Box::pin(async move {
                let Some(cni) = cni_interface(&h).await? else {
                    return Ok(None);
                };
                let guest = read_config(&h, &cni).await?;
                let node = egress::Node::new(node_addrs, &gateways(&guest));
                wire(&h, &cni, &guest, &rules, &names, &node).await?;
                Ok(Some((name_of(&cni), guest, node)))
            })
        })
        .await?;
        let Some((cni_if, guest, node)) = found else {
            tracing::info!("sandbox network: nothing added to the namespace; loopback only");
            return Ok(None);
        };
        self.refresh = egress_dns::refresher(
            self.netns.clone(),
            self.egress.clone(),
            cni_if.clone(),
            resolved,
            node,
        );
        self.cni_if = cni_if;
        self.guest = guest.clone();
        tracing::info!("sandbox network, wired at start: {self:?}");
        Ok(Some((boot_mac, guest)))
    }

    /// The VMM's `--net`: the tap's descriptor (inherited) and the MAC.
    pub fn net_arg(&self) -> NetArg {
        NetArg {
            tap: TapSource::Fd(self.tap.as_raw_fd()),
            mac: Mac(self.fresh.as_ref().map_or(self.guest.mac, |f| f.boot_mac)),
        }
    }

    /// What the agent gives the NIC of a VM restored from a template in a
    /// named namespace (a cold boot reads [`Self::cmdline`] instead), the
    /// CNI interface's MAC included; the agent takes the VM's only NIC,
    /// which has the template's MAC. None for a namespace the shim made
    /// (configured at start).
    pub fn restored_config(&self) -> Option<GuestNet> {
        self.fresh.is_none().then(|| self.guest.clone())
    }

    /// The guest kernel command-line word the agent configures the NIC
    /// from; none for a namespace the shim made (configured at start).
    pub fn cmdline(&self) -> Option<String> {
        self.fresh
            .is_none()
            .then(|| format!("{}={}", burrow_protocol::net::CMDLINE_KEY, self.guest))
    }

    /// Remove the egress table (its chain on the CNI interface with it)
    /// and close the tap. The namespace may already be gone. A sandbox
    /// never joined to a CNI interface has no table (only `wire` adds
    /// one), and running `nft` to be told so cost its stop ~100 ms.
    pub async fn teardown(mut self) {
        drop(self.refresh.take());
        if !self.cni_if.is_empty() {
            let r = in_netns(&self.netns, move |_| {
                Box::pin(async move { egress::teardown() })
            })
            .await;
            if let Err(e) = r {
                tracing::debug!("sandbox network teardown: {e}");
            }
        }
        drop(self.tap);
        // Ends the holder; the namespace goes with its last descriptor.
        drop(self.fresh);
    }
}

type NsFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = Result<T>>>>;

/// Run `f` with an rtnetlink handle inside network namespace `netns`, on
/// a thread of its own that ends afterwards (a thread that has `setns`ed
/// must not go back to a pool).
pub(super) async fn in_netns<T, F>(netns: &Path, f: F) -> Result<T>
where
    T: Send + 'static,
    F: FnOnce(Handle) -> NsFuture<T> + Send + 'static,
{
    let netns = netns.to_path_buf();
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("burrow-netns".into())
        .spawn(move || {
            let r = (|| {
                let ns = File::open(&netns)
                    .map_err(|e| net_err(&format!("opening {}", netns.display()), e))?;
                // SAFETY: setns on this thread only, with an open nsfs fd.
                if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } < 0 {
                    return Err(net_err("setns", std::io::Error::last_os_error()));
                }
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| net_err("runtime", e))?;
                rt.block_on(async move {
                    let (conn, handle, _) =
                        rtnetlink::new_connection().map_err(|e| net_err("netlink socket", e))?;
                    let task = tokio::spawn(conn);
                    let r = f(handle).await;
                    task.abort();
                    r
                })
            })();
            let _ = tx.send(r);
        })
        .map_err(|e| net_err("thread", e))?;
    rx.await
        .map_err(|_| SandboxError::Internal("the network namespace thread died".into()))?
}

fn name_of(link: &LinkMessage) -> String {
    link.attributes
        .iter()
        .find_map(|a| match a {
            LinkAttribute::IfName(n) => Some(n.clone()),
            _ => None,
        })
        .unwrap_or_default()
}

async fn links(h: &Handle) -> Result<Vec<LinkMessage>> {
    h.link()
        .get()
        .execute()
        .try_collect()
        .await
        .map_err(|e| net_err("listing links", e))
}

pub(super) async fn link_by_name(h: &Handle, name: &str) -> Result<Option<LinkMessage>> {
    Ok(links(h).await?.into_iter().find(|l| name_of(l) == name))
}

/// `eth0`, or else the one interface that is neither loopback nor ours;
/// none when there is no other.
async fn cni_interface(h: &Handle) -> Result<Option<LinkMessage>> {
    let all = links(h).await?;
    let candidates: Vec<LinkMessage> = all
        .into_iter()
        .filter(|l| !matches!(name_of(l).as_str(), "lo" | TAP_NAME))
        .collect();
    if let Some(eth0) = candidates.iter().find(|l| name_of(l) == "eth0") {
        return Ok(Some(eth0.clone()));
    }
    match <[LinkMessage; 1]>::try_from(candidates) {
        Ok([one]) => Ok(Some(one)),
        Err(v) if v.is_empty() => Ok(None),
        Err(v) => Err(net_err(
            "the namespace has no eth0",
            format!("{} other interfaces to choose from", v.len()),
        )),
    }
}

/// Join the tap to `cni`: the egress table's two chains, loaded in one
/// transaction (all or nothing).
async fn wire(
    h: &Handle,
    cni: &LinkMessage,
    guest: &GuestNet,
    rules: &Egress,
    names: &Resolved,
    node: &egress::Node,
) -> Result<()> {
    join(h, guest.mtu).await?;
    egress::nft(&rules.ruleset(TAP_NAME, &name_of(cni), names, node))
}

/// The node's own addresses: every address in PID 1's network namespace
/// (the node's, wherever the shim itself runs).
async fn node_addresses() -> Result<Vec<IpAddr>> {
    in_netns(Path::new("/proc/1/ns/net"), |h| {
        Box::pin(async move {
            let addrs: Vec<_> = h
                .address()
                .get()
                .execute()
                .try_collect()
                .await
                .map_err(|e| net_err("listing the node's addresses", e))?;
            Ok(addrs
                .iter()
                .filter_map(|a| {
                    let local = a.attributes.iter().find_map(|x| match x {
                        AddressAttribute::Local(ip) => Some(*ip),
                        _ => None,
                    });
                    local.or_else(|| {
                        a.attributes.iter().find_map(|x| match x {
                            AddressAttribute::Address(ip) => Some(*ip),
                            _ => None,
                        })
                    })
                })
                .collect())
        })
    })
    .await
}

/// The gateways of the guest's routes (the CNI gateway).
fn gateways(guest: &GuestNet) -> Vec<IpAddr> {
    guest.routes.iter().filter_map(|r| r.gateway).collect()
}

/// MAC, MTU, global addresses and main-table routes of `link`.
async fn read_config(h: &Handle, link: &LinkMessage) -> Result<GuestNet> {
    let index = link.header.index;
    let mut net = GuestNet::default();
    for a in &link.attributes {
        match a {
            LinkAttribute::Address(m) => {
                net.mac = m
                    .as_slice()
                    .try_into()
                    .map_err(|_| net_err("MAC", format!("{m:02x?}")))?;
            }
            LinkAttribute::Mtu(m) => net.mtu = *m,
            _ => {}
        }
    }
    let addrs: Vec<_> = h
        .address()
        .get()
        .set_link_index_filter(index)
        .execute()
        .try_collect()
        .await
        .map_err(|e| net_err("listing addresses", e))?;
    for a in addrs {
        if a.header.index != index || a.header.scope != AddressScope::Universe {
            continue;
        }
        let ip = a.attributes.iter().find_map(|x| match x {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        });
        if let Some(ip) = ip {
            if net.addrs.len() < burrow_protocol::net::MAX_ADDRS {
                net.addrs
                    .push(Cidr::new(ip, a.header.prefix_len).map_err(|e| net_err("address", e))?);
            }
        }
    }
    let mut routes: Vec<RouteMessage> = Vec::new();
    for query in [
        RouteMessageBuilder::<Ipv4Addr>::new().build(),
        RouteMessageBuilder::<Ipv6Addr>::new().build(),
    ] {
        let got: Vec<RouteMessage> = h
            .route()
            .get(query)
            .execute()
            .try_collect()
            .await
            .map_err(|e| net_err("listing routes", e))?;
        routes.extend(got);
    }
    for r in routes {
        if let Some(route) = guest_route(&r, index) {
            if net.routes.len() < burrow_protocol::net::MAX_ROUTES {
                net.routes.push(route);
            }
        }
    }
    if net.mac == [0; 6] || net.mtu == 0 {
        return Err(net_err("CNI interface", "no MAC or MTU"));
    }
    Ok(net)
}

fn ip_of(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(ip) => Some(IpAddr::V4(*ip)),
        RouteAddress::Inet6(ip) => Some(IpAddr::V6(*ip)),
        _ => None,
    }
}

/// A main-table route out of the interface `index` that the guest needs:
/// one through a gateway, or an on-link one the kernel did not add for an
/// address by itself.
fn guest_route(r: &RouteMessage, index: u32) -> Option<Route> {
    if r.header.table != RouteHeader::RT_TABLE_MAIN {
        return None;
    }
    let mut oif = None;
    let mut dst = None;
    let mut gateway = None;
    for a in &r.attributes {
        match a {
            RouteAttribute::Oif(i) => oif = Some(*i),
            RouteAttribute::Destination(d) => dst = ip_of(d),
            RouteAttribute::Gateway(g) => gateway = ip_of(g),
            _ => {}
        }
    }
    if oif != Some(index) {
        return None;
    }
    let v6 = r.header.address_family == rtnetlink::packet_route::AddressFamily::Inet6;
    let dst = dst.unwrap_or(if v6 {
        IpAddr::V6(Ipv6Addr::UNSPECIFIED)
    } else {
        IpAddr::V4(Ipv4Addr::UNSPECIFIED)
    });
    if gateway.is_none() && (r.header.protocol == RouteProtocol::Kernel || dst.is_multicast()) {
        return None;
    }
    if let IpAddr::V6(d) = dst {
        if d.segments()[0] & 0xffc0 == 0xfe80 {
            return None;
        }
    }
    Some(Route {
        dst: Cidr::new(dst, r.header.destination_prefix_length).ok()?,
        gateway,
    })
}

/// Open (create) tap `name` with virtio-net headers in this thread's
/// namespace. It lives as long as a descriptor of it is open.
pub(super) fn open_tap(name: &str) -> Result<OwnedFd> {
    #[repr(C)]
    struct IfReq {
        name: [u8; libc::IFNAMSIZ],
        flags: libc::c_short,
        _pad: [u8; 22],
    }
    let path = c"/dev/net/tun";
    // SAFETY: open(2) of a constant path; the fd is owned right away.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(net_err(
            "opening /dev/net/tun",
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: just opened.
    let tap = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut req = IfReq {
        name: [0; libc::IFNAMSIZ],
        flags: 0,
        _pad: [0; 22],
    };
    for (d, s) in req
        .name
        .iter_mut()
        .zip(name.bytes().take(libc::IFNAMSIZ - 1))
    {
        *d = s;
    }
    req.flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
    // SAFETY: TUNSETIFF reads and writes an ifreq, which `req` is laid out as.
    if unsafe { libc::ioctl(tap.as_raw_fd(), libc::TUNSETIFF, &mut req) } < 0 {
        return Err(net_err("creating the tap", std::io::Error::last_os_error()));
    }
    Ok(tap)
}

/// Bring the tap up with the CNI interface's MTU (the egress table then
/// joins it to the CNI interface).
pub(super) async fn join(h: &Handle, mtu: u32) -> Result<()> {
    let tap = link_by_name(h, TAP_NAME)
        .await?
        .ok_or_else(|| net_err("the tap", "vanished"))?;
    h.link()
        .set(
            LinkUnspec::new_with_index(tap.header.index)
                .mtu(mtu)
                .up()
                .build(),
        )
        .execute()
        .await
        .map_err(|e| net_err("tap up", e))
}

impl super::VmSandbox {
    /// Give the VM `args` start a NIC in the network namespace `spec`
    /// names (set up once per sandbox; a restart of the VMM reuses it).
    /// Without one, `args` are unchanged: loopback only.
    /// `nic_on_cmdline`: a cold boot of this sandbox's own VM configures a
    /// named namespace's NIC from its kernel command line; a VM that is or
    /// becomes a template must boot with none (its snapshot would carry
    /// this sandbox's MAC, address and routes into every VM restored from
    /// it), and the agent configures it after the restore instead.
    pub(super) async fn with_network(
        &self,
        spec: &Value,
        mut args: super::vmm::VmmLaunch,
        nic_on_cmdline: bool,
    ) -> Result<super::vmm::VmmLaunch> {
        let named = netns_path(spec);
        if named.is_none() && !netns::wants_fresh(spec) {
            return Ok(args);
        }
        let mut slot = self.net.lock().await;
        let net = match (slot.take(), named) {
            (Some(n), _) => n,
            (None, Some(netns)) => SandboxNet::setup(&netns, Egress::from_spec(spec)?).await?,
            (None, None) => SandboxNet::setup_fresh(Egress::from_spec(spec)?).await?,
        };
        args.args.net = Some(net.net_arg());
        if nic_on_cmdline && args.args.restore.is_none() {
            args.args.append.extend(net.cmdline());
        }
        *slot = Some(net);
        Ok(args)
    }

    /// Right after a restore from a template, before anything runs in the
    /// guest: give the NIC of a named namespace's VM its address, routes
    /// and the CNI interface's MAC (a cold boot had them on its command
    /// line).
    pub(super) async fn configure_restored_network(
        &self,
        agent: &super::agent::Agent,
    ) -> Result<()> {
        let config = self
            .net
            .lock()
            .await
            .as_ref()
            .and_then(SandboxNet::restored_config);
        if let Some(guest) = config {
            agent.configure_network(guest.mac, &guest).await?;
        }
        Ok(())
    }

    /// At the first start: configure the guest's NIC if CNI filled the
    /// namespace the shim made after create (`ctr run --cni`).
    pub(super) async fn wire_network(&self, agent: &super::agent::Agent) -> Result<()> {
        let mut slot = self.net.lock().await;
        let Some(net) = slot.as_mut() else {
            return Ok(());
        };
        if let Some((boot_mac, guest)) = net.wire_fresh().await? {
            agent.configure_network(boot_mac, &guest).await?;
        }
        Ok(())
    }

    /// The task pid for a container whose init has guest pid `guest`: a
    /// holder's in the namespace the shim made, else `guest`.
    pub(super) async fn task_pid(&self, guest: u32) -> u32 {
        self.net
            .lock()
            .await
            .as_ref()
            .and_then(SandboxNet::holder_pid)
            .unwrap_or(guest)
    }

    /// Undo [`Self::with_network`] (the sandbox is going away).
    pub(super) async fn drop_network(&self) {
        if let Some(net) = self.net.lock().await.take() {
            net.teardown().await;
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn netns_path_is_the_network_namespace_path() {
        let spec: Value = serde_json::json!({"linux": {"namespaces": [
            {"type": "pid"},
            {"type": "network", "path": "/var/run/netns/cni-1"},
        ]}});
        assert_eq!(
            netns_path(&spec),
            Some(PathBuf::from("/var/run/netns/cni-1"))
        );
        let fresh: Value = serde_json::json!({"linux": {"namespaces": [{"type": "network"}]}});
        assert_eq!(
            netns_path(&fresh),
            None,
            "a new unnamed namespace: loopback only"
        );
        assert_eq!(netns_path(&serde_json::json!({})), None);
    }

    fn route(
        v6: bool,
        proto: RouteProtocol,
        oif: u32,
        dst: Option<(IpAddr, u8)>,
        gw: Option<IpAddr>,
    ) -> RouteMessage {
        let mut r = if v6 {
            RouteMessageBuilder::<Ipv6Addr>::new().build()
        } else {
            RouteMessageBuilder::<Ipv4Addr>::new().build()
        };
        r.header.table = RouteHeader::RT_TABLE_MAIN;
        r.header.protocol = proto;
        r.attributes.push(RouteAttribute::Oif(oif));
        if let Some((d, p)) = dst {
            r.header.destination_prefix_length = p;
            r.attributes.push(RouteAttribute::Destination(d.into()));
        }
        if let Some(g) = gw {
            r.attributes.push(RouteAttribute::Gateway(g.into()));
        }
        r
    }

    #[test]
    fn the_guest_gets_gateway_and_added_routes_of_the_cni_interface_only() {
        let gw: IpAddr = "10.88.0.1".parse().unwrap();
        let default =
            guest_route(&route(false, RouteProtocol::Boot, 2, None, Some(gw)), 2).unwrap();
        assert_eq!(
            default.to_owned(),
            Route {
                dst: "0.0.0.0/0".parse().unwrap(),
                gateway: Some(gw)
            }
        );
        // A CNI-added on-link route is kept; the kernel's prefix route for
        // an address is not (the guest's kernel adds its own).
        let subnet = Some(("10.89.0.0".parse().unwrap(), 16));
        let on_link =
            guest_route(&route(false, RouteProtocol::Static, 2, subnet, None), 2).unwrap();
        assert_eq!(on_link.gateway, None);
        assert_eq!(on_link.dst.to_string(), "10.89.0.0/16");
        assert_eq!(
            guest_route(&route(false, RouteProtocol::Kernel, 2, subnet, None), 2),
            None
        );
        // Another interface's routes, other tables and IPv6 link-local stay.
        assert_eq!(
            guest_route(&route(false, RouteProtocol::Boot, 3, None, Some(gw)), 2),
            None
        );
        let mut local = route(false, RouteProtocol::Boot, 2, None, Some(gw));
        local.header.table = 255;
        assert_eq!(guest_route(&local, 2), None);
        let ll = Some(("fe80::".parse().unwrap(), 64));
        assert_eq!(
            guest_route(&route(true, RouteProtocol::Boot, 2, ll, None), 2),
            None
        );
        let v6gw: IpAddr = "fd00::1".parse().unwrap();
        let v6 = guest_route(&route(true, RouteProtocol::Boot, 2, None, Some(v6gw)), 2).unwrap();
        assert_eq!(v6.dst.to_string(), "::/0");
    }
}
