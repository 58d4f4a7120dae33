//! One generic test for every [`Persist`] implementation, in the spirit of
//! crosvm's `Suspendable` test macro: put the part in a non-trivial state,
//! save it, push the state through the real state-file encoding, rebuild
//! the part from it, and check the rebuilt part saves the same state. Each
//! device adds one `persist_round_trip!` line.

use std::fmt::Debug;
use std::path::PathBuf;
use std::sync::Arc;

use virtio_queue::QueueT;
use crate::GuestMemoryMmap;
use vm_memory::{Bytes, GuestAddress};
use vmm_sys_util::eventfd::EventFd;

use super::format::{decode, encode};
use super::Persist;
use crate::devices::i8042::persist::I8042Context;
use crate::devices::i8042::I8042;
use crate::devices::serial::persist::SerialContext;
use crate::devices::serial::{IrqEvt, Serial};
use crate::devices::virtio::block::persist::BlockContext;
use crate::devices::virtio::block::Block;
use crate::devices::virtio::mem::persist::MemContext;
use crate::devices::virtio::mem::{Mem, BLOCK_SIZE};
use crate::devices::virtio::mmio::MmioTransport;
use crate::devices::virtio::persist::{DeviceContext, DeviceState, MmioContext, VirtioPersistError};
use crate::devices::virtio::queue::testing::{memory, DriverQueue, VIRTQ_DESC_F_WRITE};
use crate::devices::virtio::vsock::persist::{VsockContext, VIRTIO_VSOCK_EVENT_TRANSPORT_RESET};
use crate::devices::virtio::vsock::Vsock;
use crate::devices::virtio::{Active, IrqTrigger, VirtioDevice, VIRTIO_F_VERSION_1};

/// Save `part`, encode and decode the state as a state file does, rebuild
/// with the context `ctx` makes from the decoded state, and compare.
fn round_trip<T: Persist>(part: &T, ctx: impl FnOnce(&T::State) -> T::Context) -> T
where
    T::State: PartialEq + Debug,
    T::Error: Debug,
{
    let saved = part.save();
    let bytes = encode(&saved).expect("state encodes");
    let decoded: T::State = decode(&bytes).expect("state decodes");
    assert_eq!(decoded, saved, "state survives the state file");
    let rebuilt = T::restore(ctx(&decoded), &decoded).expect("part restores from its own state");
    assert_eq!(rebuilt.save(), saved, "the rebuilt part saves the same state");
    rebuilt
}

macro_rules! persist_round_trip {
    ($name:ident, $make:expr, $ctx:expr, $check:expr) => {
        #[test]
        fn $name() {
            let fx = Fixture::new(stringify!($name));
            let part = ($make)(&fx);
            let rebuilt = round_trip(&part, |s| ($ctx)(&fx, s));
            ($check)(&fx, &rebuilt);
        }
    };
}

/// Guest memory, a disk image and a socket path for one test.
struct Fixture {
    dir: PathBuf,
    mem: GuestMemoryMmap,
}

impl Fixture {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("burrow-persist-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("disk.img"), vec![7u8; 64 * 512]).unwrap();
        Self { dir, mem: memory(1 << 20) }
    }
    fn disk(&self) -> PathBuf {
        self.dir.join("disk.img")
    }
    fn sock(&self) -> PathBuf {
        self.dir.join("v.sock")
    }
    /// What a driver hands over: `queues`, a fresh interrupt, VERSION_1.
    fn active(&self, queues: Vec<virtio_queue::Queue>) -> Active {
        let irq = IrqTrigger::new().unwrap();
        Active { mem: self.mem.clone(), queues, irq, acked_features: VIRTIO_F_VERSION_1 }
    }

    fn device_ctx(&self, acked_features: u64) -> DeviceContext {
        DeviceContext { mem: self.mem.clone(), irq: IrqTrigger::new().unwrap(), acked_features }
    }
    /// Queues of `sizes` in guest memory, advanced as if they had been used.
    fn queues(&self, sizes: &[u16]) -> Vec<virtio_queue::Queue> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &s)| {
                let mut q = DriverQueue::new(0x1000 + 0x4000 * i as u64, s).queue(&self.mem);
                q.set_next_avail(3 + i as u16);
                q.set_next_used(2 + i as u16);
                q
            })
            .collect()
    }
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn evt() -> Arc<EventFd> {
    Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap())
}

fn active_block(fx: &Fixture) -> Block {
    let mut b = Block::open(&fx.disk(), false).unwrap();
    let q = fx.queues(b.queue_max_sizes());
    b.activate(fx.active(q)).unwrap();
    b
}

