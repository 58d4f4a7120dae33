//! `burrow-vmm`'s command line: the shim builds a [`VmmArgs`] and turns it
//! into argv with [`VmmArgs::to_argv`]; the VMM parses argv back into the
//! same type with clap ([`Cli`]).
//!
//! `burrow-vmm run --kernel PATH [--initrd PATH] [--cmdline STR] [--append STR]...
//! [--disk PATH[:ro]]... [--disk-slots N] [--net fd=N|tap=NAME,mac=MAC] [--vsock PATH] [--cid N]
//! [--vcpus N] [--mem MiB]
//! [--serial-log PATH] [--api PATH] [--paused] [--exit-with-parent]` boots a VM;
//! `burrow-vmm run --restore DIR [--disk PATH]... [--vsock PATH]
//! [--serial-log PATH] [--api PATH] [--paused] [--exit-with-parent]` rebuilds one from a
//! snapshot directory; `burrow-vmm probe` checks that /dev/kvm runs guest
//! code.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{Parser, Subcommand};

/// The guest kernel command line both the VMM (when given none) and the
/// shim (its `kernel_cmdline` default) use: serial console; reset through
/// the i8042 for reboot (and a panic reboots after 1 s, which the VMM
/// reports as a panic, not a clean exit); no PCI, no modules; no i8042
/// probing of an AUX port, a multiplexer or a real keyboard (each probe
/// costs boot time and the VMM's i8042 has none of them); `quiet`: only
/// errors reach the console while booting (every byte through the emulated
/// UART is a VM exit: the boot log's flush cost 3.3 s of a nested cold
/// boot). The whole log stays in the guest's /dev/kmsg.
pub const BASE_CMDLINE: &str =
    "console=ttyS0 quiet reboot=k panic=1 pci=off nomodule i8042.noaux i8042.nomux i8042.dumbkbd";

/// Default guest vsock CID.
pub const DEFAULT_CID: u64 = 3;
/// Default vCPU count.
pub const DEFAULT_VCPUS: u8 = 1;
/// Default guest memory in MiB.
pub const DEFAULT_MEM_MIB: u64 = 256;
/// Default cap of each serial log file (`PATH` and its rotation `PATH.1`).
pub const DEFAULT_SERIAL_LOG_MAX: u64 = 8 << 20;
/// Default cap of the VMM's own log (stderr).
pub const DEFAULT_LOG_MAX: u64 = 16 << 20;

#[derive(Debug, Parser)]
#[command(
    name = "burrow-vmm",
    about = "burrow's VMM: one KVM microVM per process"
)]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: VmmCommand,
}

impl Cli {
    /// Parse the process's arguments (printing help or the error and
    /// exiting as clap does when they do not parse).
    pub fn from_env() -> VmmCommand {
        <Self as Parser>::parse().cmd
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Subcommand)]
pub enum VmmCommand {
    /// Boot (or restore) a VM and run it until it exits.
    Run(Box<VmmArgs>),
    /// Run a tiny real-mode guest to check that /dev/kvm runs guest code.
    Probe,
}

