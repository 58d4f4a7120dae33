//! What one microVM is made of.

use std::path::PathBuf;

/// Command line used when the caller gives none: serial console, i8042
/// reset for reboot (and a panic reboots after 1 s, which the VMM reports
/// as a panic, not a clean exit), no PCI, no keyboard probing delays.
pub const DEFAULT_CMDLINE: &str =
    "console=ttyS0 reboot=k panic=1 pci=off nomodule i8042.noaux i8042.nomux i8042.dumbkbd";

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskConfig {
    pub path: PathBuf,
    pub read_only: bool,
}

impl std::str::FromStr for DiskConfig {
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

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VsockConfig {
    /// Host-side unix socket; guest-initiated connections go to `<path>_<port>`.
    pub uds_path: PathBuf,
    pub guest_cid: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SerialOutput {
    Stdout,
    File(PathBuf),
    Discard,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmConfig {
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub cmdline: String,
    pub disks: Vec<DiskConfig>,
    pub vsock: Option<VsockConfig>,
    pub vcpus: u8,
    pub mem_mib: u64,
    pub serial: SerialOutput,
    /// Forward stdin to the serial port (standalone mode on a terminal).
    pub serial_stdin: bool,
}

impl VmConfig {
    pub fn new(kernel: PathBuf) -> Self {
        Self {
            kernel,
            initrd: None,
            cmdline: DEFAULT_CMDLINE.into(),
            disks: Vec::new(),
            vsock: None,
            vcpus: 1,
            mem_mib: 256,
            serial: SerialOutput::Stdout,
            serial_stdin: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disk_specs() {
        let d: DiskConfig = "/a/b.img:ro".parse().unwrap();
        assert_eq!(d, DiskConfig { path: "/a/b.img".into(), read_only: true });
        let d: DiskConfig = "/a/b.img".parse().unwrap();
        assert!(!d.read_only);
        let d: DiskConfig = "/a:b.img".parse().unwrap();
        assert_eq!(d.path, PathBuf::from("/a:b.img"));
        assert!(":ro".parse::<DiskConfig>().is_err());
    }
}
