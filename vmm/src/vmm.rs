//! Building a microVM from a [`VmConfig`] and running its event loop.
//!
//! Threads: one per vCPU (KVM_RUN, register access of devices) and the VMM
//! thread (this loop): virtqueue notifications (ioeventfds), vsock's host
//! sockets, the i8042 reset line, vCPU exit events and the control API.
//! Nothing runs on a timer: an idle guest costs the VMM no wakeups. A guest
//! ends the VM by resetting (`reboot`, which the agent's power-off uses):
//! with no ACPI a `poweroff` only halts its CPUs, and such a VM stays until
//! it is stopped, as in Firecracker.

mod hotplug;
mod restoring;
mod slots;
mod snapshotting;

pub use restoring::{check_restore, RestoreConfig};
pub use crate::api::SnapshotInfo;

use std::collections::HashMap;
use std::io::Write;
use std::os::fd::{AsRawFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use kvm_bindings::{
    kvm_pit_config, kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES, KVM_MEM_LOG_DIRTY_PAGES,
    KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Cap, IoEventAddress, Kvm, VcpuFd, VmFd};
use crate::GuestMemoryMmap;
use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryRegion};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::api::{ApiError, ApiErrorKind, Client, Command, Event, Request, Response, VmState};
use crate::bus::Bus;
use crate::config::{SerialOutput, VmConfig};
use crate::devices::i8042::I8042;
use crate::devices::serial::{IrqEvt, Serial, SerialOut};
use crate::devices::virtio::block::Block;
use crate::devices::virtio::mem::Mem;
use crate::devices::virtio::mmio::{MmioTransport, REG_QUEUE_NOTIFY};
use crate::devices::virtio::net::{Net, Tap};
use crate::devices::virtio::vsock::Vsock;
use crate::devices::virtio::{IrqTrigger, VirtioDevice};
use crate::snapshot;
use crate::vcpu::{self, VcpuControl, VcpuEvent};
use crate::x86_64::layout::{
    IRQ_I8042, IRQ_MAX, IRQ_SERIAL, IRQ_VIRTIO_START, KVM_TSS_ADDRESS, VIRTIO_MMIO_SIZE,
    VIRTIO_MMIO_START,
};
use crate::x86_64::{boot, cpuid, e820, mptable, regs};
use crate::ExitReason;