/// `burrow-vmm run`'s arguments.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct VmmArgs {
    /// Uncompressed ELF kernel (vmlinux); PVH entry used when present.
    #[arg(long, required_unless_present = "restore")]
    pub kernel: Option<PathBuf>,
    /// Restore the VM from this snapshot directory (`state` + `memory`)
    /// instead of booting. `--disk` then replaces the recorded disk paths
    /// (in order; sizes must match; the read-only flag comes from the
    /// snapshot), and after them those of the filled block slots (in slot
    /// order), `--vsock` the recorded socket path.
    #[arg(long, conflicts_with_all = ["kernel", "initrd", "cmdline", "append", "vcpus", "max_vcpus", "mem_mib", "mem_max_mib", "cid", "disk_slots"])]
    pub restore: Option<PathBuf>,
    /// With `--restore`: the snapshot is untrusted and must be
    /// self-contained: no base snapshot (incremental chain), no file
    /// attached to a disk slot, no tap opened by its recorded name (pass
    /// `--net`). Checked before anything it names is opened.
    #[arg(long, requires = "restore")]
    pub self_contained: bool,
    /// With `--restore`: the snapshot must have exactly this many vCPUs.
    #[arg(long, requires = "restore")]
    pub expect_vcpus: Option<u8>,
    /// With `--restore`: the snapshot must have exactly this much memory
    /// (MiB), the size the caller checked against its limits.
    #[arg(long = "expect-mem", requires = "restore")]
    pub expect_mem_mib: Option<u64>,
    /// With `--restore` and `--expect-mem`: the snapshot's `--mem-max`
    /// must be exactly this (MiB); without it, `--expect-mem` refuses a
    /// snapshot with hotplug memory (which could grow past what the caller
    /// checked).
    #[arg(long = "expect-mem-max", requires = "expect_mem_mib")]
    pub expect_mem_max_mib: Option<u64>,
    /// With `--restore`: an inherited descriptor of a packed memory file
    /// whose data `DIR/memory.map` places (`burrow_vmm_api::memory_map`),
    /// mapped privately over `DIR/memory` (then all holes) instead of
    /// being unpacked first: a restore reads no memory up front.
    #[arg(long, requires = "restore")]
    pub packed_memory_fd: Option<i32>,
    /// initramfs (newc cpio, optionally compressed as the kernel supports).
    #[arg(long)]
    pub initrd: Option<PathBuf>,
    /// Kernel command line (virtio-mmio device entries are appended).
    #[arg(long, default_value = BASE_CMDLINE)]
    pub cmdline: String,
    /// Extra arguments appended to the command line; repeatable.
    #[arg(long)]
    pub append: Vec<String>,
    /// Raw disk image, `PATH` (read-write) or `PATH:ro`; repeatable.
    #[arg(long = "disk")]
    pub disks: Vec<DiskArg>,
    /// The guest NIC: `fd=N,mac=MAC` (an inherited tap) or
    /// `tap=NAME,mac=MAC`; on a restore it replaces the recorded tap.
    #[arg(long)]
    pub net: Option<crate::NetArg>,
    /// Empty block slots after the disks (guest `vd*` in that order, serial
    /// `burrow-slot-<n>`), filled and emptied through the control API.
    #[arg(long, default_value_t = 0)]
    pub disk_slots: u32,
    /// Host side of vsock: unix socket path (guest connections go to PATH_<port>).
    #[arg(long)]
    pub vsock: Option<PathBuf>,
    /// Guest vsock CID.
    #[arg(long, default_value_t = DEFAULT_CID)]
    pub cid: u64,
    /// vCPUs that run from boot.
    #[arg(long, default_value_t = DEFAULT_VCPUS)]
    pub vcpus: u8,
    /// vCPUs the VM has room for (default: `--vcpus`). Those past
    /// `--vcpus` are present to the guest (MP table) but not started
    /// (`maxcpus=` on its command line) and never run until the control
    /// API's `set_vcpus` grants them: a guest that tries to start one on
    /// its own gets no answer.
    #[arg(long)]
    pub max_vcpus: Option<u8>,
    /// Guest memory in MiB.
    #[arg(long = "mem", default_value_t = DEFAULT_MEM_MIB)]
    pub mem_mib: u64,
    /// Largest guest memory in MiB the control API's `resize_memory` may
    /// grow the VM to (virtio-mem; costs nothing until used). Absent: no
    /// virtio-mem device, the memory stays `--mem`.
    #[arg(long = "mem-max")]
    pub mem_max_mib: Option<u64>,
    /// Write the serial console to this file instead of stdout.
    #[arg(long)]
    pub serial_log: Option<PathBuf>,
    /// Cap of the serial log file in bytes: past it the file is rotated to
    /// `PATH.1` (so the guest can make it use at most twice this).
    #[arg(long, default_value_t = DEFAULT_SERIAL_LOG_MAX)]
    pub serial_log_max: u64,
    /// Cap of the VMM's own log (stderr) in bytes; later messages are
    /// dropped, after one line that says so.
    #[arg(long, default_value_t = DEFAULT_LOG_MAX)]
    pub log_max: u64,
    /// Control API socket (JSON lines, see [`crate::messages`]).
    #[arg(long)]
    pub api: Option<PathBuf>,
    /// Wait for a `start` command on the API socket before running vCPUs.
    #[arg(long, requires = "api")]
    pub paused: bool,
    /// Stop the VM (exit 1) when the process that started the VMM exits:
    /// a shim that dies leaves no VM behind. The shim always passes it.
    #[arg(long)]
    pub exit_with_parent: bool,
    /// Kick every vCPU out of KVM_RUN this often (ms; 0: never, the
    /// default) when the VM has more than one. Only for the nested test
    /// host, whose emulated SVM now and then loses the wakeup of a halted
    /// vCPU (an IPI), stalling the guest until something else kicks it;
    /// hardware KVM never needs it, and it wakes an idle VM.
    #[arg(long, default_value_t = 0)]
    pub vcpu_kick_ms: u32,
    /// Confinement: see [`crate::jail`].
    #[command(flatten)]
    pub jail: crate::jail::JailArgs,
}

