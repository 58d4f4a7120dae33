//! `burrow check`: what kind of virtualization this host offers, and so what
//! burrow can do here.

use std::path::Path;

use burrow_vmm::probe::{self, cpu_virt_flag, ProbeOutcome, PROBE_BYTE};

/// The three kinds of host burrow tells apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostKind {
    /// `/dev/kvm` backed by the CPU's own virtualization (VT-x or AMD-V).
    HardwareKvm,
    /// `/dev/kvm` backed by PVM (`kvm_pvm`), which runs only PVM-enabled guests.
    Pvm,
    /// No usable `/dev/kvm`.
    None,
}

impl HostKind {
    /// Exit status of `burrow check` for this kind of host.
    pub fn exit_code(self) -> i32 {
        match self {
            HostKind::HardwareKvm => 0,
            HostKind::Pvm => 2,
            HostKind::None => 3,
        }
    }
}

/// What `burrow check` read off the host.
#[derive(Debug)]
pub struct Facts {
    pub dev_kvm: bool,
    pub pvm_module: bool,
    /// `vmx` or `svm` from /proc/cpuinfo, if either is there.
    pub cpu_flag: Option<&'static str>,
    /// Result of running the tiny guest (None if it was not attempted).
    pub tiny_guest: Option<Result<ProbeOutcome, String>>,
}

impl Facts {
    /// Read the facts of this host, running the tiny guest if `/dev/kvm` exists.
    pub fn gather() -> Self {
        let dev_kvm = Path::new("/dev/kvm").exists();
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let tiny_guest = dev_kvm.then(|| probe::run_tiny_guest().map_err(|e| e.to_string()));
        Self {
            dev_kvm,
            pvm_module: Path::new("/sys/module/kvm_pvm").exists(),
            cpu_flag: cpu_virt_flag(&cpuinfo),
            tiny_guest,
        }
    }

    fn tiny_guest_ok(&self) -> bool {
        matches!(&self.tiny_guest, Some(Ok(o)) if o.byte == PROBE_BYTE)
    }

    /// Decide which kind of host these facts describe.
    pub fn classify(&self) -> HostKind {
        if !self.dev_kvm || !self.tiny_guest_ok() {
            HostKind::None
        } else if self.pvm_module {
            HostKind::Pvm
        } else if self.cpu_flag.is_some() {
            HostKind::HardwareKvm
        } else {
            // A KVM that runs guests without vmx/svm and without kvm_pvm is
            // something we do not know; do not promise that Linux boots.
            HostKind::None
        }
    }
}


/// The human report for a host.
pub fn report(facts: &Facts) -> String {
    let kind = facts.classify();
    let mut out = String::new();
    let yes = |b: bool| if b { "yes" } else { "no" };
    out.push_str(&format!("/dev/kvm:               {}\n", yes(facts.dev_kvm)));
    out.push_str(&format!(
        "CPU virtualization:     {}\n",
        facts.cpu_flag.unwrap_or("none (no vmx/svm flag)")
    ));
    out.push_str(&format!("kvm_pvm module loaded:  {}\n", yes(facts.pvm_module)));
    let guest = match &facts.tiny_guest {
        None => "not tried (no /dev/kvm)".to_string(),
        Some(Ok(o)) => format!("ran (wrote {:#x}, {} exits)", o.byte, o.exits),
        Some(Err(e)) => format!("failed: {e}"),
    };
    out.push_str(&format!("tiny KVM guest:         {guest}\n\n"));
    out.push_str(match kind {
        HostKind::HardwareKvm => {
            "host: hardware KVM\n\
             burrow runs here in full: microVMs with a stock Linux guest kernel,\n\
             containers through containerd, snapshots and restore. The test suite\n\
             runs directly on this host.\n"
        }
        HostKind::Pvm => {
            "host: PVM (KVM backed by the kvm_pvm module, no hardware virtualization)\n\
             PVM runs guests on shadow page tables and needs a PVM-enabled guest\n\
             kernel. A stock Linux guest's kernel code is emulated instruction by\n\
             instruction here and dies on emulation failures, so burrow cannot boot\n\
             its guests on this host.\n\
             What works: building burrow, unit tests, and tiny hand-written KVM test\n\
             guests. Everything that boots Linux runs inside the nested test host:\n\
             `hack/testhost -- <command>` (QEMU's software CPU with emulated AMD SVM).\n"
        }
        HostKind::None => {
            "host: no usable KVM\n\
             burrow cannot run microVMs here. Building burrow and its unit tests\n\
             work; everything that needs KVM runs inside the nested test host:\n\
             `hack/testhost -- <command>`.\n"
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok() -> Option<Result<ProbeOutcome, String>> {
        Some(Ok(ProbeOutcome {
            byte: PROBE_BYTE,
            exits: 2,
        }))
    }


    #[test]
    fn classifies_the_three_hosts() {
        let hw = Facts {
            dev_kvm: true,
            pvm_module: false,
            cpu_flag: Some("svm"),
            tiny_guest: ok(),
        };
        assert_eq!(hw.classify(), HostKind::HardwareKvm);
        let pvm = Facts {
            dev_kvm: true,
            pvm_module: true,
            cpu_flag: None,
            tiny_guest: ok(),
        };
        assert_eq!(pvm.classify(), HostKind::Pvm);
        assert!(report(&pvm).contains("PVM-enabled guest"));
        let none = Facts {
            dev_kvm: false,
            pvm_module: false,
            cpu_flag: Some("vmx"),
            tiny_guest: None,
        };
        assert_eq!(none.classify(), HostKind::None);
        let broken = Facts {
            dev_kvm: true,
            pvm_module: false,
            cpu_flag: Some("vmx"),
            tiny_guest: Some(Err("KVM_RUN failed".into())),
        };
        assert_eq!(broken.classify(), HostKind::None);
        assert!(report(&broken).contains("KVM_RUN failed"));
        let codes = [hw.classify(), pvm.classify(), none.classify()].map(HostKind::exit_code);
        assert_eq!(codes, [0, 2, 3], "exit status tells the three apart");
    }
}
