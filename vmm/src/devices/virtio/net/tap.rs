//! The host side of the NIC: a tap opened with IFF_TAP | IFF_NO_PI |
//! IFF_VNET_HDR, so every read and write is one Ethernet frame preceded by
//! a virtio-net header (the same 12-byte `virtio_net_hdr_v1` the guest
//! uses, set with TUNSETVNETHDRSZ), and checksum/TSO offloads switched on
//! (TUNSETOFFLOAD) as far as the guest driver accepted them.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

/// `struct ifreq` as TUNSETIFF/TUNGETIFF use it: the name and the flags.
#[repr(C)]
#[derive(Default)]
struct IfReq {
    name: [u8; libc::IFNAMSIZ],
    flags: libc::c_short,
    _pad: [u8; 22],
}

#[derive(Debug, thiserror::Error)]
pub enum TapError {
    #[error("cannot open /dev/net/tun: {0}")]
    Open(#[source] std::io::Error),
    #[error("tap name {0:?} is empty or longer than 15 bytes")]
    Name(String),
    #[error("{what} on the tap failed: {source}")]
    Ioctl {
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("fd {0} is not a tap with virtio-net headers (IFF_TAP|IFF_NO_PI|IFF_VNET_HDR)")]
    NotVnetTap(RawFd),
}

pub struct Tap {
    file: File,
    name: String,
}

/// Bytes of the virtio-net header before every frame (virtio 1.x).
pub const VNET_HDR_LEN: usize = 12;

fn ioctl_err(what: &'static str) -> TapError {
    TapError::Ioctl {
        what,
        source: std::io::Error::last_os_error(),
    }
}

impl Tap {
    /// The tap `--net` names: an inherited descriptor or a name.
    pub fn open(source: &burrow_vmm_api::TapSource) -> Result<Self, TapError> {
        match source {
            burrow_vmm_api::TapSource::Fd(fd) => Self::from_fd(*fd),
            burrow_vmm_api::TapSource::Name(n) => Self::open_named(n),
        }
    }

    /// Open (creating it if needed) tap `name` in this process's network
    /// namespace.
    pub fn open_named(name: &str) -> Result<Self, TapError> {
        if name.is_empty() || name.len() >= libc::IFNAMSIZ {
            return Err(TapError::Name(name.into()));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
            .open("/dev/net/tun")
            .map_err(TapError::Open)?;
        let mut req = IfReq::default();
        for (d, s) in req.name.iter_mut().zip(name.bytes()) {
            *d = s;
        }
        req.flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
        // SAFETY: TUNSETIFF reads and writes an ifreq, which `req` is laid
        // out as (name, flags, padding to its full size).
        if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETIFF, &mut req) } < 0 {
            return Err(ioctl_err("TUNSETIFF"));
        }
        Self::finish(file)
    }

    /// Take over an inherited tap descriptor (the shim opened it inside
    /// the container's network namespace). It must be a vnet-header tap.
    pub fn from_fd(fd: RawFd) -> Result<Self, TapError> {
        // SAFETY: fcntl(F_GETFD) only checks that the descriptor is open.
        if fd < 0 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
            return Err(TapError::NotVnetTap(fd));
        }
        // SAFETY: the descriptor is open and was handed to this process
        // for the tap alone; it is owned from here on.
        let file = File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        // SAFETY: setting flags on our own descriptor.
        unsafe {
            libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
            let fl = libc::fcntl(fd, libc::F_GETFL);
            if fl < 0 || libc::fcntl(fd, libc::F_SETFL, fl | libc::O_NONBLOCK) < 0 {
                return Err(ioctl_err("F_SETFL O_NONBLOCK"));
            }
        }
        Self::finish(file)
    }

    fn finish(file: File) -> Result<Self, TapError> {
        let mut req = IfReq::default();
        // SAFETY: TUNGETIFF fills an ifreq.
        if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNGETIFF, &mut req) } < 0 {
            return Err(TapError::NotVnetTap(file.as_raw_fd()));
        }
        let want = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as libc::c_short;
        if req.flags & want != want {
            return Err(TapError::NotVnetTap(file.as_raw_fd()));
        }
        let len = req
            .name
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(req.name.len());
        let name = String::from_utf8_lossy(req.name.get(..len).unwrap_or_default()).into_owned();
        let size = VNET_HDR_LEN as libc::c_int;
        // SAFETY: TUNSETVNETHDRSZ reads an int.
        if unsafe { libc::ioctl(file.as_raw_fd(), libc::TUNSETVNETHDRSZ, &size) } < 0 {
            return Err(ioctl_err("TUNSETVNETHDRSZ"));
        }
        let tap = Self { file, name };
        // No offloads until the guest driver says which it takes.
        tap.set_offload(0)?;
        Ok(tap)
    }

    /// A stand-in backend for tests: any datagram descriptor (one read or
    /// write is one frame, as on a tap).
    #[cfg(test)]
    pub fn for_test(fd: OwnedFd, name: &str) -> Self {
        Self {
            file: File::from(fd),
            name: name.into(),
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn as_raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    /// Which offloaded frames the tap may hand us (TUN_F_* bits).
    pub fn set_offload(&self, flags: libc::c_uint) -> Result<(), TapError> {
        // SAFETY: TUNSETOFFLOAD takes its argument by value.
        if unsafe {
            libc::ioctl(
                self.file.as_raw_fd(),
                libc::TUNSETOFFLOAD,
                flags as libc::c_ulong,
            )
        } < 0
        {
            return Err(ioctl_err("TUNSETOFFLOAD"));
        }
        Ok(())
    }

    /// Read one frame (header included); `WouldBlock` when none is queued.
    pub fn read_frame(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.file.read(buf)
    }

    /// Write one frame (header included).
    pub fn write_frame(&mut self, frame: &[u8]) -> std::io::Result<usize> {
        self.file.write(frame)
    }
}
