//! The guest's NIC: configured at boot from [`GuestNet`] on the kernel
//! command line (the shim copies the container network namespace's
//! interface: its MAC, MTU, addresses and routes), over rtnetlink.
//! Without `burrow.net` the guest has loopback only, until the shim sends
//! the same configuration over `ConfigureNetwork` ([`configure_nic`]):
//! CNI filled the sandbox's namespace after the VM booted (`ctr run --cni`),
//! or the guest was restored (from a template, or from a checkpoint into a
//! namespace that may not be the one it was taken in: addresses the new
//! configuration does not list are removed).

use std::net::IpAddr;

use burrow_protocol::net::{Cidr, GuestNet, Route};
use futures::TryStreamExt;
use rtnetlink::packet_route::address::AddressAttribute;
use rtnetlink::packet_route::link::{LinkAttribute, LinkMessage};
use rtnetlink::packet_route::route::RouteScope;
use rtnetlink::{Handle, LinkUnspec, RouteMessageBuilder};

/// Read `burrow.net` from the command line and apply it; nothing to do
/// when it is absent.
pub async fn configure_from_cmdline() -> anyhow::Result<()> {
    let Some(value) = crate::init::kernel_cmdline_value(burrow_protocol::net::CMDLINE_KEY) else {
        return Ok(());
    };
    let net: GuestNet = value
        .parse()
        .map_err(|e| anyhow::anyhow!("{}={value}: {e}", burrow_protocol::net::CMDLINE_KEY))?;
    configure(&net).await
}

/// Bring the NIC whose MAC is `net.mac` up with `net`'s MTU, addresses
/// and routes.
pub async fn configure(net: &GuestNet) -> anyhow::Result<()> {
    let (conn, handle, _) = rtnetlink::new_connection()?;
    let task = tokio::spawn(conn);
    let r = apply(&handle, net).await;
    task.abort();
    r
}

/// Give the NIC whose MAC is `nic` (its boot MAC; or already `net.mac`,
/// when this is sent again) `net`'s MAC, then configure it as
/// [`configure`] does.
pub async fn configure_nic(nic: [u8; 6], net: &GuestNet) -> anyhow::Result<()> {
    let (conn, handle, _) = rtnetlink::new_connection()?;
    let task = tokio::spawn(conn);
    let r = async {
        // Already given this MAC (a guest restored into the namespace it
        // was checkpointed in, or the call sent again): no blip of the link.
        if find_by_mac(&handle, net.mac).await?.is_some() {
            return apply(&handle, net).await;
        }
        let link = match find_by_mac(&handle, nic).await? {
            Some(l) => l,
            // A guest restored from a template has the template's MAC,
            // one from a checkpoint its first namespace's: a burrow VM
            // has one NIC at most.
            None => only_nic(&handle)
                .await?
                .ok_or_else(|| anyhow::anyhow!("no network interface has MAC {nic:02x?}"))?,
        };
        let index = link.header.index;
        // Down while its address changes (not every driver can change it live).
        handle
            .link()
            .set(LinkUnspec::new_with_index(index).down().build())
            .execute()
            .await
            .map_err(|e| anyhow::anyhow!("setting link {index} down: {e}"))?;
        handle
            .link()
            .set(
                LinkUnspec::new_with_index(index)
                    .address(net.mac.to_vec())
                    .build(),
            )
            .execute()
            .await
            .map_err(|e| anyhow::anyhow!("setting link {index}'s MAC: {e}"))?;
        apply(&handle, net).await
    }
    .await;
    task.abort();
    r
}

