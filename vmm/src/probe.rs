//! A tiny guest that proves a `/dev/kvm` really runs guest code.
//!
//! The guest is six bytes of 16-bit real-mode code: it writes one byte to an
//! I/O port and halts. Running it exercises VM and vCPU creation, a memory
//! slot, register setup and the two most basic exits (port I/O and HLT),
//! which is what `burrow check` and the first test-host test need to know.

use kvm_bindings::kvm_userspace_memory_region;
use kvm_ioctls::{Kvm, VcpuExit};

/// Port the tiny guest writes to.
pub const PROBE_PORT: u16 = 0x10;
/// Byte the tiny guest writes.
pub const PROBE_BYTE: u8 = 0x42;

const GUEST_ADDR: u64 = 0x1000;
const MEM_SIZE: usize = 0x4000;
/// Exits to tolerate before deciding the guest is stuck.
const MAX_EXITS: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error("cannot open /dev/kvm: {0}")]
    Open(#[source] kvm_ioctls::Error),
    #[error("KVM ioctl {what} failed: {source}")]
    Ioctl {
        what: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("cannot map guest memory: {0}")]
    Mmap(#[source] std::io::Error),
    #[error("guest wrote {len} byte(s) to port {port:#x}, expected one byte to {PROBE_PORT:#x}")]
    UnexpectedIo { port: u16, len: usize },
    #[error("guest halted without writing to port {PROBE_PORT:#x}")]
    NoOutput,
    #[error("guest stopped with unexpected exit: {0}")]
    UnexpectedExit(String),
    #[error("guest did not halt after {MAX_EXITS} exits")]
    Stuck,
}

/// What the tiny guest did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeOutcome {
    /// The byte written to [`PROBE_PORT`].
    pub byte: u8,
    /// Number of exits the run took (I/O plus HLT, normally 2).
    pub exits: usize,
}

fn ioctl<T>(what: &'static str, r: Result<T, kvm_ioctls::Error>) -> Result<T, ProbeError> {
    r.map_err(|source| ProbeError::Ioctl { what, source })
}

/// Guest memory for the probe, unmapped on drop.
struct Mapping {
    ptr: *mut u8,
    len: usize,
}

impl Mapping {
    fn new(len: usize) -> Result<Self, ProbeError> {
        // SAFETY: anonymous private mapping with no address hint; the result
        // is checked before use.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(ProbeError::Mmap(std::io::Error::last_os_error()));
        }
        Ok(Self {
            ptr: ptr.cast(),
            len,
        })
    }

    fn write(&mut self, offset: usize, bytes: &[u8]) {
        assert!(offset + bytes.len() <= self.len, "probe code fits its mapping");
        // SAFETY: the range was checked against the mapping's length above.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.ptr.add(offset), bytes.len()) };
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: ptr/len describe a mapping created in `new` and not yet unmapped.
        unsafe { libc::munmap(self.ptr.cast(), self.len) };
    }
}

/// Real-mode code: `mov dx, PROBE_PORT; mov al, PROBE_BYTE; out dx, al; hlt`.
fn probe_code() -> [u8; 7] {
    let [lo, hi] = PROBE_PORT.to_le_bytes();
    [0xba, lo, hi, 0xb0, PROBE_BYTE, 0xee, 0xf4]
}

/// `vmx` or `svm` if the CPU flags in /proc/cpuinfo have either.
pub fn cpu_virt_flag(cpuinfo: &str) -> Option<&'static str> {
    let flags = cpuinfo
        .lines()
        .filter(|l| l.starts_with("flags"))
        .flat_map(|l| l.split_whitespace());
    for f in flags {
        match f {
            "vmx" => return Some("vmx"),
            "svm" => return Some("svm"),
            _ => {}
        }
    }
    None
}

/// Create a VM on `/dev/kvm`, run the tiny guest and report what it wrote.
pub fn run_tiny_guest() -> Result<ProbeOutcome, ProbeError> {
    // Declared before the VM so that it is unmapped only after the VM is gone.
    let mut mem = Mapping::new(MEM_SIZE)?;
    mem.write(GUEST_ADDR as usize, &probe_code());
    let kvm = Kvm::new().map_err(ProbeError::Open)?;
    let vm = ioctl("KVM_CREATE_VM", kvm.create_vm())?;
    let region = kvm_userspace_memory_region {
        slot: 0,
        guest_phys_addr: 0,
        memory_size: MEM_SIZE as u64,
        userspace_addr: mem.ptr as u64,
        flags: 0,
    };
    // SAFETY: the region describes `mem`, which outlives the VM.
    ioctl("KVM_SET_USER_MEMORY_REGION", unsafe {
        vm.set_user_memory_region(region)
    })?;

    let mut vcpu = ioctl("KVM_CREATE_VCPU", vm.create_vcpu(0))?;
    let mut sregs = ioctl("KVM_GET_SREGS", vcpu.get_sregs())?;
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    ioctl("KVM_SET_SREGS", vcpu.set_sregs(&sregs))?;
    let mut regs = ioctl("KVM_GET_REGS", vcpu.get_regs())?;
    regs.rip = GUEST_ADDR;
    regs.rflags = 0x2;
    ioctl("KVM_SET_REGS", vcpu.set_regs(&regs))?;

    let mut written = None;
    for exits in 1..=MAX_EXITS {
        match ioctl("KVM_RUN", vcpu.run())? {
            VcpuExit::IoOut(port, data) => {
                if port != PROBE_PORT || data.len() != 1 {
                    return Err(ProbeError::UnexpectedIo {
                        port,
                        len: data.len(),
                    });
                }
                written = data.first().copied();
            }
            VcpuExit::Hlt => {
                let byte = written.ok_or(ProbeError::NoOutput)?;
                return Ok(ProbeOutcome { byte, exits });
            }
            other => return Err(ProbeError::UnexpectedExit(format!("{other:?}"))),
        }
    }
    Err(ProbeError::Stuck)
}

