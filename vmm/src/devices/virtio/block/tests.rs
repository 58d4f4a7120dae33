use std::io::{Read, Seek, SeekFrom, Write};

use crate::GuestMemoryMmap;
use vm_memory::{Bytes, GuestAddress};

use super::device::*;
use crate::devices::virtio::queue::testing::*;
use crate::devices::virtio::{Active, IrqTrigger, VirtioDevice};

struct Fixture {
    mem: GuestMemoryMmap,
    dq: DriverQueue,
    blk: Block,
    path: std::path::PathBuf,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

fn fixture(read_only: bool, name: &str) -> Fixture {
    let path = std::env::temp_dir().join(format!("burrow-blk-{}-{name}", std::process::id()));
    let mut f = std::fs::File::create(&path).unwrap();
    let mut img = vec![0u8; 8 * 512];
    img[512..1024].fill(0xab);
    f.write_all(&img).unwrap();
    let mem = memory(1 << 20);
    let dq = DriverQueue::new(0x1000, 16);
    let mut blk = Block::open(&path, read_only).unwrap();
    let queues = vec![dq.queue(&mem)];
    let irq = IrqTrigger::new().unwrap();
    blk.activate(Active { mem: mem.clone(), queues, irq, acked_features: 0 }).unwrap();
    Fixture { mem, dq, blk, path }
}

const HDR: u64 = 0x8000;
const DATA: u64 = 0x9000;
const STATUS: u64 = 0xa000;

fn header(mem: &GuestMemoryMmap, kind: u32, sector: u64) {
    mem.write_obj(kind, GuestAddress(HDR)).unwrap();
    mem.write_obj(0u32, GuestAddress(HDR + 4)).unwrap();
    mem.write_obj(sector, GuestAddress(HDR + 8)).unwrap();
}

fn three_desc(fx: &mut Fixture, data_len: u32, data_flags: u16) {
    fx.dq.set_desc(&fx.mem, 0, HDR, 16, VIRTQ_DESC_F_NEXT, 1);
    fx.dq.set_desc(&fx.mem, 1, DATA, data_len, VIRTQ_DESC_F_NEXT | data_flags, 2);
    fx.dq.set_desc(&fx.mem, 2, STATUS, 1, VIRTQ_DESC_F_WRITE, 0);
    fx.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    fx.dq.push_avail(&fx.mem, 0);
}

fn status(fx: &Fixture) -> u8 {
    fx.mem.read_obj(GuestAddress(STATUS)).unwrap()
}

#[test]
fn read_sector() {
    let mut fx = fixture(false, "read");
    header(&fx.mem, VIRTIO_BLK_T_IN, 1);
    three_desc(&mut fx, 512, VIRTQ_DESC_F_WRITE);
    fx.blk.process_queue(0).unwrap();
    assert_eq!(status(&fx), VIRTIO_BLK_S_OK);
    let b: u8 = fx.mem.read_obj(GuestAddress(DATA + 100)).unwrap();
    assert_eq!(b, 0xab);
    assert_eq!(fx.dq.used_idx(&fx.mem), 1);
    assert_eq!(fx.dq.used_elem(&fx.mem, 0), (0, 513));
    assert_eq!(fx.blk.error_count(), 0);
}

#[test]
fn write_then_flush() {
    let mut fx = fixture(false, "write");
    fx.mem.write_slice(&[0x5a; 1024], GuestAddress(DATA)).unwrap();
    header(&fx.mem, VIRTIO_BLK_T_OUT, 6);
    three_desc(&mut fx, 1024, 0);
    fx.blk.process_queue(0).unwrap();
    assert_eq!(status(&fx), VIRTIO_BLK_S_OK);
    header(&fx.mem, VIRTIO_BLK_T_FLUSH, 0);
    fx.dq.set_desc(&fx.mem, 0, HDR, 16, VIRTQ_DESC_F_NEXT, 2);
    fx.dq.push_avail(&fx.mem, 0);
    fx.blk.process_queue(0).unwrap();
    assert_eq!(status(&fx), VIRTIO_BLK_S_OK);
    let mut f = std::fs::File::open(&fx.path).unwrap();
    f.seek(SeekFrom::Start(6 * 512)).unwrap();
    let mut buf = [0u8; 1024];
    f.read_exact(&mut buf).unwrap();
    assert!(buf.iter().all(|&b| b == 0x5a));
}

#[test]
fn read_only_refuses_writes() {
    let mut fx = fixture(true, "ro");
    assert_ne!(fx.blk.avail_features() & (1 << 5), 0);
    header(&fx.mem, VIRTIO_BLK_T_OUT, 0);
    three_desc(&mut fx, 512, 0);
    fx.blk.process_queue(0).unwrap();
    assert_eq!(status(&fx), VIRTIO_BLK_S_IOERR);
}

#[test]
fn past_end_and_unsupported() {
    let mut fx = fixture(false, "end");
    header(&fx.mem, VIRTIO_BLK_T_IN, 7);
    three_desc(&mut fx, 1024, VIRTQ_DESC_F_WRITE);
    fx.blk.process_queue(0).unwrap();
    assert_eq!(status(&fx), VIRTIO_BLK_S_IOERR);
    header(&fx.mem, VIRTIO_BLK_T_IN, u64::MAX);
    three_desc(&mut fx, 512, VIRTQ_DESC_F_WRITE);
    fx.blk.process_queue(0).unwrap();
    assert_eq!(status(&fx), VIRTIO_BLK_S_IOERR);
    header(&fx.mem, 77, 0);
    three_desc(&mut fx, 512, VIRTQ_DESC_F_WRITE);
    fx.blk.process_queue(0).unwrap();
    assert_eq!(status(&fx), VIRTIO_BLK_S_UNSUPP);
}

#[test]
fn get_id() {
    let mut fx = fixture(false, "id");
    header(&fx.mem, VIRTIO_BLK_T_GET_ID, 0);
    three_desc(&mut fx, 20, VIRTQ_DESC_F_WRITE);
    fx.blk.process_queue(0).unwrap();
    let mut id = [0u8; 10];
    fx.mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
    assert_eq!(&id, b"burrow-blk");
}

#[test]
fn malformed_chains_are_device_errors() {
    let mut fx = fixture(false, "bad");
    // data address outside guest memory
    header(&fx.mem, VIRTIO_BLK_T_IN, 0);
    fx.dq.set_desc(&fx.mem, 0, HDR, 16, VIRTQ_DESC_F_NEXT, 1);
    fx.dq.set_desc(&fx.mem, 1, u64::MAX - 100, 512, VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE, 2);
    fx.dq.set_desc(&fx.mem, 2, STATUS, 1, VIRTQ_DESC_F_WRITE, 0);
    fx.dq.push_avail(&fx.mem, 0);
    fx.blk.process_queue(0).unwrap();
    assert_eq!(status(&fx), VIRTIO_BLK_S_IOERR);
    // huge length
    fx.dq.set_desc(&fx.mem, 1, DATA, u32::MAX, VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE, 2);
    fx.dq.push_avail(&fx.mem, 0);
    fx.blk.process_queue(0).unwrap();
    // header outside memory
    fx.dq.set_desc(&fx.mem, 0, 0xffff_ffff_0000, 16, VIRTQ_DESC_F_NEXT, 2);
    fx.dq.push_avail(&fx.mem, 0);
    fx.blk.process_queue(0).unwrap();
    // loop
    fx.dq.set_desc(&fx.mem, 0, HDR, 16, VIRTQ_DESC_F_NEXT, 1);
    fx.dq.set_desc(&fx.mem, 1, DATA, 512, VIRTQ_DESC_F_NEXT, 0);
    fx.dq.push_avail(&fx.mem, 0);
    fx.blk.process_queue(0).unwrap();
    // status descriptor read-only; header write-only
    fx.dq.set_desc(&fx.mem, 0, HDR, 16, VIRTQ_DESC_F_NEXT, 2);
    fx.dq.set_desc(&fx.mem, 2, STATUS, 1, 0, 0);
    fx.dq.push_avail(&fx.mem, 0);
    fx.blk.process_queue(0).unwrap();
    fx.dq.set_desc(&fx.mem, 0, HDR, 16, VIRTQ_DESC_F_WRITE, 0);
    fx.dq.push_avail(&fx.mem, 0);
    fx.blk.process_queue(0).unwrap();
    assert!(fx.blk.error_count() >= 5, "errors: {}", fx.blk.error_count());
    assert_eq!(fx.dq.used_idx(&fx.mem), 6, "every chain is returned");
    // a head index out of range cannot be returned: a queue-level error
    fx.dq.push_avail(&fx.mem, 1000);
    assert!(fx.blk.process_queue(0).is_err());
    // bogus avail index: a queue-level error
    fx.dq.set_avail_idx(&fx.mem, 5000);
    assert!(fx.blk.process_queue(0).is_err());
}

#[test]
fn odd_sized_image_is_refused() {
    let path = std::env::temp_dir().join(format!("burrow-blk-{}-odd", std::process::id()));
    std::fs::write(&path, [0u8; 100]).unwrap();
    assert!(Block::open(&path, true).is_err());
    std::fs::remove_file(&path).unwrap();
}
/// An activated empty slot on a fresh queue, and its interrupt.
fn slot_fixture(n: u32) -> (GuestMemoryMmap, DriverQueue, Block, IrqTrigger) {
    let mem = memory(1 << 20);
    let dq = DriverQueue::new(0x1000, 16);
    let mut blk = Block::slot(n);
    let irq = IrqTrigger::new().unwrap();
    let queues = vec![dq.queue(&mem)];
    blk.activate(Active {
        mem: mem.clone(),
        queues,
        irq: irq.clone(),
        acked_features: 0,
    })
    .unwrap();
    (mem, dq, blk, irq)
}

fn config_capacity(blk: &Block) -> u64 {
    let mut c = [0u8; 8];
    blk.read_config(0, &mut c);
    u64::from_le_bytes(c)
}

/// Post one 512-byte request of `kind` at `sector` and return its status.
fn one_request(
    mem: &GuestMemoryMmap,
    dq: &mut DriverQueue,
    blk: &mut Block,
    kind: u32,
    sector: u64,
) -> u8 {
    header(mem, kind, sector);
    let flags = if kind == VIRTIO_BLK_T_IN {
        VIRTQ_DESC_F_WRITE
    } else {
        0
    };
    dq.set_desc(mem, 0, HDR, 16, VIRTQ_DESC_F_NEXT, 1);
    dq.set_desc(mem, 1, DATA, 512, VIRTQ_DESC_F_NEXT | flags, 2);
    dq.set_desc(mem, 2, STATUS, 1, VIRTQ_DESC_F_WRITE, 0);
    mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    dq.push_avail(mem, 0);
    blk.process_queue(0).unwrap();
    mem.read_obj(GuestAddress(STATUS)).unwrap()
}

#[test]
fn slot_attach_shows_the_capacity_and_tells_the_guest() {
    use crate::devices::virtio::VIRTIO_MMIO_INT_CONFIG;
    use std::sync::atomic::Ordering;
    let (mem, mut dq, mut blk, irq) = slot_fixture(1);
    assert_eq!(blk.capacity(), 0);
    assert_eq!(config_capacity(&blk), 0);
    assert_eq!(
        one_request(&mem, &mut dq, &mut blk, VIRTIO_BLK_T_IN, 0),
        VIRTIO_BLK_S_IOERR
    );
    // Its serial names the slot.
    header(&mem, VIRTIO_BLK_T_GET_ID, 0);
    dq.set_desc(&mem, 0, HDR, 16, VIRTQ_DESC_F_NEXT, 1);
    dq.set_desc(&mem, 1, DATA, 20, VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE, 2);
    dq.set_desc(&mem, 2, STATUS, 1, VIRTQ_DESC_F_WRITE, 0);
    dq.push_avail(&mem, 0);
    blk.process_queue(0).unwrap();
    let mut id = [0u8; 13];
    mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
    assert_eq!(&id, b"burrow-slot-1");
    let _ = irq.evt.read();
    irq.status.store(0, Ordering::SeqCst);

    let fx = fixture(false, "slot-backing");
    let generation = blk.config_generation();
    blk.attach(&fx.path, false).unwrap();
    assert_eq!(blk.capacity(), 8);
    assert_eq!(config_capacity(&blk), 8, "the guest reads the new capacity");
    assert_ne!(blk.config_generation(), generation);
    assert_eq!(
        irq.status.load(Ordering::SeqCst) & VIRTIO_MMIO_INT_CONFIG,
        VIRTIO_MMIO_INT_CONFIG
    );
    assert_eq!(
        irq.evt.read().unwrap(),
        1,
        "the config-change interrupt was raised"
    );
    assert_eq!(blk.attached(), Some(fx.path.as_path()));
    assert_eq!(
        one_request(&mem, &mut dq, &mut blk, VIRTIO_BLK_T_IN, 1),
        VIRTIO_BLK_S_OK
    );
    let b: u8 = mem.read_obj(GuestAddress(DATA + 7)).unwrap();
    assert_eq!(b, 0xab, "it reads the attached file");

    let _ = irq.evt.read();
    blk.detach().unwrap();
    assert_eq!(config_capacity(&blk), 0);
    assert_eq!(blk.attached(), None);
    assert_eq!(irq.evt.read().unwrap(), 1);
    assert_eq!(
        one_request(&mem, &mut dq, &mut blk, VIRTIO_BLK_T_IN, 1),
        VIRTIO_BLK_S_IOERR
    );
}

#[test]
fn slot_read_only_attachment_refuses_writes() {
    let (mem, mut dq, mut blk, _irq) = slot_fixture(0);
    let fx = fixture(false, "slot-ro");
    blk.attach(&fx.path, true).unwrap();
    assert_eq!(
        one_request(&mem, &mut dq, &mut blk, VIRTIO_BLK_T_OUT, 0),
        VIRTIO_BLK_S_IOERR
    );
    assert_eq!(
        one_request(&mem, &mut dq, &mut blk, VIRTIO_BLK_T_IN, 1),
        VIRTIO_BLK_S_OK
    );
    // Swapped for a writable one: writes land in the new file.
    let other = fixture(false, "slot-rw");
    blk.attach(&other.path, false).unwrap();
    mem.write_slice(&[0x77; 512], GuestAddress(DATA)).unwrap();
    assert_eq!(
        one_request(&mem, &mut dq, &mut blk, VIRTIO_BLK_T_OUT, 2),
        VIRTIO_BLK_S_OK
    );
    let data = std::fs::read(&other.path).unwrap();
    assert_eq!(data[2 * 512], 0x77);
    assert_eq!(
        std::fs::read(&fx.path).unwrap()[2 * 512],
        0,
        "the first file is untouched"
    );
}

#[test]
fn slot_errors_leave_it_as_it_was() {
    use super::SlotError;
    let (_mem, _dq, mut blk, _irq) = slot_fixture(0);
    let fx = fixture(false, "slot-keep");
    blk.attach(&fx.path, false).unwrap();
    let missing = std::env::temp_dir().join(format!("burrow-blk-{}-missing", std::process::id()));
    assert!(matches!(
        blk.attach(&missing, false),
        Err(SlotError::Open(_))
    ));
    assert_eq!(blk.attached(), Some(fx.path.as_path()));
    assert_eq!(blk.capacity(), 8);
    // A plain disk is not a slot.
    let mut plain = fixture(false, "slot-plain");
    assert!(matches!(
        plain.blk.attach(&fx.path, false),
        Err(SlotError::NotASlot)
    ));
    assert!(matches!(plain.blk.detach(), Err(SlotError::NotASlot)));
}

#[test]
fn slot_state_round_trips_with_its_attachment() {
    use super::persist::{BlockContext, BlockState};
    use crate::devices::virtio::persist::DeviceContext;
    use crate::snapshot::Persist;
    let ctx = |path: std::path::PathBuf| BlockContext {
        path,
        device: DeviceContext {
            mem: memory(1 << 20),
            irq: IrqTrigger::new().unwrap(),
            acked_features: 0,
        },
    };
    let empty = Block::slot(3);
    let state = empty.save();
    assert_eq!(state.slot, Some(3));
    let json = serde_json::to_string(&state).unwrap();
    let back: BlockState = serde_json::from_str(&json).unwrap();
    let restored = Block::restore(ctx(back.path.clone()), &back).unwrap();
    assert_eq!((restored.slot_index(), restored.capacity()), (Some(3), 0));

    let fx = fixture(false, "slot-persist");
    let mut full = Block::slot(1);
    full.attach(&fx.path, true).unwrap();
    let state = full.save();
    let mut restored = Block::restore(ctx(state.path.clone()), &state).unwrap();
    assert_eq!(restored.attached(), Some(fx.path.as_path()));
    assert_eq!((restored.capacity(), restored.read_only()), (8, true));
    restored.detach().unwrap();
    // A plain disk's state has no slot field (older snapshots read alike).
    let plain = serde_json::to_value(fx.blk.save()).unwrap();
    assert!(plain.get("slot").is_none(), "{plain}");
}