async fn apply(handle: &Handle, net: &GuestNet) -> anyhow::Result<()> {
    let link = find_by_mac(handle, net.mac)
        .await?
        .ok_or_else(|| anyhow::anyhow!("no network interface has MAC {:02x?}", net.mac))?;
    let index = link.header.index;
    handle
        .link()
        .set(LinkUnspec::new_with_index(index).mtu(net.mtu).up().build())
        .execute()
        .await
        .map_err(|e| anyhow::anyhow!("setting link {index} up with MTU {}: {e}", net.mtu))?;
    drop_stale_addresses(handle, index, &net.addrs).await?;
    for a in &net.addrs {
        handle
            .address()
            .add(index, a.ip, a.prefix)
            .replace()
            .execute()
            .await
            .map_err(|e| anyhow::anyhow!("adding address {a}: {e}"))?;
    }
    // On-link routes first: a gateway must be reachable before a route
    // through it is accepted.
    let (direct, via): (Vec<&Route>, Vec<&Route>) =
        net.routes.iter().partition(|r| r.gateway.is_none());
    for r in direct.into_iter().chain(via) {
        add_route(handle, index, r)
            .await
            .map_err(|e| anyhow::anyhow!("adding route {}: {e}", describe(r)))?;
    }
    tracing::info!(
        "network: link {index} up, MTU {}, {} addresses, {} routes",
        net.mtu,
        net.addrs.len(),
        net.routes.len()
    );
    Ok(())
}

/// Remove link `index`'s addresses that `keep` does not list: a guest
/// restored into another namespace than the one it was checkpointed in
/// must not answer for the old one's address (another pod may have it now).
/// IPv6 link-local addresses are the kernel's own and stay.
async fn drop_stale_addresses(handle: &Handle, index: u32, keep: &[Cidr]) -> anyhow::Result<()> {
    let mut stale = Vec::new();
    let mut addrs = handle.address().get().set_link_index_filter(index).execute();
    while let Some(m) = addrs.try_next().await? {
        let Some(ip) = m.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(ip) | AddressAttribute::Local(ip) => Some(*ip),
            _ => None,
        }) else {
            continue;
        };
        let link_local = matches!(ip, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80);
        let kept = keep
            .iter()
            .any(|c| c.ip == ip && c.prefix == m.header.prefix_len);
        if m.header.index == index && !link_local && !kept {
            stale.push((ip, m));
        }
    }
    for (ip, m) in stale {
        handle
            .address()
            .del(m)
            .execute()
            .await
            .map_err(|e| anyhow::anyhow!("removing the old address {ip}: {e}"))?;
        tracing::info!("network: removed old address {ip} from link {index}");
    }
    Ok(())
}

fn describe(r: &Route) -> String {
    match r.gateway {
        Some(gw) => format!("{} via {gw}", r.dst),
        None => format!("{} on link", r.dst),
    }
}

async fn add_route(handle: &Handle, index: u32, r: &Route) -> anyhow::Result<()> {
    let mut b = RouteMessageBuilder::<IpAddr>::new()
        .destination_prefix(r.dst.ip, r.dst.prefix)?
        .output_interface(index);
    match r.gateway {
        Some(gw) => b = b.gateway(gw)?,
        None => b = b.scope(RouteScope::Link),
    }
    handle.route().add(b.build()).replace().execute().await?;
    Ok(())
}

/// The one link with a 6-byte hardware address other than loopback's
/// (None if there are none or several).
async fn only_nic(handle: &Handle) -> anyhow::Result<Option<LinkMessage>> {
    let mut links = handle.link().get().execute();
    let mut found = None;
    while let Some(l) = links.try_next().await? {
        let ether = l.attributes.iter().any(|a| {
            matches!(a, LinkAttribute::Address(m) if m.len() == 6 && m.iter().any(|b| *b != 0))
        });
        if ether {
            if found.is_some() {
                return Ok(None);
            }
            found = Some(l);
        }
    }
    Ok(found)
}

async fn find_by_mac(handle: &Handle, mac: [u8; 6]) -> anyhow::Result<Option<LinkMessage>> {
    let mut links = handle.link().get().execute();
    while let Some(l) = links.try_next().await? {
        let matches = l
            .attributes
            .iter()
            .any(|a| matches!(a, LinkAttribute::Address(m) if m.as_slice() == mac));
        if matches {
            return Ok(Some(l));
        }
    }
    Ok(None)
}
