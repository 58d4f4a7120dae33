//! A container in a CNI network namespace, end to end: the test makes a
//! network namespace and runs Debian's `bridge` + `host-local` CNI plugins
//! on it, as containerd's CRI plugin does for a pod, then `ctr run
//! --with-ns network:PATH` puts the container in it. `ctr run --cni` (CNI
//! run by ctr between task create and start, on `/proc/<task pid>/ns/net`,
//! the namespace burrow's shim made and a holder process lives in) is
//! tested on its own, with runc as the control.
//!
//! Checked as a user would notice: the container has the CNI address on
//! eth0 and the default route through the bridge; 100 MB go from a server
//! in another namespace of the test host (routed through it, as a server
//! elsewhere would be) into the container (the container downloads them)
//! and back out (the test host downloads them from an HTTP server in the
//! container on the CNI address), each arriving intact (SHA-256); the
//! test host's own addresses are closed to new connections from a burrow
//! guest, but for DNS on the gateway, and open to runc's container; after delete nothing
//! of burrow is left in the namespace (no tap, no ingress qdisc, no
//! nftables table); the spec's /etc/resolv.conf, /etc/hosts and
//! /etc/hostname bind mounts reach the container and its DNS lookups reach
//! the resolver the test runs on the bridge. The same test runs under runc
//! as the control. The egress policy (`io.burrow.egress`): the metadata
//! address is refused in every mode, `deny` lets no new connection out
//! while the container runs and serves, an allow-list (naming its server
//! by a DNS name the shim resolves) lets out only what it lists, and root
//! in the guest changing its addresses and routes opens nothing, nor do
//! hand-made TCP segments that are no new connection (ACK, FIN or RST
//! with a payload, from a raw socket), which do arrive with egress open. A TCP
//! connection from the test host into the container survives hibernate +
//! wake and checkpoint + restore, and a SIGKILLed VMM leaves nothing in
//! the namespace. A guest flooding its NIC's tx queue cannot starve the
//! VMM's control API: hibernation and a checkpoint complete through it. Everything stays
//! inside the test host: its own bridges and namespaces, and the
//! "metadata" address 169.254.169.254 is an address of the test's bridge.

#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::net::Ipv4Addr;
use std::process::Command;
use std::time::{Duration, Instant};

use burrow_tests::cni::{sh, sh_ok, CniNetns, CtrCni, Remote, CTR_CNI_PORT};
use burrow_tests::containerd::{Containerd, CLEAN, IMAGE, LONG, RUNTIME};
use burrow_tests::dns::TinyDns;
use burrow_tests::KillOnDrop;

const MB: usize = 100;

