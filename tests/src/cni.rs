//! CNI networks for the tests, inside the test host: a network namespace
//! with Debian's `bridge` + `host-local` plugins run on it (as CRI does for
//! a pod), and the config `ctr run --cni` reads.

#![allow(clippy::unwrap_used)]

use std::io::Write;
use std::process::{Command, Stdio};

/// Where Debian's containernetworking-plugins are.
pub const CNI_BIN: &str = "/usr/lib/cni";

/// Run `cmd` with sh: whether it succeeded, its stdout and stderr.
pub fn sh(cmd: &str) -> (bool, String) {
    let o = Command::new("sh").args(["-c", cmd]).output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    (o.status.success(), text)
}

pub fn sh_ok(cmd: &str) -> String {
    let (ok, out) = sh(cmd);
    assert!(ok, "{cmd}: {out}");
    out
}

/// The bridge plugin's config: bridge `bridge` as the gateway of
/// 10.88.`octet`.0/24, addresses from host-local keeping its leases in
/// `data`.
fn bridge_plugin(bridge: &str, octet: u8, data: &str) -> serde_json::Value {
    serde_json::json!({
        "type": "bridge",
        "bridge": bridge,
        "isGateway": true,
        "ipMasq": false,
        "ipam": {
            "type": "host-local",
            "subnet": format!("10.88.{octet}.0/24"),
            "routes": [{"dst": "0.0.0.0/0"}],
            "dataDir": data,
        },
    })
}

/// A network namespace with a CNI bridge network attached, as CRI makes
/// one for a pod; removed (CNI DEL, namespace, bridge) when dropped.
pub struct CniNetns {
    pub name: String,
    pub bridge: String,
    conf: String,
    pub ip: String,
    pub gateway: String,
}

impl CniNetns {
    pub fn add(name: &str, octet: u8) -> Self {
        assert!(
            std::path::Path::new(CNI_BIN).join("bridge").exists(),
            "{CNI_BIN}/bridge is missing: apt-get install containernetworking-plugins (hack/packages)"
        );
        // The nftables pieces burrow's shim uses; autoloading would do
        // too, this says which ones when they are missing.
        for m in ["nf_tables", "nft_fwd_netdev"] {
            let _ = sh(&format!("modprobe {m}"));
        }
        let bridge = format!("bcni{octet}");
        let data = format!("/run/burrow-test-cni/{name}");
        let mut conf = bridge_plugin(&bridge, octet, &data);
        conf["cniVersion"] = "1.0.0".into();
        conf["name"] = format!("burrow-{name}").into();
        let conf = conf.to_string();
        let _ = sh(&format!(
            "ip netns del {name}; ip link del {bridge}; rm -rf {data}"
        ));
        sh_ok(&format!(
            "ip netns add {name} && ip -n {name} link set lo up"
        ));
        let mut ns = Self {
            name: name.into(),
            bridge,
            conf,
            ip: String::new(),
            gateway: String::new(),
        };
        let result: serde_json::Value = serde_json::from_str(&ns.cni("ADD")).unwrap();
        let ip = &result["ips"][0];
        ns.ip = ip["address"]
            .as_str()
            .unwrap()
            .split('/')
            .next()
            .unwrap()
            .to_string();
        ns.gateway = ip["gateway"].as_str().unwrap().to_string();
        // The stand-in cloud metadata service: the test host answers on it.
        sh_ok(&format!("ip addr add 169.254.169.254/32 dev {}", ns.bridge));
        ns
    }

    pub fn path(&self) -> String {
        format!("/var/run/netns/{}", self.name)
    }

    /// Run the bridge plugin; its stdout (the CNI result).
    pub fn cni(&self, command: &str) -> String {
        let mut child = Command::new(format!("{CNI_BIN}/bridge"))
            .env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", &self.name)
            .env("CNI_NETNS", self.path())
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", CNI_BIN)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(self.conf.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "CNI {command}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    }
}

impl Drop for CniNetns {
    fn drop(&mut self) {
        if std::path::Path::new(&self.path()).exists() {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.cni("DEL")));
        }
        let _ = sh(&format!(
            "ip netns del {}; ip link del {}",
            self.name, self.bridge
        ));
    }
}