fn active_vsock(fx: &Fixture) -> Vsock {
    let mut v = Vsock::new(7, &fx.sock()).unwrap();
    let q = fx.queues(v.queue_max_sizes());
    v.activate(fx.active(q)).unwrap();
    v
}

/// A transport whose driver went through the handshake, with a few
/// registers off their reset values.
fn transport(fx: &Fixture, dev: Box<dyn VirtioDevice>) -> MmioTransport {
    use crate::devices::virtio::mmio::*;
    let sizes = dev.queue_max_sizes().to_vec();
    let mut t = MmioTransport::new(dev, fx.mem.clone(), IrqTrigger::new().unwrap()).unwrap();
    let w = |t: &mut MmioTransport, off: u64, v: u32| t.write(off, &v.to_le_bytes());
    w(&mut t, REG_STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER);
    w(&mut t, REG_DRIVER_FEATURES_SEL, 1);
    w(&mut t, REG_DRIVER_FEATURES, 1);
    w(&mut t, REG_STATUS, STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK);
    for (i, &s) in sizes.iter().enumerate() {
        let dq = DriverQueue::new(0x1000 + 0x4000 * i as u64, s);
        w(&mut t, REG_QUEUE_SEL, i as u32);
        w(&mut t, REG_QUEUE_NUM, u32::from(s));
        w(&mut t, REG_QUEUE_DESC_LOW, dq.desc as u32);
        w(&mut t, REG_QUEUE_AVAIL_LOW, dq.avail as u32);
        w(&mut t, REG_QUEUE_USED_LOW, dq.used as u32);
        w(&mut t, REG_QUEUE_READY, 1);
    }
    w(&mut t, REG_STATUS, 0xf);
    assert!(t.device().is_activated());
    w(&mut t, REG_DEVICE_FEATURES_SEL, 1);
    t
}

/// Rebuild the device a transport state carries, as the VMM does.
fn device_from(fx: &Fixture, s: &crate::devices::virtio::persist::MmioState) -> Box<dyn VirtioDevice> {
    let ctx = fx.device_ctx(s.registers.acked_features);
    match &s.device {
        DeviceState::Block(b) => Box::new(Block::restore(BlockContext { path: fx.disk(), device: ctx }, b).unwrap()),
        DeviceState::Vsock(v) => Box::new(Vsock::restore(VsockContext { uds_path: fx.sock(), device: ctx }, v).unwrap()),
        DeviceState::Net(_) => panic!("the NIC's round trip is in devices/virtio/net/tests.rs"),
        DeviceState::Mem(m) => Box::new(Mem::restore(MemContext { host: None, device: ctx }, m).unwrap()),
        DeviceState::Unsupported(t) => panic!("device type {t} has no snapshot support"),
    }
}

/// A virtio-mem device with memory requested (its host memory is not
/// needed here: the plugged contents are the memory file's, see
/// `devices/virtio/mem/tests.rs`).
fn active_mem(fx: &Fixture) -> Mem {
    let mut m = Mem::new(4 << 30, 256 << 20, None).unwrap();
    let q = fx.queues(m.queue_max_sizes());
    m.activate(fx.active(q)).unwrap();
    m.set_requested_size(24 * BLOCK_SIZE).unwrap();
    m
}

fn serial_with_input(_: &Fixture) -> Serial {
    let mut s = Serial::new(IrqEvt(evt()), Box::new(std::io::sink()));
    s.write(3, 0x80); // DLAB
    s.write(0, 0x0c); // divisor 12
    s.write(3, 0x03); // 8N1
    s.write(1, 0x01); // RX interrupt on
    s.write(7, 0x5a); // scratch
    s.enqueue_input(b"abc");
    s
}

fn i8042_with_output(_: &Fixture) -> I8042 {
    let mut k = I8042::new(evt(), evt());
    k.write(4, 0xad); // disable keyboard
    k.write(4, 0x20); // read CTR: one byte queued
    k.write(4, 0x60); // write CTR: waits for its data byte
    k
}

persist_round_trip!(
    serial_round_trip,
    serial_with_input,
    |_: &Fixture, _: &_| SerialContext { irq: IrqEvt(evt()), out: Box::new(std::io::sink()) },
    |_: &Fixture, s: &Serial| assert_eq!((s.save().0.scratch, s.save().0.in_buffer), (0x5a, b"abc".to_vec()))
);

persist_round_trip!(
    i8042_round_trip,
    i8042_with_output,
    |_: &Fixture, _: &_| I8042Context { irq: evt(), reset: evt() },
    |_: &Fixture, k: &I8042| assert_eq!(k.save().pending_cmd, Some(0x60))
);

