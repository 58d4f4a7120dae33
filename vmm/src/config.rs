//! What one microVM is made of.

use std::path::PathBuf;

/// Command line used when the caller gives none (the shim's default
/// too): see [`burrow_vmm_api::BASE_CMDLINE`].
pub use burrow_vmm_api::BASE_CMDLINE as DEFAULT_CMDLINE;

/// A disk as the command line gives it (`PATH` or `PATH:ro`).
pub use burrow_vmm_api::DiskArg as DiskConfig;

/// The NIC as the command line gives it (`fd=N,mac=..` or `tap=NAME,mac=..`).
pub use burrow_vmm_api::NetArg as NetConfig;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VsockConfig {
    /// Host-side unix socket; guest-initiated connections go to `<path>_<port>`.
    pub uds_path: PathBuf,
    pub guest_cid: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SerialOutput {
    Stdout,
    /// A file, rotated to `PATH.1` past `max_bytes` (see [`crate::capped`]).
    File {
        path: PathBuf,
        max_bytes: u64,
    },
    Discard,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmConfig {
    pub kernel: PathBuf,
    pub initrd: Option<PathBuf>,
    pub cmdline: String,
    pub disks: Vec<DiskConfig>,
    /// Empty block slots after the disks (filled through the control API).
    pub disk_slots: u32,
    pub vsock: Option<VsockConfig>,
    pub net: Option<NetConfig>,
    /// vCPUs running from boot.
    pub vcpus: u8,
    /// vCPUs the VM has (none: `vcpus`); the rest wait for a grant.
    pub max_vcpus: Option<u8>,
    pub mem_mib: u64,
    /// `--mem-max`: the guest may grow to this through virtio-mem
    /// (`None`: no virtio-mem device).
    pub mem_max_mib: Option<u64>,
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
            disk_slots: 0,
            vsock: None,
            net: None,
            vcpus: 1,
            max_vcpus: None,
            mem_mib: 256,
            mem_max_mib: None,
            serial: SerialOutput::Stdout,
            serial_stdin: false,
        }
    }
}