impl VmmArgs {
    /// Boot `kernel` with the defaults (base command line, 1 vCPU, 256 MiB).
    pub fn boot(kernel: PathBuf) -> Self {
        Self {
            kernel: Some(kernel),
            restore: None,
            self_contained: false,
            expect_vcpus: None,
            expect_mem_mib: None,
            expect_mem_max_mib: None,
            packed_memory_fd: None,
            initrd: None,
            cmdline: BASE_CMDLINE.into(),
            append: Vec::new(),
            disks: Vec::new(),
            net: None,
            disk_slots: 0,
            vsock: None,
            cid: DEFAULT_CID,
            vcpus: DEFAULT_VCPUS,
            max_vcpus: None,
            mem_mib: DEFAULT_MEM_MIB,
            mem_max_mib: None,
            serial_log: None,
            serial_log_max: DEFAULT_SERIAL_LOG_MAX,
            log_max: DEFAULT_LOG_MAX,
            api: None,
            paused: false,
            exit_with_parent: false,
            vcpu_kick_ms: 0,
            jail: crate::jail::JailArgs::default(),
        }
    }

    /// Restore the snapshot in `dir` (its size, kernel and command line
    /// come from the snapshot).
    pub fn restore(dir: PathBuf) -> Self {
        Self {
            kernel: None,
            restore: Some(dir),
            ..Self::boot(PathBuf::new())
        }
    }