fn sha256(path: &std::path::Path) -> String {
    sh_ok(&format!("sha256sum {}", path.display()))
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

fn rate(bytes: usize, d: Duration) -> String {
    format!(
        "{:.1} MB/s ({:.1} s)",
        bytes as f64 / 1e6 / d.as_secs_f64(),
        d.as_secs_f64()
    )
}

fn container_network(runtime: &str, name: &str, octet: u8) {
    let c = Containerd::nested(name);
    let ns = CniNetns::add(&format!("burrow-{name}"), octet);
    let remote = Remote::add(&format!("burrow-r{name}"), octet);
    let id = format!("t-{name}");

    // 100 MB of random data a server elsewhere serves; the test host
    // serves the same on its own addresses.
    let www = c.dir.join("www");
    std::fs::create_dir_all(&www).unwrap();
    let big = www.join("big");
    sh_ok(&format!("head -c {MB}M /dev/urandom > {}", big.display()));
    let want = sha256(&big);
    std::fs::write(www.join("small"), "small\n").unwrap();
    let _server = serve(&www, 8081);
    let _remote_server = remote.serve(&www, 8081);

    // The files CRI would bind-mount, and a resolver on the bridge.
    let dns_at = format!("{}:53", ns.gateway).parse().unwrap();
    let dns = TinyDns::start(dns_at, "web.burrow.test", Ipv4Addr::new(10, 1, 2, 3)).unwrap();
    let etc = c.dir.join("etc");
    std::fs::create_dir_all(&etc).unwrap();
    let files = [
        ("resolv.conf", format!("nameserver {}\n", ns.gateway)),
        (
            "hosts",
            "127.0.0.1 localhost\n10.9.9.9 cni-host.test\n".into(),
        ),
        ("hostname", format!("{name}\n")),
    ];
    let mounts: Vec<String> = files
        .iter()
        .map(|(f, text)| {
            std::fs::write(etc.join(f), text).unwrap();
            format!(
                "type=bind,src={},dst=/etc/{f},options=rbind:ro",
                etc.join(f).display()
            )
        })
        .collect();

    let with_ns = format!("network:{}", ns.path());
    let r = c.ctr(&[
        "run",
        "-d",
        "--runtime",
        runtime,
        "--mount",
        &mounts[0],
        "--mount",
        &mounts[1],
        "--mount",
        &mounts[2],
        "--with-ns",
        &with_ns,
        IMAGE,
        &id,
        "sh",
        "-c",
        "mkdir -p /www && exec httpd -f -p 8080 -h /www",
    ]);
    assert_eq!(r.code, Some(0), "{r:?}\n{}", c.diagnostics());
    c.wait_status(&id, "RUNNING", LONG);
    if runtime == RUNTIME {
        // A named namespace's VM is restored from a template too: the
        // agent gives the template's NIC the CNI interface's MAC.
        c.assert_started_as_configured(&id);
    }

    // The container has the namespace's address and route.
    assert_cni_address(&c, &id, &ns);
    let route = c.exec_ok(&id, "route", &["ip", "route"]);
    assert!(
        route.contains(&format!("default via {}", ns.gateway)),
        "{route}"
    );
    // The spec's /etc files, and DNS through the resolver they name.
    for (f, text) in &files {
        let got = c.exec_ok(&id, f, &["cat", &format!("/etc/{f}")]);
        assert_eq!(&got, text, "{runtime}: /etc/{f}");
    }
    let looked_up = c.exec_ok(&id, "dns", &["nslookup", "web.burrow.test"]);
    assert!(
        looked_up.contains("10.1.2.3") && dns.answered() > 0,
        "{runtime}: DNS from /etc/resolv.conf: {looked_up}"
    );

    // Into the container: it downloads the file from the test host.
    let t = Instant::now();
    let got = c.exec_ok(
        &id,
        "in",
        &[
            "sh",
            "-c",
            &format!(
                "wget -q -O /www/big http://{}:8081/big && sha256sum /www/big",
                remote.ip
            ),
        ],
    );
    let inbound = t.elapsed();
    assert_eq!(
        got.split_whitespace().next(),
        Some(want.as_str()),
        "{MB} MB into the container arrived changed"
    );

    // Out of it: the test host downloads it from the container's server
    // on the CNI address.
    let back = c.dir.join("back");
    let t = Instant::now();
    sh_ok(&format!(
        "wget -q -T 600 -O {} http://{}:8080/big",
        back.display(),
        ns.ip
    ));
    let outbound = t.elapsed();
    assert_eq!(
        sha256(&back),
        want,
        "{MB} MB out of the container arrived changed"
    );
    eprintln!(
        "net_cni {runtime}: into the container {}, out of it {}",
        rate(MB << 20, inbound),
        rate(MB << 20, outbound)
    );
    let _ = std::fs::remove_file(&back);
    let _ = std::fs::remove_file(&big);
    // The node: closed to a burrow guest even with egress open (its DNS
    // on the gateway answered above); runc's container, the control,
    // shows the server there answers.
    let node = fetch(
        &c,
        &id,
        "node",
        &format!("http://{}:8081/small", ns.gateway),
        if runtime == RUNTIME { "5" } else { "60" },
    );
    assert_eq!(
        node,
        runtime != RUNTIME,
        "{runtime}: the test host's own address {} from the container",
        ns.gateway
    );
    if runtime == RUNTIME {
        assert!(
            !fetch(&c, &id, "meta", "http://169.254.169.254:8081/small", "5"),
            "the metadata address must be refused even with egress open"
        );
    }

    kill_and_remove(&c, &id);
    if runtime == RUNTIME {
        c.assert_clean(CLEAN);
        assert_namespace_clean(&ns);
    }
}

/// SIGKILL container `id`, wait until it stopped, and delete its task and
/// the container, each successfully.
fn kill_and_remove(c: &Containerd, id: &str) {
    c.ctr(&["task", "kill", "-s", "KILL", id]);
    c.wait_status(id, "STOPPED", LONG);
    let r = c.ctr(&["task", "delete", id]);
    assert_eq!(r.code, Some(0), "{r:?}");
    let r = c.ctr(&["container", "delete", id]);
    assert_eq!(r.code, Some(0), "{r:?}");
}

/// eth0 in container `id` has the CNI address of `ns`.
fn assert_cni_address(c: &Containerd, id: &str, ns: &CniNetns) {
    let addr = c.exec_ok(id, "addr", &["ip", "-o", "-4", "addr", "show", "dev", "eth0"]);
    assert!(
        addr.contains(&format!("inet {}/24", ns.ip)),
        "eth0 in container {id} must have the CNI address {}: {addr}",
        ns.ip
    );
}

/// Nothing of burrow left in the namespace: no tap, no redirect, no
/// nftables table.
fn assert_namespace_clean(ns: &CniNetns) {
    let (tap_there, _) = sh(&format!("ip -n {} link show burrow0", ns.name));
    assert!(!tap_there, "the tap outlived the sandbox");
    let qdiscs = sh_ok(&format!("tc -n {} qdisc show dev eth0", ns.name));
    assert!(
        !qdiscs.contains("ingress"),
        "the redirect outlived the sandbox: {qdiscs}"
    );
    let tables = sh_ok(&format!("ip netns exec {} nft list tables", ns.name));
    assert!(
        !tables.contains("burrow"),
        "the egress table outlived the sandbox: {tables}"
    );
}

/// busybox httpd serving `dir` on `port` of every test-host address.
fn serve(dir: &std::path::Path, port: u16) -> KillOnDrop {
    KillOnDrop(
        Command::new("busybox")
            .args(["httpd", "-f", "-p", &port.to_string(), "-h"])
            .arg(dir)
            .spawn()
            .unwrap(),
    )
}

/// Whether the container fetches `url` within `secs` (short where the
/// fetch must fail, long where it must work: the nested guest can be
/// slow). busybox's `timeout`, not `wget -T`: busybox 1.35's wget
/// segfaults with `-T` (exit 139).
fn fetch(c: &Containerd, id: &str, exec_id: &str, url: &str, secs: &str) -> bool {
    let args = ["task", "exec", "--exec-id", exec_id, id, "timeout", secs];
    let mut args = args.to_vec();
    args.extend(["wget", "-q", "-O", "-", url]);
    let r = c.ctr(&args);
    eprintln!("fetch {url} from {id}: {r:?}");
    r.code == Some(0) && r.stdout.contains("small")
}

/// What the namespace's tc and nftables saw (for a failure message).
fn ns_state(ns: &CniNetns) -> String {
    sh(&format!(
        "ip netns exec {n} nft list ruleset; ip -s -n {n} link",
        n = ns.name
    ))
    .1
}

/// A container's command: serve /www/small on port 8080.
const SERVE: &str = "mkdir -p /www && echo small > /www/small && exec httpd -f -p 8080 -h /www";

/// Container `id` in `ns` under egress mode `egress`, serving /www.
fn run_in(c: &Containerd, ns: &CniNetns, id: &str, egress: &str) {
    run_sh_in(c, ns, id, egress, SERVE);
}

/// Container `id` in `ns` under egress mode `egress`, running `script`.
fn run_sh_in(c: &Containerd, ns: &CniNetns, id: &str, egress: &str, script: &str) {
    let with_ns = format!("network:{}", ns.path());
    let annotation = format!("io.burrow.egress={egress}");
    let r = c.ctr(&[
        "run",
        "-d",
        "--runtime",
        RUNTIME,
        "--with-ns",
        &with_ns,
        "--annotation",
        &annotation,
        IMAGE,
        id,
        "sh",
        "-c",
        script,
    ]);
    assert_eq!(r.code, Some(0), "{r:?}\n{}", c.diagnostics());
    c.wait_status(id, "RUNNING", LONG);
}

/// A line of the test host's /etc/hosts, removed when dropped.
struct HostsLine(String);

impl HostsLine {
    fn add(line: &str) -> Self {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open("/etc/hosts")
            .unwrap();
        writeln!(f, "{line}").unwrap();
        Self(line.to_string())
    }
}

impl Drop for HostsLine {
    fn drop(&mut self) {
        if let Ok(text) = std::fs::read_to_string("/etc/hosts") {
            let kept: String = text
                .lines()
                .filter(|l| *l != self.0)
                .map(|l| format!("{l}\n"))
                .collect();
            let _ = std::fs::write("/etc/hosts", kept);
        }
    }
}

/// The port hand-made segments are sent to on the remote server.
const CRAFTED_PORT: u16 = 9201;

/// Send five hand-made TCP segments with flags `flags` and a payload from
/// a raw socket in container `id` (as root), from port `sport` to
/// `dst`:`CRAFTED_PORT`: tests/images/tcp-crafter, streamed in through
/// the exec's stdin.
fn craft(c: &Containerd, id: &str, exec_id: &str, dst: &str, sport: u16, flags: &str) {
    let crafter = burrow_tests::asset_from_env("BURROW_TCP_CRAFTER", "tests/images/tcp-crafter");
    let crafter = std::fs::read(crafter).unwrap();
    let (port, sport) = (CRAFTED_PORT.to_string(), sport.to_string());
    let r = c.ctr_with(
        &[
            "task",
            "exec",
            "--exec-id",
            exec_id,
            id,
            "sh",
            "-c",
            "cat >/tmp/tcp-crafter && chmod 755 /tmp/tcp-crafter && exec /tmp/tcp-crafter \"$@\"",
            "sh",
            dst,
            &port,
            &sport,
            flags,
            "5",
            "exfiltrated-data",
        ],
        Some(&crafter),
        LONG,
    );
    eprintln!("craft from {id}: {r:?}");
    assert_eq!(r.code, Some(0), "the crafter could not send: {r:?}");
}

/// Counters in `remote`'s namespace, ahead of everything else there, of
/// the TCP segments to `CRAFTED_PORT` from each of source ports `from`
/// (whatever address root in a guest gave itself).
fn count_arrivals(remote: &Remote, from: &[u16]) {
    let rules: String = from
        .iter()
        .map(|p| format!("    tcp sport {p} tcp dport {CRAFTED_PORT} counter\n"))
        .collect();
    let script = format!(
        "table inet burrow_probe {{\n  chain pre {{\n    type filter hook prerouting priority -300; policy accept;\n{rules}  }}\n}}\n"
    );
    let mut nft = Command::new("ip")
        .args(["netns", "exec", &remote.name, "nft", "-f", "-"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    nft.stdin
        .take()
        .unwrap()
        .write_all(script.as_bytes())
        .unwrap();
    assert!(nft.wait().unwrap().success(), "{script}");
}

/// How many of the segments counted by [`count_arrivals`] came from port
/// `sport`.
fn arrived(remote: &Remote, sport: u16) -> u64 {
    let chain = sh_ok(&format!(
        "ip netns exec {} nft list chain inet burrow_probe pre",
        remote.name
    ));
    let line = chain
        .lines()
        .find(|l| l.contains(&format!("tcp sport {sport} ")))
        .unwrap_or_else(|| panic!("no counter for {sport}: {chain}"));
    let n = line
        .split_whitespace()
        .skip_while(|w| *w != "packets")
        .nth(1);
    n.and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{line}"))
}

#[test]
fn egress_policy_holds_outside_the_guest() {
    let c = Containerd::nested("egress");
    let allow = CniNetns::add("burrow-egress-a", 63);
    let deny = CniNetns::add("burrow-egress-d", 64);
    let open = CniNetns::add("burrow-egress-o", 68);
    let remote = Remote::add("burrow-egress-r", 63);
    let www = c.dir.join("www");
    std::fs::create_dir_all(&www).unwrap();
    std::fs::write(www.join("small"), "small\n").unwrap();
    let (_s1, _s2) = (remote.serve(&www, 8081), remote.serve(&www, 8082));
    let _node = serve(&www, 8083);
    std::thread::sleep(Duration::from_millis(500));
    for port in [8081, 8082] {
        let url = format!("http://{}:{port}/small", remote.ip);
        assert!(
            sh(&format!("wget -q -T 5 -O - {url}")).1.contains("small"),
            "{url}"
        );
    }

    // The allow-list names the server: the shim resolves it on the test
    // host (its /etc/hosts here).
    // The test host's own address is listed too: the node stays closed.
    let _name = HostsLine::add(&format!("{} egress-allowed.burrow.test", remote.ip));
    run_in(
        &c,
        &allow,
        "t-allow",
        &format!("egress-allowed.burrow.test:8081,{}", allow.gateway),
    );
    assert!(
        fetch(
            &c,
            "t-allow",
            "a1",
            &format!("http://{}:8081/small", remote.ip),
            "60"
        ),
        "listed: must pass\n{}",
        ns_state(&allow)
    );
    assert!(
        !fetch(
            &c,
            "t-allow",
            "a2",
            &format!("http://{}:8082/small", remote.ip),
            "5"
        ),
        "other port: refused"
    );
    assert!(
        !fetch(
            &c,
            "t-allow",
            "a4",
            &format!("http://{}:8083/small", allow.gateway),
            "5"
        ),
        "the node's own address, though listed: refused"
    );
    assert!(
        !fetch(
            &c,
            "t-allow",
            "a3",
            "http://169.254.169.254:8083/small",
            "5"
        ),
        "metadata: refused"
    );

    run_in(&c, &deny, "t-deny", "deny");
    assert!(
        !fetch(
            &c,
            "t-deny",
            "d1",
            &format!("http://{}:8081/small", remote.ip),
            "5"
        ),
        "deny: refused"
    );
    assert!(
        !fetch(&c, "t-deny", "d2", "http://169.254.169.254:8083/small", "5"),
        "metadata: refused"
    );
    // Root in the guest moves its address and routes: still nothing out.
    let r = c.ctr(&[
        "task", "exec", "--exec-id", "d3", "t-deny", "sh", "-c",
        &format!(
            "ip addr add 10.88.64.77/24 dev eth0; ip route replace default via {gw} dev eth0 src 10.88.64.77; \
             ip link set eth0 down; ip link set eth0 up; ip route replace default via {gw} dev eth0; \
             timeout 5 wget -q -O - http://{far}:8081/small",
            gw = deny.gateway,
            far = remote.ip,
        ),
    ]);
    assert_ne!(
        r.code,
        Some(0),
        "root in the guest got out under deny: {r:?}"
    );
    // The container keeps running and serving: replies leave.
    assert_eq!(c.task_status("t-deny").as_deref(), Some("RUNNING"));
    let inbound = sh_ok(&format!("wget -q -T 30 -O - http://{}:8080/small", deny.ip));
    assert_eq!(inbound.trim(), "small");

    // Root in the guest hand-makes TCP segments that are no new
    // connection (ACK and PSH, with a payload) to a server elsewhere:
    // under deny, and to a port the allow-list does not name, none
    // arrives; with egress open the same segments do (the control: the
    // crafter works and the path is there).
    run_in(&c, &open, "t-open", "open");
    count_arrivals(&remote, &[40001, 40002, 40003]);
    craft(&c, "t-deny", "c1", &remote.ip, 40001, "AP");
    craft(&c, "t-allow", "c2", &remote.ip, 40002, "AP");
    craft(&c, "t-open", "c3", &remote.ip, 40003, "AP");
    // A FIN or RST with a payload is no better.
    craft(&c, "t-deny", "c4", &remote.ip, 40001, "FA");
    craft(&c, "t-deny", "c5", &remote.ip, 40001, "R");
    std::thread::sleep(Duration::from_secs(1));
    let (from_deny, from_allow, from_open) = (
        arrived(&remote, 40001),
        arrived(&remote, 40002),
        arrived(&remote, 40003),
    );
    eprintln!(
        "crafted segments arrived: deny {from_deny}, allow-list {from_allow}, open {from_open}"
    );
    assert_eq!(
        from_open,
        5,
        "open: every crafted segment must arrive (the control)\n{}",
        ns_state(&open)
    );
    assert_eq!(
        from_deny,
        0,
        "deny: a crafted segment got out\n{}",
        ns_state(&deny)
    );
    assert_eq!(
        from_allow,
        0,
        "allow-list: a crafted segment to a port it does not name got out\n{}",
        ns_state(&allow)
    );

    for id in ["t-allow", "t-deny", "t-open"] {
        kill_and_remove(&c, id);
    }
    c.assert_clean(CLEAN);
    assert_namespace_clean(&allow);
    assert_namespace_clean(&deny);
    assert_namespace_clean(&open);
}

#[test]
fn burrow_container_has_the_cni_address_and_moves_100_mb_each_way() {
    container_network(RUNTIME, "net", 61);
}

#[test]
fn runc_control_in_the_same_network() {
    container_network("io.containerd.runc.v2", "netrunc", 62);
}

#[test]
fn without_cni_the_guest_has_loopback_only() {
    // `ctr run` asks for a new, unnamed namespace: the shim makes one, and
    // with nothing added to it the guest's NIC stays down, unaddressed.
    let c = Containerd::nested("nonet");
    let r = c.ctr(&burrow_tests::containerd::run(
        &["--rm"],
        "t-nonet",
        &["sh", "-c", "ip -o addr; echo routes:; ip route; ip -o link"],
    ));
    assert_eq!(r.code, Some(0), "{r:?}\n{}", c.diagnostics());
    let (addrs, routes) = r.stdout.split_once("routes:").unwrap();
    let addrs: Vec<&str> = addrs.lines().filter(|l| l.contains("inet")).collect();
    assert!(
        !addrs.is_empty() && addrs.iter().all(|l| l.contains("scope host")),
        "addresses on lo only: {}",
        r.stdout
    );
    assert!(
        !routes.lines().any(|l| l.contains(" dev ")),
        "no routes: {}",
        r.stdout
    );
    assert!(
        !r.stdout
            .lines()
            .any(|l| l.contains("link/ether") && l.contains(",UP")),
        "an Ethernet NIC is up without CNI: {}",
        r.stdout
    );
}

/// A template is no sandbox's: built by a container in a named namespace
/// (whose NIC a cold boot would configure from its kernel command line),
/// it carries none of that container's network, so a `ctr run` restored
/// from it has loopback only, while the builder has its CNI address.
#[test]
fn a_template_built_in_a_named_namespace_carries_none_of_its_network() {
    let templates = burrow_tests::scratch_dir("net-templates");
    let c = Containerd::start(
        "tmplnet",
        &format!(
            "templates = true\ntemplate_dir = {:?}\n{}",
            templates.display().to_string(),
            burrow_tests::containerd::NESTED_CONFIG
        ),
    );
    let ns = CniNetns::add("burrow-tmplnet", 69);
    run_sh_in(&c, &ns, "t-builder", "open", "exec sleep 100000");
    let phases = c.start_phases("t-builder");
    assert!(
        phases.starts_with("created from a template (built)"),
        "the first container builds the template: {phases}"
    );
    assert_cni_address(&c, "t-builder", &ns);
    const RESTORED: &str = "created from a template (restored)";
    let before = c.log_count(RESTORED);
    let r = c.ctr(&burrow_tests::containerd::run(
        &["--rm"],
        "t-after",
        &["sh", "-c", "ip -o addr; echo routes:; ip route"],
    ));
    assert_eq!(r.code, Some(0), "{r:?}\n{}", c.diagnostics());
    assert_eq!(
        c.log_count(RESTORED),
        before + 1,
        "the second container is restored from the builder's template"
    );
    let (addrs, routes) = r.stdout.split_once("routes:").unwrap();
    let inet: Vec<&str> = addrs.lines().filter(|l| l.contains("inet")).collect();
    assert!(
        !inet.is_empty() && inet.iter().all(|l| l.contains("scope host")),
        "a VM from the template has loopback only, not the builder's {}: {}",
        ns.ip,
        r.stdout
    );
    assert!(!routes.contains(" dev "), "no routes: {}", r.stdout);
    kill_and_remove(&c, "t-builder");
    c.assert_clean(CLEAN);
    assert_namespace_clean(&ns);
    let _ = std::fs::remove_dir_all(&templates);
}

/// `ctr run --cni` under `runtime`: the container gets the address CNI
/// gave the namespace of the task pid, serves the test host on it and
/// reaches the test host; once the task is killed ctr's CNI DEL releases
/// the address and nothing is left.
fn ctr_run_cni(c: &Containerd, cni: &CtrCni, runtime: &str, id: &str, gateway: &str, remote: &str) {
    let run = c.spawn_ctr(&[
        "run",
        "--rm",
        "--cni",
        "--runtime",
        runtime,
        IMAGE,
        id,
        "sh",
        "-c",
        SERVE,
    ]);
    c.wait_status(id, "RUNNING", LONG);
    let leases = cni.leases();
    assert_eq!(leases.len(), 1, "{runtime}: one address leased: {leases:?}");
    let ip = &leases[0];

    // The task pid names a host process in the namespace CNI filled.
    let pid = c
        .ctr(&["task", "ls"])
        .stdout
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.first() == Some(&id)).then(|| f.get(1)?.parse::<i32>().ok())?
        })
        .expect("ctr task ls shows the task's pid");
    let in_ns = sh_ok(&format!("nsenter -t {pid} -n ip -o -4 addr show dev eth0"));
    assert!(
        in_ns.contains(&format!("inet {ip}/24")),
        "{runtime}: the task pid's namespace has the CNI address {ip}: {in_ns}"
    );

    // The container has it, and the route through the bridge.
    let addr = c.exec_ok(
        id,
        "addr",
        &["ip", "-o", "-4", "addr", "show", "dev", "eth0"],
    );
    assert!(
        addr.contains(&format!("inet {ip}/24")),
        "{runtime}: eth0 in the container has {ip}: {addr}"
    );
    let route = c.exec_ok(id, "route", &["ip", "route"]);
    assert!(route.contains(&format!("default via {gateway}")), "{route}");
    let ps = c.ctr(&["task", "ps", id]);
    assert!(
        ps.stdout.lines().skip(1).any(|l| l
            .split_whitespace()
            .next()
            .is_some_and(|p| p.parse::<u32>().is_ok())),
        "{runtime}: ctr task ps lists the container's processes: {ps:?}"
    );
    // The test host reaches its server; it reaches a server elsewhere.
    let got = sh_ok(&format!("wget -q -T 60 -O - http://{ip}:8080/small"));
    assert_eq!(got.trim(), "small", "{runtime}: into the container");
    assert!(
        fetch(
            c,
            id,
            "out",
            &format!("http://{remote}:{CTR_CNI_PORT}/small"),
            "60"
        ),
        "{runtime}: out of the container"
    );

    assert_eq!(c.ctr(&["task", "kill", "-s", "KILL", id]).code, Some(0));
    let (out, killed) = burrow_tests::containerd::wait_output(run, LONG);
    assert!(!killed, "{runtime}: ctr run did not end after the kill");
    eprintln!("ctr run --cni {runtime}: {out:?}");
    assert_eq!(
        cni.leases(),
        Vec::<String>::new(),
        "{runtime}: CNI DEL released the address"
    );
    let veths = sh_ok(&format!("ip -o link show master {}", cni.bridge));
    assert!(
        veths.trim().is_empty(),
        "{runtime}: a veth is left: {veths}"
    );
    if runtime == RUNTIME {
        assert!(
            !burrow_tests::containerd::process_running(pid),
            "the namespace holder {pid} outlived the task"
        );
        c.assert_clean(CLEAN);
    }
}