persist_round_trip!(
    block_round_trip,
    active_block,
    |fx: &Fixture, _: &_| BlockContext { path: fx.disk(), device: fx.device_ctx(VIRTIO_F_VERSION_1) },
    |_: &Fixture, b: &Block| {
        assert!(b.is_activated());
        let q = b.save().base.active.unwrap().queues;
        assert_eq!((q[0].0.next_avail, q[0].0.next_used), (3, 2));
    }
);

persist_round_trip!(
    vsock_round_trip,
    active_vsock,
    |fx: &Fixture, _: &_| VsockContext { uds_path: fx.sock(), device: fx.device_ctx(VIRTIO_F_VERSION_1) },
    |fx: &Fixture, v: &Vsock| {
        assert!(v.is_activated());
        assert!(fx.sock().exists(), "host socket listens again");
    }
);

persist_round_trip!(
    mmio_block_round_trip,
    |fx: &Fixture| transport(fx, Box::new(Block::open(&fx.disk(), true).unwrap())),
    |fx: &Fixture, s: &_| MmioContext { device: device_from(fx, s), mem: fx.mem.clone(), irq: IrqTrigger::new().unwrap() },
    |_: &Fixture, t: &MmioTransport| {
        assert!(t.device().is_activated());
        assert_eq!(t.registers().features_sel, 1);
    }
);

persist_round_trip!(
    mem_round_trip,
    active_mem,
    |fx: &Fixture, _: &_| MemContext { host: None, device: fx.device_ctx(VIRTIO_F_VERSION_1) },
    |_: &Fixture, m: &Mem| {
        assert!(m.is_activated());
        assert_eq!((m.requested_size(), m.region_size()), (24 * BLOCK_SIZE, 256 << 20));
    }
);

persist_round_trip!(
    mmio_mem_round_trip,
    |fx: &Fixture| transport(fx, Box::new(active_mem_unactivated())),
    |fx: &Fixture, s: &_| MmioContext { device: device_from(fx, s), mem: fx.mem.clone(), irq: IrqTrigger::new().unwrap() },
    |_: &Fixture, t: &MmioTransport| assert!(matches!(t.save().device, DeviceState::Mem(ref m) if m.requested_size == 4 * BLOCK_SIZE))
);

fn active_mem_unactivated() -> Mem {
    let mut m = Mem::new(4 << 30, 128 << 20, None).unwrap();
    m.set_requested_size(4 * BLOCK_SIZE).unwrap();
    m
}

persist_round_trip!(
    mmio_vsock_round_trip,
    |fx: &Fixture| transport(fx, Box::new(Vsock::new(9, &fx.sock()).unwrap())),
    |fx: &Fixture, s: &_| MmioContext { device: device_from(fx, s), mem: fx.mem.clone(), irq: IrqTrigger::new().unwrap() },
    |_: &Fixture, t: &MmioTransport| assert!(matches!(t.save().device, DeviceState::Vsock(ref v) if v.cid == 9))
);

#[test]
fn serial_restores_its_registers_and_input() {
    let fx = Fixture::new("serial-regs");
    let s = serial_with_input(&fx);
    let mut r = Serial::restore(SerialContext { irq: IrqEvt(evt()), out: Box::new(std::io::sink()) }, &s.save()).unwrap();
    assert_eq!(r.read(7), 0x5a, "scratch register");
    assert_eq!(r.read(0), b'a', "pending input survives");
    let mut too_much = s.save();
    too_much.0.in_buffer = vec![0; 1 << 16];
    assert!(Serial::restore(SerialContext { irq: IrqEvt(evt()), out: Box::new(std::io::sink()) }, &too_much).is_err());
}