#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    #[error("cannot open /dev/kvm: {0}")]
    Kvm(#[source] kvm_ioctls::Error),
    #[error("KVM ioctl {0} failed: {1}")]
    Ioctl(&'static str, #[source] kvm_ioctls::Error),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("cannot allocate guest memory: {0}")]
    Memory(String),
    #[error(transparent)]
    Boot(#[from] boot::BootError),
    #[error(transparent)]
    Regs(#[from] regs::RegsError),
    #[error(transparent)]
    Mptable(#[from] mptable::MptableError),
    #[error(transparent)]
    Block(#[from] crate::devices::virtio::block::BlockError),
    #[error(transparent)]
    Vsock(#[from] crate::devices::virtio::vsock::VsockError),
    #[error(transparent)]
    Net(#[from] crate::devices::virtio::net::NetError),
    #[error(transparent)]
    HotplugMemory(#[from] crate::devices::virtio::mem::MemError),
    #[error("{0}: {1}")]
    Io(&'static str, #[source] std::io::Error),
    #[error("cannot restore the snapshot: {0}")]
    Restore(String),
}


fn ioctl(what: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> VmmError {
    move |e| VmmError::Ioctl(what, e)
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Wraps the console output and notices a kernel panic message, so that
/// the reboot `panic=1` causes is reported as a panic, not a clean exit.
struct PanicWatch {
    out: SerialOut,
    line: Vec<u8>,
    panicked: Arc<AtomicBool>,
}

const PANIC_MARKER: &[u8] = b"Kernel panic - not syncing";

impl Write for PanicWatch {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        for &b in buf {
            if b == b'\n' {
                self.line.clear();
            } else if self.line.len() < 256 {
                self.line.push(b);
                if self.line.ends_with(PANIC_MARKER) {
                    self.panicked.store(true, Ordering::SeqCst);
                }
            }
        }
        self.out.write_all(buf)?;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// A device on the MMIO bus and the fds the event loop watches for it.
struct MmioDevice {
    transport: Arc<Mutex<MmioTransport>>,
    queue_evts: Vec<EventFd>,
    backend_fd: Option<RawFd>,
}

/// A built VM, ready to start.
pub struct Vmm {
    /// `--vcpu-kick-ms` (0: never).
    kick_ms: u32,
    _kvm: Kvm,
    vm: VmFd,
    mem: GuestMemoryMmap,
    vcpu_count: u8,
    mem_mib: u64,
    /// `--mem-max` (a virtio-mem device), if any.
    mem_max_mib: Option<u64>,
    /// KVM logs guest writes to memory (needed for incremental snapshots).
    dirty_log: bool,
    /// The snapshot an incremental one would be based on: its directory and id.
    last_snapshot: Option<(PathBuf, u64)>,
    pending_vcpus: Vec<VcpuFd>,
    threads: Vec<JoinHandle<()>>,
    control: Arc<VcpuControl>,
    bus: Arc<Bus>,
    devices: Vec<MmioDevice>,
    reset_evt: Arc<EventFd>,
    vcpu_wake: Arc<EventFd>,
    vcpu_tx: Sender<VcpuEvent>,
    vcpu_rx: Receiver<VcpuEvent>,
    panicked: Arc<AtomicBool>,
    serial_stdin: bool,
    state: VmState,
    // keep irq eventfds alive while KVM routes them
    _irqfds: Vec<Arc<EventFd>>,
}

impl Vmm {
    /// Create the VM, load the kernel and set up every device.
    pub fn build(config: &VmConfig) -> Result<Self, VmmError> {
        if config.vcpus == 0 || config.vcpus > mptable::MAX_CPUS {
            return Err(VmmError::Config(format!(
                "vcpus must be 1..={}, got {}",
                mptable::MAX_CPUS,
                config.vcpus
            )));
        }
        let vcpu_count = config.max_vcpus.unwrap_or(config.vcpus);
        if !(config.vcpus..=mptable::MAX_CPUS).contains(&vcpu_count) {
            return Err(VmmError::Config(format!(
                "max vcpus must be {}..={}, got {vcpu_count}",
                config.vcpus,
                mptable::MAX_CPUS
            )));
        }
        if !(16..=(1 << 20)).contains(&config.mem_mib) {
            return Err(VmmError::Config(format!(
                "memory must be 16 MiB to 1 TiB, got {} MiB",
                config.mem_mib
            )));
        }
        let slots = usize::try_from(config.disk_slots).unwrap_or(usize::MAX);
        let devices_wanted = config.disks.len().saturating_add(slots)
            + usize::from(config.vsock.is_some())
            + usize::from(config.net.is_some())
            + usize::from(config.mem_max_mib.is_some());
        if devices_wanted > (IRQ_MAX - IRQ_VIRTIO_START + 1) as usize {
            return Err(VmmError::Config(format!("too many devices: {devices_wanted}")));
        }
        vcpu::install_kick_handler().map_err(|e| VmmError::Io("signal handler", e))?;

        let kvm = Kvm::new().map_err(VmmError::Kvm)?;
        let vm = new_vm(&kvm)?;
        let mem_size = config.mem_mib << 20;
        let ranges: Vec<(GuestAddress, usize)> = e820::ram_ranges(mem_size)
            .into_iter()
            .map(|(s, l)| (GuestAddress(s), l as usize))
            .collect();
        let mut mem = GuestMemoryMmap::from_ranges(&ranges)
            .map_err(|e| VmmError::Memory(e.to_string()))?;
        let hotplug = hotplug::region(config.mem_mib, config.mem_max_mib)?;
        if let Some((addr, size)) = hotplug {
            // Its own region (so its own KVM slot), all PROT_NONE until plugged.
            let region = crate::devices::virtio::mem::hotplug_mapping(addr, size)?;
            mem = mem
                .insert_region(Arc::new(region))
                .map_err(|e| VmmError::Memory(e.to_string()))?;
        }
        register_memory(&vm, &mem, false)?;

        // Legacy devices.
        let mut irqfds = Vec::new();
        let panicked = Arc::new(AtomicBool::new(false));
        let out = serial_output(&config.serial, &panicked)?;
        let serial_irq = new_irqfd(&vm, IRQ_SERIAL)?;
        irqfds.push(serial_irq.clone());
        let serial = Arc::new(Mutex::new(Serial::new(IrqEvt(serial_irq), out)));
        let kbd_irq = new_irqfd(&vm, IRQ_I8042)?;
        irqfds.push(kbd_irq.clone());
        let reset_evt = Arc::new(
            EventFd::new(libc::EFD_NONBLOCK).map_err(|e| VmmError::Io("eventfd", e))?,
        );
        let i8042 = Arc::new(Mutex::new(I8042::new(kbd_irq, reset_evt.clone())));

        // virtio devices.
        let mut virtio: Vec<Box<dyn VirtioDevice>> = Vec::new();
        for d in &config.disks {
            virtio.push(Box::new(Block::open(&d.path, d.read_only)?));
        }
        for n in 0..config.disk_slots {
            virtio.push(Box::new(Block::slot(n)));
        }
        if let Some(v) = &config.vsock {
            virtio.push(Box::new(Vsock::new(v.guest_cid, &v.uds_path)?));
        }
        if let Some(n) = &config.net {
            let tap = Tap::open(&n.tap).map_err(crate::devices::virtio::net::NetError::from)?;
            virtio.push(Box::new(Net::new(tap, n.mac.0)?));
        }
        if let Some((addr, size)) = hotplug {
            let m = Mem::new(addr, size, Some(mem.clone()))?;
            m.guard_region()?;
            virtio.push(Box::new(m));
        }
        let mut devices = Vec::new();
        let mut mmio = Vec::new();
        let mut mmio_windows = Vec::new();
        for (i, dev) in virtio.into_iter().enumerate() {
            let w = wire_virtio(&vm, i, dev.queue_max_sizes().len())?;
            let backend_fd = dev.backend_fd();
            let transport = MmioTransport::new(dev, mem.clone(), w.irq)
                .map_err(|e| VmmError::Config(format!("virtio queue: {e}")))?;
            let transport = Arc::new(Mutex::new(transport));
            mmio.push((w.base, transport.clone()));
            devices.push(MmioDevice {
                transport,
                queue_evts: w.queue_evts,
                backend_fd,
            });
            mmio_windows.push((w.base, w.irq_line));
        }

        // Kernel, boot info, MP table, vCPUs.
        // vCPUs past `vcpus` are present but the guest does not start
        // them at boot; they run once granted (`set_vcpus`).
        let base_cmdline = if vcpu_count > config.vcpus {
            format!("{} maxcpus={}", config.cmdline, config.vcpus)
        } else {
            config.cmdline.clone()
        };
        let cmdline = boot::kernel_cmdline(&base_cmdline, &mmio_windows)?;
        let entry = boot::load(
            &mem,
            mem_size,
            &config.kernel,
            config.initrd.as_deref(),
            &cmdline,
        )?;
        tracing::info!(
            "booting {:?} entry {:#x}; cmdline: {:?}",
            entry.protocol,
            entry.entry,
            cmdline.as_cstring().unwrap_or_default()
        );
        mptable::setup(&mem, vcpu_count)?;
        let supported = kvm
            .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
            .map_err(ioctl("KVM_GET_SUPPORTED_CPUID"))?;
        let tsc_deadline = kvm.check_extension(Cap::TscDeadlineTimer);
        let mut pending_vcpus = Vec::new();
        for id in 0..vcpu_count {
            let vcpu = vm
                .create_vcpu(u64::from(id))
                .map_err(ioctl("KVM_CREATE_VCPU"))?;
            let mut c = supported.clone();
            cpuid::filter(&mut c, id, vcpu_count, tsc_deadline);
            vcpu.set_cpuid2(&c).map_err(ioctl("KVM_SET_CPUID2"))?;
            regs::configure_vcpu(&vcpu, &mem, entry.protocol, entry.entry, id == 0)?;
            pending_vcpus.push(vcpu);
        }

        let msr_list = snapshot::vcpu::msrs_to_save(&kvm).unwrap_or_else(|e| {
            tracing::warn!("no MSR list for snapshots: {e}");
            Vec::new()
        });
        Self::assemble(Parts {
            kvm,
            vm,
            mem,
            vcpu_count,
            vcpus_running: config.vcpus,
            mem_mib: config.mem_mib,
            mem_max_mib: hotplug.and(config.mem_max_mib),
            dirty_log: false,
            last_snapshot: None,
            pending_vcpus,
            msr_list,
            bus: Bus { serial, i8042, mmio },
            devices,
            reset_evt,
            panicked,
            serial_stdin: config.serial_stdin,
            irqfds,
        })
    }

    fn assemble(p: Parts) -> Result<Self, VmmError> {
        let (vcpu_tx, vcpu_rx) = channel();
        Ok(Self {
            _kvm: p.kvm,
            vm: p.vm,
            mem: p.mem,
            kick_ms: 0,
            vcpu_count: p.vcpu_count,
            mem_mib: p.mem_mib,
            mem_max_mib: p.mem_max_mib,
            dirty_log: p.dirty_log,
            last_snapshot: p.last_snapshot,
            pending_vcpus: p.pending_vcpus,
            threads: Vec::new(),
            control: VcpuControl::new(
                usize::from(p.vcpu_count),
                usize::from(p.vcpus_running),
                p.msr_list,
            ),
            bus: Arc::new(p.bus),
            devices: p.devices,
            reset_evt: p.reset_evt,
            vcpu_wake: Arc::new(
                EventFd::new(libc::EFD_NONBLOCK).map_err(|e| VmmError::Io("eventfd", e))?,
            ),
            vcpu_tx,
            vcpu_rx,
            panicked: p.panicked,
            serial_stdin: p.serial_stdin,
            state: VmState::Created,
            _irqfds: p.irqfds,
        })
    }

    /// The KVM VM (for tests and diagnostics).
    pub fn vm_fd(&self) -> &VmFd {
        &self.vm
    }

    fn start(&mut self) -> Result<(), VmmError> {
        if self.state != VmState::Created {
            return Ok(());
        }
        for (id, vcpu) in std::mem::take(&mut self.pending_vcpus).into_iter().enumerate() {
            let t = vcpu::spawn(
                id,
                vcpu,
                self.bus.clone(),
                self.control.clone(),
                self.vcpu_tx.clone(),
                self.vcpu_wake.clone(),
            )
            .map_err(|e| VmmError::Io("cannot spawn vCPU thread", e))?;
            self.threads.push(t);
        }
        self.state = VmState::Running;
        Ok(())
    }

    fn stop_vcpus(&mut self) {
        // Straight from Pause to Stop: a paused VM (one just snapshotted)
        // must not run another guest instruction on its way out.
        if !self.control.stop(&self.threads) {
            tracing::warn!("some vCPU threads did not stop in time");
        }
        for t in self.threads.drain(..) {
            if t.is_finished() {
                let _ = t.join();
            }
        }
    }

    /// Run one API command; `files` are those its client passed.
    fn command(&mut self, cmd: Command, files: &mut Vec<std::fs::File>, events: &mut Vec<Event>) -> Result<Response, ExitReason> {
        Ok(match cmd {
            Command::Status => Response::ok(self.state).with_memory(self.memory_info()),
            Command::ResizeMemory { mib } => self.resize_memory(mib),
            Command::Start => match self.state {
                VmState::Created => match self.start() {
                    Ok(()) => {
                        events.push(Event::Started);
                        Response::ok(self.state)
                    }
                    Err(e) => return Err(ExitReason::Error(e.to_string())),
                },
                s => Response::ok(s),
            },
            Command::Pause => match self.state {
                VmState::Running => {
                    if self.control.pause(&self.threads) {
                        self.state = VmState::Paused;
                        events.push(Event::Paused);
                        Response::ok(self.state)
                    } else {
                        self.control.resume();
                        Response::err(ApiError::new(ApiErrorKind::Timeout, "vCPUs did not pause in time"))
                    }
                }
                VmState::Paused => Response::ok(self.state),
                s => Response::err(ApiError::new(ApiErrorKind::InvalidState, format!("cannot pause: VM is {s:?}"))),
            },
            Command::Resume => match self.state {
                VmState::Paused => {
                    self.control.resume();
                    self.state = VmState::Running;
                    events.push(Event::Resumed);
                    Response::ok(self.state)
                }
                VmState::Running => Response::ok(self.state),
                s => Response::err(ApiError::new(ApiErrorKind::InvalidState, format!("cannot resume: VM is {s:?}"))),
            },
            Command::Stop => return Err(ExitReason::Stopped),
            Command::AttachDisk { slot, path, read_only } => {
                let passed = std::mem::take(files).into_iter().next();
                self.attach_disk(slot, Some((&path, read_only)), passed)
            }
            Command::DetachDisk { slot } => self.attach_disk(slot, None, None),
            Command::SetVcpus { count } => self.set_vcpus(count),
            Command::Snapshot { dir, incremental } => match snapshot_files(files).and_then(|f| self.snapshot(&dir, incremental, f, events)) {
                Ok(info) => Response::snapshot(self.state, info),
                Err(e) => {
                    tracing::warn!("snapshot to {} failed: {e}", dir.display());
                    Response::err(e.context("snapshot failed"))
                }
            },
        })
    }

    /// Let the first `count` vCPUs run: more than now start, fewer hold
    /// those past `count` (the guest must have offlined them first).
    fn set_vcpus(&mut self, count: u8) -> Response {
        let running = self.control.running();
        if count == 0 || count > self.vcpu_count {
            return Response::err(ApiError::new(
                ApiErrorKind::InvalidRequest,
                format!("cannot run {count} vCPUs: the VM has {}", self.vcpu_count),
            ));
        }
        if !matches!(self.state, VmState::Created | VmState::Running | VmState::Paused) {
            return Response::err(ApiError::new(
                ApiErrorKind::InvalidState,
                format!("cannot change its vCPUs: VM is {:?}", self.state),
            ));
        }
        if count > running {
            tracing::info!("vCPUs {running}..{count} may run");
        } else if count < running {
            tracing::info!("vCPUs {count}..{running} held");
        }
        self.control.set_running(count, &self.threads);
        Response::ok(self.state)
    }

    /// Kick the vCPUs out of KVM_RUN every `ms` (0: never) while the VM
    /// runs and has more than one: the nested test host's workaround (see
    /// `--vcpu-kick-ms`).
    pub fn kick_vcpus_every(&mut self, ms: u32) {
        self.kick_ms = if self.vcpu_count > 1 { ms } else { 0 };
    }

    /// Run the VM until it exits. With `autostart` the vCPUs start now;
    /// otherwise they wait for a `start` command on the API socket.
    pub fn run(mut self, api_listener: Option<UnixListener>, autostart: bool) -> ExitReason {
        let reason = match self.event_loop(api_listener.as_ref(), autostart) {
            Ok(r) => r,
            Err(e) => ExitReason::Error(e.to_string()),
        };
        self.stop_vcpus();
        self.state = VmState::Exited;
        reason
    }

    fn event_loop(
        &mut self,
        api_listener: Option<&UnixListener>,
        autostart: bool,
    ) -> Result<ExitReason, VmmError> {
        const T_VCPU: u64 = 1;
        const T_RESET: u64 = 2;
        const T_API: u64 = 3;
        const T_STDIN: u64 = 4;
        const T_CLIENT: u64 = 1 << 32;
        const T_QUEUE: u64 = 2 << 40;
        const T_BACKEND: u64 = 3 << 40;
        let epoll = Epoll::new().map_err(|e| VmmError::Io("epoll", e))?;
        let add = |fd: RawFd, token: u64| {
            epoll
                .ctl(ControlOperation::Add, fd, EpollEvent::new(EventSet::IN, token))
                .map_err(|e| VmmError::Io("epoll_ctl", e))
        };
        add(self.vcpu_wake.as_raw_fd(), T_VCPU)?;
        add(self.reset_evt.as_raw_fd(), T_RESET)?;
        if let Some(l) = api_listener {
            l.set_nonblocking(true).map_err(|e| VmmError::Io("api socket", e))?;
            add(l.as_raw_fd(), T_API)?;
        }
        let mut stdin_on = self.serial_stdin;
        if stdin_on {
            add(libc::STDIN_FILENO, T_STDIN)?;
        }
        for (d, dev) in self.devices.iter().enumerate() {
            for (q, evt) in dev.queue_evts.iter().enumerate() {
                add(evt.as_raw_fd(), T_QUEUE | (d as u64) << 16 | q as u64)?;
            }
            if let Some(fd) = dev.backend_fd {
                add(fd, T_BACKEND | d as u64)?;
            }
        }

        let mut clients: HashMap<u64, Client> = HashMap::new();
        let mut next_client = 0u64;
        if autostart {
            self.start()?;
        }
        let mut events = [EpollEvent::default(); 32];
        let kick_every = (self.kick_ms > 0).then(|| std::time::Duration::from_millis(self.kick_ms.into()));
        let mut last_kick = std::time::Instant::now();
        loop {
            let mut out_events: Vec<Event> = Vec::new();
            let mut exit: Option<ExitReason> = None;
            let timeout = kick_every.map_or(-1, |d| i32::try_from(d.as_millis()).unwrap_or(i32::MAX));
            let n = match epoll.wait(timeout, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => 0,
                Err(e) => return Err(VmmError::Io("epoll_wait", e)),
            };
            for ev in events.iter().take(n) {
                let token = ev.data();
                match token {
                    T_VCPU => {
                        let _ = self.vcpu_wake.read();
                        while let Ok(VcpuEvent::Exit(r)) = self.vcpu_rx.try_recv() {
                            exit.get_or_insert(r);
                        }
                    }
                    T_RESET => {
                        let _ = self.reset_evt.read();
                        exit.get_or_insert(ExitReason::Reboot);
                    }
                    T_API => {
                        if let Some(l) = api_listener {
                            while let Ok((s, _)) = l.accept() {
                                let Ok(c) = Client::new(s) else { continue };
                                let token = T_CLIENT + next_client;
                                next_client += 1;
                                if add(c.stream.as_raw_fd(), token).is_ok() {
                                    clients.insert(token, c);
                                }
                            }
                        }
                    }
                    T_STDIN => {
                        let mut stdin = std::io::stdin();
                        if !lock(&self.bus.serial).handle_input(&mut stdin) {
                            let _ = epoll.ctl(ControlOperation::Delete, libc::STDIN_FILENO, EpollEvent::default());
                            stdin_on = false;
                        }
                    }
                    t if t >= T_BACKEND => {
                        let d = (t & 0xffff) as usize;
                        if let Some(dev) = self.devices.get(d) {
                            let mut tr = lock(&dev.transport);
                            if let Err(e) = tr.device_mut().process_backend() {
                                tracing::warn!("device {d} backend: {e}");
                                out_events.push(Event::Error { message: format!("device {d}: {e}") });
                            }
                        }
                    }
                    t if t >= T_QUEUE => {
                        let d = ((t >> 16) & 0xffff) as usize;
                        let q = (t & 0xffff) as usize;
                        if let Some(dev) = self.devices.get(d) {
                            if let Some(evt) = dev.queue_evts.get(q) {
                                let _ = evt.read();
                            }
                            lock(&dev.transport).notify(q);
                        }
                    }
                    t if t >= T_CLIENT => {
                        let lines = clients.get_mut(&t).and_then(Client::read_lines);
                        let Some(lines) = lines else {
                            if let Some(c) = clients.remove(&t) {
                                let _ = epoll.ctl(ControlOperation::Delete, c.stream.as_raw_fd(), EpollEvent::default());
                            }
                            continue;
                        };
                        let mut files = clients.get_mut(&t).map(|c| std::mem::take(&mut c.files)).unwrap_or_default();
                        for line in lines {
                            let resp = match Request::parse(&line) {
                                Ok(req) => match self.command(req.cmd, &mut files, &mut out_events) {
                                    Ok(r) => r,
                                    Err(r) => {
                                        exit.get_or_insert(r);
                                        Response::ok(VmState::Exited)
                                    }
                                },
                                Err(e) => Response::err(e),
                            };
                            if let Some(c) = clients.get_mut(&t) {
                                c.send(&resp);
                            }
                        }
                    }
                    _ => {}
                }
            }
            let _ = stdin_on;

            if let Some(d) = kick_every {
                if self.state == VmState::Running && last_kick.elapsed() >= d {
                    last_kick = std::time::Instant::now();
                    self.control.nudge(&self.threads);
                }
            }

            if let Some(mut r) = exit {
                if self.panicked.load(Ordering::SeqCst)
                    && matches!(r, ExitReason::Reboot | ExitReason::TripleFault | ExitReason::Poweroff)
                {
                    r = ExitReason::Panic;
                }
                if let ExitReason::Error(m) = &r {
                    out_events.push(Event::Error { message: m.clone() });
                }
                out_events.push(Event::Exit {
                    reason: r.as_str().to_string(),
                    success: r.success(),
                });
                broadcast(&mut clients, &out_events);
                return Ok(r);
            }
            broadcast(&mut clients, &out_events);
        }
    }
}

/// The snapshot files a client passed: none (write by path) or exactly two.
fn snapshot_files(files: &mut Vec<std::fs::File>) -> Result<Option<snapshotting::SnapshotFiles>, ApiError> {
    let passed = std::mem::take(files);
    let mut it = passed.into_iter();
    match (it.next(), it.next()) {
        (None, _) => Ok(None),
        (Some(memory), Some(state)) => Ok(Some(snapshotting::SnapshotFiles { memory, state })),
        (Some(_), None) => Err(ApiError::new(
            ApiErrorKind::InvalidRequest,
            "a snapshot takes two passed files (memory, state) or none",
        )),
    }
}

fn broadcast(clients: &mut HashMap<u64, Client>, events: &[Event]) {
    for e in events {
        clients.retain(|_, c| c.send(e));
    }
}

/// Everything [`Vmm::assemble`] puts together.
struct Parts {
    kvm: Kvm,
    vm: VmFd,
    mem: GuestMemoryMmap,
    vcpu_count: u8,
    /// vCPUs allowed to run (the first ones); the rest wait for a grant.
    vcpus_running: u8,
    mem_mib: u64,
    mem_max_mib: Option<u64>,
    dirty_log: bool,
    last_snapshot: Option<(PathBuf, u64)>,
    pending_vcpus: Vec<VcpuFd>,
    msr_list: Vec<u32>,
    bus: Bus,
    devices: Vec<MmioDevice>,
    reset_evt: Arc<EventFd>,
    panicked: Arc<AtomicBool>,
    serial_stdin: bool,
    irqfds: Vec<Arc<EventFd>>,
}

/// A VM with its TSS, in-kernel irqchip and PIT.
fn new_vm(kvm: &Kvm) -> Result<VmFd, VmmError> {
    let vm = kvm.create_vm().map_err(ioctl("KVM_CREATE_VM"))?;
    vm.set_tss_address(KVM_TSS_ADDRESS)
        .map_err(ioctl("KVM_SET_TSS_ADDR"))?;
    vm.create_irq_chip().map_err(ioctl("KVM_CREATE_IRQCHIP"))?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm.create_pit2(pit).map_err(ioctl("KVM_CREATE_PIT2"))?;
    Ok(vm)
}

/// Give KVM every RAM region (slot i = region i), logging dirty pages if asked.
fn register_memory(vm: &VmFd, mem: &GuestMemoryMmap, log_dirty: bool) -> Result<(), VmmError> {
    for (slot, region) in mem.iter().enumerate() {
        let r = kvm_userspace_memory_region {
            slot: slot as u32,
            guest_phys_addr: region.start_addr().0,
            memory_size: region.len(),
            userspace_addr: region.as_ptr() as u64,
            flags: if log_dirty { KVM_MEM_LOG_DIRTY_PAGES } else { 0 },
        };
        // SAFETY: the region belongs to `mem`, which the Vmm keeps
        // alive for as long as the VM exists.
        unsafe { vm.set_user_memory_region(r) }
            .map_err(ioctl("KVM_SET_USER_MEMORY_REGION"))?;
    }
    Ok(())
}

/// The console writer, watched for kernel panic messages.
fn serial_output(serial: &SerialOutput, panicked: &Arc<AtomicBool>) -> Result<SerialOut, VmmError> {
    let out: SerialOut = match serial {
        SerialOutput::Stdout => Box::new(std::io::stdout()),
        SerialOutput::File { path, max_bytes } => Box::new(
            crate::capped::RotatingFile::open(path, *max_bytes)
                .map_err(|e| VmmError::Io("cannot open serial log", e))?,
        ),
        SerialOutput::Discard => Box::new(std::io::sink()),
    };
    Ok(Box::new(PanicWatch {
        out,
        line: Vec::new(),
        panicked: panicked.clone(),
    }))
}

/// The KVM wiring of virtio device `index`: its MMIO window, interrupt line
/// (an irqfd) and one ioeventfd per queue.
struct VirtioWiring {
    base: u64,
    irq_line: u32,
    irq: IrqTrigger,
    queue_evts: Vec<EventFd>,
}

fn wire_virtio(vm: &VmFd, index: usize, queues: usize) -> Result<VirtioWiring, VmmError> {
    let base = VIRTIO_MMIO_START + index as u64 * VIRTIO_MMIO_SIZE;
    let irq_line = IRQ_VIRTIO_START + index as u32;
    if irq_line > IRQ_MAX {
        return Err(VmmError::Config(format!("too many devices: {}", index + 1)));
    }
    let irq = IrqTrigger::new().map_err(|e| VmmError::Io("eventfd", e))?;
    vm.register_irqfd(&irq.evt, irq_line)
        .map_err(ioctl("KVM_IRQFD"))?;
    let mut queue_evts = Vec::new();
    for q in 0..queues {
        let evt = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| VmmError::Io("eventfd", e))?;
        vm.register_ioevent(&evt, &IoEventAddress::Mmio(base + REG_QUEUE_NOTIFY), q as u32)
            .map_err(ioctl("KVM_IOEVENTFD"))?;
        queue_evts.push(evt);
    }
    Ok(VirtioWiring { base, irq_line, irq, queue_evts })
}

fn new_irqfd(vm: &VmFd, line: u32) -> Result<Arc<EventFd>, VmmError> {
    let evt = EventFd::new(libc::EFD_NONBLOCK).map_err(|e| VmmError::Io("eventfd", e))?;
    vm.register_irqfd(&evt, line).map_err(ioctl("KVM_IRQFD"))?;
    Ok(Arc::new(evt))
}