    /// The arguments after the binary's name, starting with `run`. On a
    /// restore the boot-only fields (kernel, initrd, command line, CID,
    /// size) are not passed: the snapshot has them.
    pub fn to_argv(&self) -> Vec<OsString> {
        let mut a: Vec<OsString> = vec!["run".into()];
        let mut flag = |name: &str, value: OsString| {
            a.push(format!("--{name}").into());
            a.push(value);
        };
        match &self.restore {
            Some(dir) => {
                flag("restore", dir.into());
                if let Some(v) = self.expect_vcpus {
                    flag("expect-vcpus", v.to_string().into());
                }
                if let Some(m) = self.expect_mem_mib {
                    flag("expect-mem", m.to_string().into());
                }
                if let Some(m) = self.expect_mem_max_mib {
                    flag("expect-mem-max", m.to_string().into());
                }
                if let Some(fd) = self.packed_memory_fd {
                    flag("packed-memory-fd", fd.to_string().into());
                }
            }
            None => {
                if let Some(k) = &self.kernel {
                    flag("kernel", k.into());
                }
                if let Some(i) = &self.initrd {
                    flag("initrd", i.into());
                }
                flag("cmdline", self.cmdline.clone().into());
                for extra in &self.append {
                    flag("append", extra.into());
                }
                flag("cid", self.cid.to_string().into());
                flag("vcpus", self.vcpus.to_string().into());
                if let Some(m) = self.max_vcpus {
                    flag("max-vcpus", m.to_string().into());
                }
                flag("mem", self.mem_mib.to_string().into());
                if let Some(m) = self.mem_max_mib {
                    flag("mem-max", m.to_string().into());
                }
                if self.disk_slots > 0 {
                    flag("disk-slots", self.disk_slots.to_string().into());
                }
            }
        }
        for d in &self.disks {
            flag("disk", d.to_arg());
        }
        if let Some(n) = &self.net {
            flag("net", n.to_arg().into());
        }
        for (name, path) in [
            ("vsock", &self.vsock),
            ("serial-log", &self.serial_log),
            ("api", &self.api),
        ] {
            if let Some(p) = path {
                flag(name, p.into());
            }
        }
        if self.serial_log.is_some() && self.serial_log_max != DEFAULT_SERIAL_LOG_MAX {
            flag("serial-log-max", self.serial_log_max.to_string().into());
        }
        if self.log_max != DEFAULT_LOG_MAX {
            flag("log-max", self.log_max.to_string().into());
        }
        if self.vcpu_kick_ms != 0 {
            flag("vcpu-kick-ms", self.vcpu_kick_ms.to_string().into());
        }
        if self.restore.is_some() && self.self_contained {
            a.push("--self-contained".into());
        }
        if self.paused {
            a.push("--paused".into());
        }
        if self.exit_with_parent {
            a.push("--exit-with-parent".into());
        }
        self.jail.push_argv(&mut a);
        a
    }

    /// Parse `burrow-vmm`'s arguments (after the binary's name) as the VMM
    /// does.
    pub fn parse_argv<I, T>(argv: I) -> Result<VmmCommand, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let all =
            std::iter::once(OsString::from("burrow-vmm")).chain(argv.into_iter().map(Into::into));
        Cli::try_parse_from(all).map(|c| c.cmd)
    }
}

/// One `--disk`: `PATH` (read-write) or `PATH:ro`. A path that itself ends
/// in `:ro` or `:rw` is written with an explicit `:rw` so it parses back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskArg {
    pub path: PathBuf,
    pub read_only: bool,
}

impl DiskArg {
    fn to_arg(&self) -> OsString {
        let mut s = OsString::from(self.path.as_os_str());
        let ambiguous = {
            let b = self.path.as_os_str().as_encoded_bytes();
            b.ends_with(b":ro") || b.ends_with(b":rw")
        };
        if self.read_only {
            s.push(":ro");
        } else if ambiguous {
            s.push(":rw");
        }
        s
    }
}