#[test]
fn ctr_run_cni_configures_the_namespace_of_the_task_pid() {
    let c = Containerd::nested("ctrcni");
    let cni = CtrCni::install(65);
    let gateway = "10.88.65.1";
    let www = c.dir.join("www");
    std::fs::create_dir_all(&www).unwrap();
    std::fs::write(www.join("small"), "small\n").unwrap();
    let remote = Remote::add("burrow-ctrcni-r", 65);
    let _server = remote.serve(&www, CTR_CNI_PORT);
    ctr_run_cni(
        &c,
        &cni,
        "io.containerd.runc.v2",
        "t-cni-runc",
        gateway,
        &remote.ip,
    );
    ctr_run_cni(&c, &cni, RUNTIME, "t-cni", gateway, &remote.ip);
}

/// One line through the echo server at `s`: what comes back.
fn echo(s: &mut std::net::TcpStream, line: &str) -> String {
    use std::io::BufRead;
    s.write_all(format!("{line}\n").as_bytes()).unwrap();
    let mut r = std::io::BufReader::new(s.try_clone().unwrap());
    let mut got = String::new();
    let _ = r.read_line(&mut got);
    got.trim_end().to_string()
}

#[test]
fn a_tcp_connection_from_the_test_host_survives_hibernation_checkpoint_and_restore() {
    let c = Containerd::nested("nettcp");
    let ns = CniNetns::add("burrow-nettcp", 66);
    let id = "t-tcp";
    let with_ns = format!("network:{}", ns.path());
    let echo_server = ["sh", "-c", "exec nc -l -p 9000 -e cat"];
    // Egress denied: the echoes leave only as packets of the flow the test
    // host opened, recorded on the host side of the tap.
    let mut args = vec![
        "run",
        "-d",
        "--runtime",
        RUNTIME,
        "--with-ns",
        &with_ns,
        "--annotation",
        "io.burrow.egress=deny",
        IMAGE,
        id,
    ];
    args.extend(echo_server);
    let r = c.ctr(&args);
    assert_eq!(r.code, Some(0), "{r:?}\n{}", c.diagnostics());
    c.wait_status(id, "RUNNING", LONG);

    // The test host connects once; every step below reuses the connection.
    let addr: std::net::SocketAddr = format!("{}:9000", ns.ip).parse().unwrap();
    let t = Instant::now();
    let mut conn = loop {
        match std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(10)) {
            Ok(s) => break s,
            Err(e) => {
                assert!(t.elapsed() < LONG, "connecting to {addr}: {e}");
                std::thread::sleep(Duration::from_secs(1));
            }
        }
    };
    conn.set_read_timeout(Some(Duration::from_secs(300)))
        .unwrap();
    assert_eq!(echo(&mut conn, "one"), "one");

    // Hibernate: the VMM goes; the next call wakes it.
    let state_dir = c.burrow_state().display().to_string();
    let h = c.burrow(&["sandbox", "hibernate", "--state-dir", &state_dir, id]);
    assert_eq!(h.code, Some(0), "hibernate: {h:?}\n{}", c.diagnostics());
    c.exec_ok(id, "wake", &["true"]);
    assert_eq!(echo(&mut conn, "two"), "two", "after hibernate and wake");

    // Checkpoint, then the VMM is SIGKILLed (no FIN or RST leaves the
    // guest); after delete nothing is left in the namespace.
    let cp = c.ctr(&["containers", "checkpoint", "--task", "--rw", id, "tcp-cp"]);
    assert_eq!(cp.code, Some(0), "checkpoint: {cp:?}\n{}", c.diagnostics());
    let vmm = c.vmm_pid(id);
    // SAFETY: kill(2) has no memory-safety preconditions.
    assert_eq!(unsafe { libc::kill(vmm, libc::SIGKILL) }, 0);
    c.wait_status(id, "STOPPED", LONG);
    assert_eq!(c.ctr(&["task", "delete", id]).code, Some(0));
    assert_eq!(c.ctr(&["containers", "delete", id]).code, Some(0));
    c.assert_clean(CLEAN);
    assert_namespace_clean(&ns);

    // Restored into the same namespace: the same connection carries on.
    let r = c.ctr(&["containers", "restore", "--live", "t-tcp2", "tcp-cp"]);
    assert_eq!(r.code, Some(0), "restore: {r:?}\n{}", c.diagnostics());
    c.wait_status("t-tcp2", "RUNNING", LONG);
    assert_eq!(
        echo(&mut conn, "three"),
        "three",
        "after checkpoint and restore"
    );

    // Checkpointed by name and restored into another namespace: the guest
    // takes that namespace's address and routes, keeps none of the first
    // one's, and reaches a server elsewhere from there (not the test host:
    // the node's own addresses are closed to a guest). (The connection
    // stays open until the end: closed, its `nc` and so the container
    // would end.)
    let ns2 = CniNetns::add("burrow-nettcp2", 70);
    let remote = Remote::add("burrow-rnettcp", 70);
    let named = c.burrow(&["sandbox", "checkpoint", "--state-dir", &state_dir, "t-tcp2", "moved"]);
    assert_eq!(named.code, Some(0), "checkpoint: {named:?}\n{}", c.diagnostics());
    kill_and_remove(&c, "t-tcp2");
    let www = c.dir.join("www");
    std::fs::create_dir_all(&www).unwrap();
    std::fs::write(www.join("small"), "small\n").unwrap();
    let _server = remote.serve(&www, 8081);
    let with_ns2 = format!("network:{}", ns2.path());
    let r = c.ctr(&[
        "run",
        "-d",
        "--runtime",
        RUNTIME,
        "--with-ns",
        &with_ns2,
        "--annotation",
        "io.burrow.restore=moved",
        IMAGE,
        "t-tcp3",
        "true",
    ]);
    assert_eq!(r.code, Some(0), "restore into {}: {r:?}\n{}", ns2.name, c.diagnostics());
    c.wait_status("t-tcp3", "RUNNING", LONG);
    assert_cni_address(&c, "t-tcp3", &ns2);
    let addrs = c.exec_ok("t-tcp3", "addrs", &["ip", "-o", "-4", "addr", "show", "dev", "eth0"]);
    assert!(
        !addrs.contains(&format!("inet {}/", ns.ip)),
        "the first namespace's address {} is gone: {addrs}",
        ns.ip
    );
    let url = format!("http://{}:8081/small", remote.ip);
    assert!(
        fetch(&c, "t-tcp3", "f1", &url, "120"),
        "the restored guest reaches {url} from its new address\n{}",
        ns_state(&ns2)
    );

    drop(conn);
    kill_and_remove(&c, "t-tcp3");
    std::fs::remove_dir_all(c.snapshot_dir().join(".checkpoints").join("moved")).unwrap();
    c.assert_clean(CLEAN);
    assert_namespace_clean(&ns);
    assert_namespace_clean(&ns2);
}

