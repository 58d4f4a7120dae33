use std::io::{Read, Seek, SeekFrom, Write};

use crate::GuestMemoryMmap;
use vm_memory::{Bytes, GuestAddress};

use super::device::*;
use crate::devices::virtio::queue::testing::*;
use crate::devices::virtio::{IrqTrigger, VirtioDevice};

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
    blk.activate(mem.clone(), vec![dq.queue(&mem)], IrqTrigger::new().unwrap(), 0).unwrap();
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