#[test]
fn restore_refuses_state_that_does_not_fit() {
    let fx = Fixture::new("refuse");
    // A disk of another size.
    let mut st = active_block(&fx).save();
    st.capacity += 1;
    let e = Block::restore(BlockContext { path: fx.disk(), device: fx.device_ctx(0) }, &st).err().unwrap();
    assert!(e.to_string().contains("bytes"), "{e}");
    // A queue outside guest memory.
    let mut st = active_block(&fx).save();
    if let Some(a) = st.base.active.as_mut() {
        a.queues[0].0.desc_table = 0xfff_0000;
    }
    let e = Block::restore(BlockContext { path: fx.disk(), device: fx.device_ctx(0) }, &st).err().unwrap();
    assert!(matches!(e, VirtioPersistError::Queue { index: 0, .. }), "{e}");
    // A queue larger than the device offers.
    let mut st = active_vsock(&fx).save();
    if let Some(a) = st.base.active.as_mut() {
        a.queues[2].0.max_size = 1024;
    }
    assert!(Vsock::restore(VsockContext { uds_path: fx.sock(), device: fx.device_ctx(0) }, &st).is_err());
    // Too few queues.
    let mut st = active_vsock(&fx).save();
    if let Some(a) = st.base.active.as_mut() {
        a.queues.pop();
    }
    assert!(matches!(
        Vsock::restore(VsockContext { uds_path: fx.sock(), device: fx.device_ctx(0) }, &st),
        Err(VirtioPersistError::QueueCount { expected: 3, found: 2 })
    ));
    // A transport state for another device type.
    let t = transport(&fx, Box::new(Block::open(&fx.disk(), true).unwrap()));
    let st = t.save();
    let ctx = MmioContext {
        device: Box::new(Vsock::new(3, &fx.sock()).unwrap()),
        mem: fx.mem.clone(),
        irq: IrqTrigger::new().unwrap(),
    };
    assert!(matches!(MmioTransport::restore(ctx, &st), Err(VirtioPersistError::DeviceType { .. })));
    // An i8042 buffer over its size.
    let mut st = i8042_with_output(&fx).save();
    st.buf = vec![0; 100];
    assert!(I8042::restore(I8042Context { irq: evt(), reset: evt() }, &st).is_err());
}

#[test]
fn vsock_sends_transport_reset_after_restore() {
    let fx = Fixture::new("reset");
    let mut v = Vsock::new(5, &fx.sock()).unwrap();
    let sizes = v.queue_max_sizes().to_vec();
    let mut evq = DriverQueue::new(0x1000 + 0x4000 * 2, sizes[2]);
    let queues: Vec<_> = sizes
        .iter()
        .enumerate()
        .map(|(i, &s)| DriverQueue::new(0x1000 + 0x4000 * i as u64, s).queue(&fx.mem))
        .collect();
    let irq = IrqTrigger::new().unwrap();
    v.activate(Active { irq, ..fx.active(queues) }).unwrap();
    fx.mem.write_obj(0xffff_ffffu32, GuestAddress(0x20000)).unwrap();
    evq.set_desc(&fx.mem, 0, 0x20000, 8, VIRTQ_DESC_F_WRITE, 0);
    evq.push_avail(&fx.mem, 0);
    let st = v.save();
    let ctx = VsockContext { uds_path: fx.sock(), device: fx.device_ctx(VIRTIO_F_VERSION_1) };
    let irq_evt = ctx.device.irq.evt.clone();
    let mut r = Vsock::restore(ctx, &st).unwrap();
    r.on_restored().unwrap();
    assert_eq!(evq.used_idx(&fx.mem), 1, "event buffer used");
    assert_eq!(evq.used_elem(&fx.mem, 0), (0, 4));
    let id: u32 = fx.mem.read_obj(GuestAddress(0x20000)).unwrap();
    assert_eq!(id, VIRTIO_VSOCK_EVENT_TRANSPORT_RESET);
    assert_eq!(irq_evt.read().unwrap(), 1, "guest interrupted");
}

#[test]
fn block_serves_a_request_posted_before_the_snapshot() {
    use crate::devices::virtio::queue::testing::VIRTQ_DESC_F_NEXT;
    let fx = Fixture::new("pending");
    let mut b = Block::open(&fx.disk(), false).unwrap();
    let mut dq = DriverQueue::new(0x1000, b.queue_max_sizes()[0]);
    b.activate(fx.active(vec![dq.queue(&fx.mem)])).unwrap();
    // A read of sector 0, posted but never notified to this VMM.
    fx.mem.write_obj(0u32, GuestAddress(0x8000)).unwrap(); // VIRTIO_BLK_T_IN
    fx.mem.write_obj(0u64, GuestAddress(0x8008)).unwrap();
    dq.set_desc(&fx.mem, 0, 0x8000, 16, VIRTQ_DESC_F_NEXT, 1);
    dq.set_desc(&fx.mem, 1, 0x9000, 512, VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE, 2);
    dq.set_desc(&fx.mem, 2, 0xa000, 1, VIRTQ_DESC_F_WRITE, 0);
    dq.push_avail(&fx.mem, 0);
    let st = b.save();
    let mut r = Block::restore(BlockContext { path: fx.disk(), device: fx.device_ctx(VIRTIO_F_VERSION_1) }, &st).unwrap();
    assert_eq!(dq.used_idx(&fx.mem), 0);
    r.on_restored().unwrap();
    assert_eq!(dq.used_idx(&fx.mem), 1, "pending request served after restore");
    assert_eq!(fx.mem.read_obj::<u8>(GuestAddress(0x9000)).unwrap(), 7, "disk data read");
}