/// Bytes the guest's NIC has handed the tap so far (the tap's rx).
fn tap_bytes(ns: &CniNetns) -> u64 {
    sh_ok(&format!(
        "ip netns exec {} cat /sys/class/net/burrow0/statistics/rx_bytes",
        ns.name
    ))
    .trim()
    .parse()
    .unwrap()
}

#[test]
fn a_guest_flooding_its_nic_cannot_starve_the_vmm_control_api() {
    let c = Containerd::nested("netflood");
    let ns = CniNetns::add("burrow-netflood", 67);
    let remote = Remote::add("burrow-rnetflood", 67);
    let id = "t-flood";
    // A sink elsewhere, and two blasters in the guest sending it zeros as
    // fast as its NIC takes them (busybox's nc has no UDP: TCP it is).
    let _sink = KillOnDrop(
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &remote.name,
                "busybox",
                "nc",
                "-ll",
                "-p",
                "9000",
            ])
            .args(["-e", "sh", "-c", "cat > /dev/null"])
            .spawn()
            .unwrap(),
    );
    let flood = format!(
        "for i in 1 2; do (while true; do cat /dev/zero | nc {} 9000; sleep 0.2; done) & done; exec sleep 100000",
        remote.ip
    );
    run_sh_in(&c, &ns, id, "open", &flood);
    // Flooding: over 1 MiB through its tap within 20 s. Not a rate: the
    // test host's emulated CPUs, shared with other tests, moved 0.7 MiB in
    // one 3 s window and 20+ MiB in another.
    let flowing = |what: &str| {
        let before = tap_bytes(&ns);
        let t = std::time::Instant::now();
        let mut after = before;
        while after <= before + (1 << 20) && t.elapsed() < Duration::from_secs(20) {
            std::thread::sleep(Duration::from_millis(500));
            after = tap_bytes(&ns);
        }
        eprintln!("netflood {what}: {} bytes in {:.1} s", after - before, t.elapsed().as_secs_f64());
        assert!(
            after > before + (1 << 20),
            "{what}: the guest is not flooding its NIC ({before} -> {after} bytes in 20 s)\n{}",
            ns_state(&ns)
        );
    };
    flowing("before hibernating");

    // The VMM's control API answers through the flood: a snapshot
    // (hibernation) completes, and the VM wakes with the flood going on.
    let state_dir = c.burrow_state().display().to_string();
    let h = c.burrow(&["sandbox", "hibernate", "--state-dir", &state_dir, id]);
    assert!(
        h.code == Some(0) && !h.timed_out,
        "hibernate during a tx flood: {h:?}\n{}",
        c.diagnostics()
    );
    let got = c.exec_ok(id, "wake", &["pidof", "nc"]);
    assert!(
        !got.trim().is_empty() && got.split_whitespace().all(|p| p.parse::<u32>().is_ok()),
        "the blasters went on after the wake: {got:?}"
    );
    flowing("after the wake");
    // A checkpoint of the running VM (a snapshot, then it runs on).
    let cp = c.burrow(&[
        "sandbox",
        "checkpoint",
        "--state-dir",
        &state_dir,
        id,
        "flood-cp",
    ]);
    assert!(
        cp.code == Some(0) && !cp.timed_out,
        "checkpoint during a tx flood: {cp:?}\n{}",
        c.diagnostics()
    );
    flowing("after the checkpoint");

    kill_and_remove(&c, id);
    c.assert_clean(CLEAN);
    assert_namespace_clean(&ns);
}