/// ctr's CNI setup: a bridge + host-local conflist first in
/// `/etc/cni/net.d` and the plugins in `/opt/cni/bin` (go-cni's defaults;
/// ctr has no flags for them); removed when dropped.
pub struct CtrCni {
    made: Vec<std::path::PathBuf>,
    data: String,
    pub bridge: String,
}

pub const CTR_CNI_NET: &str = "burrow-ctr-cni";
/// The test host's server for this test (the others use 8081 and 8082).
pub const CTR_CNI_PORT: u16 = 8085;

impl CtrCni {
    pub fn install(octet: u8) -> Self {
        let bridge = format!("bcni{octet}");
        let data = "/run/burrow-test-cni/ctr".to_string();
        let _ = sh(&format!("ip link del {bridge}; rm -rf {data}"));
        let mut made = Vec::new();
        for dir in ["/etc/cni/net.d", "/opt/cni/bin"] {
            std::fs::create_dir_all(dir).unwrap();
        }
        for plugin in ["bridge", "host-local"] {
            let link = std::path::Path::new("/opt/cni/bin").join(plugin);
            if !link.exists() {
                std::os::unix::fs::symlink(format!("{CNI_BIN}/{plugin}"), &link).unwrap();
                made.push(link);
            }
        }
        let conf = serde_json::json!({
            "cniVersion": "1.0.0",
            "name": CTR_CNI_NET,
            "plugins": [bridge_plugin(&bridge, octet, &data)],
        });
        let path = std::path::PathBuf::from("/etc/cni/net.d/00-burrow-ctr-cni.conflist");
        std::fs::write(&path, conf.to_string()).unwrap();
        made.push(path);
        Self { made, data, bridge }
    }

    /// The addresses host-local has handed out and not released.
    pub fn leases(&self) -> Vec<String> {
        std::fs::read_dir(format!("{}/{CTR_CNI_NET}", self.data))
            .map(|d| {
                d.flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .filter(|n| n.parse::<std::net::Ipv4Addr>().is_ok())
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for CtrCni {
    fn drop(&mut self) {
        for p in &self.made {
            let _ = std::fs::remove_file(p);
        }
        let _ = sh(&format!(
            "ip link del {}; rm -rf {}",
            self.bridge, self.data
        ));
    }
}

/// A namespace standing for a server elsewhere on the network: the
/// containers reach it through the test host's routing, not on one of the
/// test host's own addresses (which burrow's egress policy closes to new
/// connections from a guest, as a node's are). A veth pair,
/// 10.89.`octet`.1 on the test host and 10.89.`octet`.2 inside.
pub struct Remote {
    pub name: String,
    pub ip: String,
    veth: String,
}

impl Remote {
    pub fn add(name: &str, octet: u8) -> Self {
        let veth = format!("vrem{octet}");
        let _ = sh(&format!("ip netns del {name}; ip link del {veth}"));
        sh_ok(&format!(
            "ip netns add {name} && ip -n {name} link set lo up \
             && ip link add {veth} type veth peer name eth0 netns {name} \
             && ip addr add 10.89.{octet}.1/24 dev {veth} && ip link set {veth} up \
             && ip -n {name} addr add 10.89.{octet}.2/24 dev eth0 \
             && ip -n {name} link set eth0 up \
             && ip -n {name} route add default via 10.89.{octet}.1 \
             && sysctl -qw net.ipv4.ip_forward=1"
        ));
        Self {
            name: name.into(),
            ip: format!("10.89.{octet}.2"),
            veth,
        }
    }

    /// busybox httpd serving `dir` on `port` inside the namespace.
    pub fn serve(&self, dir: &std::path::Path, port: u16) -> crate::KillOnDrop {
        // `ip netns exec` execs the command: the child is httpd itself.
        let child = Command::new("ip")
            .args(["netns", "exec", &self.name, "busybox", "httpd", "-f", "-p"])
            .arg(port.to_string())
            .arg("-h")
            .arg(dir)
            .spawn()
            .unwrap();
        let server = crate::KillOnDrop(child);
        // Up before a client tries it.
        for _ in 0..50 {
            let listening = sh(&format!(
                "ip netns exec {} ss -Hltn sport = :{port}",
                self.name
            ));
            if listening.0 && !listening.1.trim().is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
        server
    }
}

impl Drop for Remote {
    fn drop(&mut self) {
        let _ = sh(&format!(
            "ip netns del {}; ip link del {}",
            self.name, self.veth
        ));
    }
}