impl std::str::FromStr for DiskArg {
    type Err = String;
    /// `PATH` or `PATH:ro` / `PATH:rw`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (path, read_only) = match s.rsplit_once(':') {
            Some((p, "ro")) => (p, true),
            Some((p, "rw")) => (p, false),
            _ => (s, false),
        };
        if path.is_empty() {
            return Err("empty disk path".into());
        }
        Ok(Self {
            path: path.into(),
            read_only,
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn round_trip(a: &VmmArgs) {
        let argv = a.to_argv();
        let parsed = VmmArgs::parse_argv(&argv).unwrap_or_else(|e| panic!("{argv:?}: {e}"));
        assert_eq!(parsed, VmmCommand::Run(Box::new(a.clone())), "{argv:?}");
    }

    #[test]
    fn boot_args_round_trip() {
        round_trip(&VmmArgs::boot("/k".into()));
        let a = VmmArgs {
            initrd: Some("/i".into()),
            cmdline: "console=ttyS0 quiet".into(),
            append: vec!["burrow.hostname=h".into(), "x y".into()],
            disks: vec![
                DiskArg {
                    path: "/d".into(),
                    read_only: false,
                },
                DiskArg {
                    path: "/r".into(),
                    read_only: true,
                },
                DiskArg {
                    path: "/odd:ro".into(),
                    read_only: false,
                },
            ],
            net: Some("fd=5,mac=02:00:00:00:00:07".parse().unwrap()),
            vsock: Some("/s/v".into()),
            cid: 7,
            vcpus: 4,
            max_vcpus: Some(6),
            mem_mib: 1024,
            mem_max_mib: Some(4096),
            serial_log: Some("/s/console log".into()),
            api: Some("/s/a".into()),
            paused: true,
            disk_slots: 3,
            ..VmmArgs::boot("/k".into())
        };
        round_trip(&a);
        let argv: Vec<String> = a
            .to_argv()
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        assert!(
            argv.windows(2).any(|w| w == ["--disk", "/r:ro"]),
            "{argv:?}"
        );
        assert!(
            argv.windows(2).any(|w| w == ["--disk", "/odd:ro:rw"]),
            "{argv:?}"
        );
        assert!(
            argv.windows(2).any(|w| w == ["--disk-slots", "3"]),
            "{argv:?}"
        );
        // The snapshot has its slots: a restore takes none.
        assert!(VmmArgs::parse_argv(["run", "--restore", "/s", "--disk-slots", "2"]).is_err());
    }

    #[test]
    fn restore_args_round_trip() {
        let a = VmmArgs {
            disks: vec![DiskArg {
                path: "/d".into(),
                read_only: false,
            }],
            vsock: Some("/s/v".into()),
            serial_log: Some("/s/c".into()),
            api: Some("/s/a".into()),
            self_contained: true,
            expect_vcpus: Some(2),
            expect_mem_mib: Some(512),
            expect_mem_max_mib: Some(2048),
            packed_memory_fd: Some(7),
            ..VmmArgs::restore("/snap/vm-3".into())
        };
        round_trip(&a);
        let argv = a.to_argv();
        assert!(
            !argv
                .iter()
                .any(|s| s == "--kernel" || s == "--vcpus" || s == "--cmdline"),
            "{argv:?}"
        );
    }

    #[test]
    fn parser_refuses_what_the_vmm_cannot_do() {
        assert!(
            VmmArgs::parse_argv(["run"]).is_err(),
            "kernel or restore is required"
        );
        assert!(VmmArgs::parse_argv(["run", "--restore", "/s", "--vcpus", "2"]).is_err());
        assert!(VmmArgs::parse_argv(["run", "--restore", "/s", "--max-vcpus", "2"]).is_err());
        assert!(VmmArgs::parse_argv(["run", "--restore", "/s", "--mem-max", "2048"]).is_err());
        assert!(
            VmmArgs::parse_argv(["run", "--kernel", "/k", "--paused"]).is_err(),
            "--paused needs --api"
        );
        assert!(VmmArgs::parse_argv(["run", "--kernel", "/k", "--disk", ":ro"]).is_err());
        assert!(VmmArgs::parse_argv(["run", "--kernel", "/k", "--vcpus", "300"]).is_err());
        assert_eq!(VmmArgs::parse_argv(["probe"]).unwrap(), VmmCommand::Probe);
    }

    #[test]
    fn disk_specs() {
        let d: DiskArg = "/a/b.img:ro".parse().unwrap();
        assert_eq!(
            d,
            DiskArg {
                path: "/a/b.img".into(),
                read_only: true
            }
        );
        let d: DiskArg = "/a/b.img".parse().unwrap();
        assert!(!d.read_only);
        let d: DiskArg = "/a:b.img".parse().unwrap();
        assert_eq!(d.path, PathBuf::from("/a:b.img"));
    }

    #[test]
    fn base_cmdline_keeps_the_i8042_flags() {
        for f in [
            "console=ttyS0",
            "quiet",
            "reboot=k",
            "i8042.noaux",
            "i8042.nomux",
            "i8042.dumbkbd",
        ] {
            assert!(BASE_CMDLINE.split(' ').any(|w| w == f), "{f}");
        }
    }
}