/// Tiny kernels for VMM tests: an ELF64 executable whose single loadable
/// segment is `code` at physical address `entry`. With `pvh`, it carries the
/// Xen PVH entry note (so the VMM starts it in 32-bit protected mode);
/// without, the VMM uses the 64-bit Linux boot protocol (long mode).
pub fn tiny_elf(entry: u64, code: &[u8], pvh: bool) -> Vec<u8> {
    const EHDR: usize = 64;
    const PHDR: usize = 56;
    let phnum: usize = if pvh { 2 } else { 1 };
    let note_off = EHDR + PHDR * phnum;
    let note: Vec<u8> = if pvh {
        let mut n = Vec::new();
        n.extend_from_slice(&4u32.to_le_bytes()); // namesz
        n.extend_from_slice(&4u32.to_le_bytes()); // descsz
        n.extend_from_slice(&18u32.to_le_bytes()); // XEN_ELFNOTE_PHYS32_ENTRY
        n.extend_from_slice(b"Xen\0");
        n.extend_from_slice(&(entry as u32).to_le_bytes());
        n
    } else {
        Vec::new()
    };
    let code_off = note_off + note.len();
    let mut e = vec![0u8; EHDR];
    e[0..4].copy_from_slice(b"\x7fELF");
    e[4] = 2; // 64-bit
    e[5] = 1; // little endian
    e[6] = 1; // version
    e[16..18].copy_from_slice(&2u16.to_le_bytes()); // ET_EXEC
    e[18..20].copy_from_slice(&62u16.to_le_bytes()); // x86-64
    e[20..24].copy_from_slice(&1u32.to_le_bytes());
    e[24..32].copy_from_slice(&entry.to_le_bytes());
    e[32..40].copy_from_slice(&(EHDR as u64).to_le_bytes()); // phoff
    e[52..54].copy_from_slice(&(EHDR as u16).to_le_bytes());
    e[54..56].copy_from_slice(&(PHDR as u16).to_le_bytes());
    e[56..58].copy_from_slice(&(phnum as u16).to_le_bytes());
    let phdr = |kind: u32, flags: u32, off: usize, addr: u64, len: usize, align: u64| {
        let mut p = Vec::with_capacity(PHDR);
        p.extend_from_slice(&kind.to_le_bytes());
        p.extend_from_slice(&flags.to_le_bytes());
        p.extend_from_slice(&(off as u64).to_le_bytes());
        p.extend_from_slice(&addr.to_le_bytes());
        p.extend_from_slice(&addr.to_le_bytes());
        p.extend_from_slice(&(len as u64).to_le_bytes());
        p.extend_from_slice(&(len as u64).to_le_bytes());
        p.extend_from_slice(&align.to_le_bytes());
        p
    };
    e.extend(phdr(1, 5, code_off, entry, code.len(), 0x1000)); // PT_LOAD R+X
    if pvh {
        e.extend(phdr(4, 4, note_off, 0, note.len(), 4)); // PT_NOTE
    }
    e.extend_from_slice(&note);
    e.extend_from_slice(code);
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_cpu_flags() {
        let amd = "processor: 0\nflags\t\t: fpu vme svm sse\n";
        assert_eq!(cpu_virt_flag(amd), Some("svm"));
        assert_eq!(cpu_virt_flag("flags : fpu vmx\n"), Some("vmx"));
        assert_eq!(cpu_virt_flag("flags : fpu svm_lock\n"), None);
        assert_eq!(cpu_virt_flag("model name: vmx svm\n"), None, "only the flags line counts");
    }

    #[test]
    fn probe_code_is_out_then_hlt() {
        let code = probe_code();
        assert_eq!(code[0], 0xba, "mov dx, imm16");
        assert_eq!(u16::from_le_bytes([code[1], code[2]]), PROBE_PORT);
        assert_eq!(&code[3..], &[0xb0, PROBE_BYTE, 0xee, 0xf4]);
    }
}
