use std::sync::atomic::Ordering;

use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend};

use super::device::*;
use super::persist::{check, MemContext};
use crate::devices::virtio::persist::DeviceContext;
use crate::devices::virtio::queue::testing::*;
use crate::devices::virtio::{
    Active, IrqTrigger, VirtioDevice, TYPE_MEM, VIRTIO_F_VERSION_1, VIRTIO_MMIO_INT_CONFIG,
};
use crate::snapshot::Persist;
use crate::GuestMemoryMmap;

const RAM: usize = 1 << 20;
const REGION: u64 = 4 << 30;
const SIZE: u64 = 128 << 20;
const REQ: u64 = 0x8000;
const RESP: u64 = 0x9000;

/// RAM at 0 (queues, requests) and a 128 MiB hotplug region at 4 GiB.
fn memory_with_region() -> GuestMemoryMmap {
    let ram = memory(RAM);
    let region = hotplug_mapping(REGION, SIZE).unwrap();
    ram.insert_region(std::sync::Arc::new(region)).unwrap()
}

struct Fixture {
    mem: GuestMemoryMmap,
    dq: DriverQueue,
    dev: Mem,
    irq: IrqTrigger,
}

fn fixture() -> Fixture {
    let mem = memory_with_region();
    let dq = DriverQueue::new(0x1000, QUEUE_SIZE);
    let mut dev = Mem::new(REGION, SIZE, Some(mem.clone())).unwrap();
    let irq = IrqTrigger::new().unwrap();
    let queues = vec![dq.queue(&mem)];
    dev.activate(Active { mem: mem.clone(), queues, irq: irq.clone(), acked_features: VIRTIO_F_VERSION_1 })
        .unwrap();
    Fixture { mem, dq, dev, irq }
}

fn write_req(mem: &GuestMemoryMmap, kind: u16, addr: u64, nb: u16) {
    let mut r = [0u8; 24];
    r[0..2].copy_from_slice(&kind.to_le_bytes());
    r[8..16].copy_from_slice(&addr.to_le_bytes());
    r[16..18].copy_from_slice(&nb.to_le_bytes());
    mem.write_slice(&r, GuestAddress(REQ)).unwrap();
}

/// Post a request chain (request, response) and return (type, state).
fn request(fx: &mut Fixture, kind: u16, addr: u64, nb: u16) -> (u16, u16) {
    write_req(&fx.mem, kind, addr, nb);
    fx.dq.set_desc(&fx.mem, 0, REQ, 24, VIRTQ_DESC_F_NEXT, 1);
    fx.dq.set_desc(&fx.mem, 1, RESP, 10, VIRTQ_DESC_F_WRITE, 0);
    post(fx)
}

fn post(fx: &mut Fixture) -> (u16, u16) {
    fx.mem.write_slice(&[0xff; 10], GuestAddress(RESP)).unwrap();
    fx.dq.push_avail(&fx.mem, 0);
    fx.dev.process_queue(0).unwrap();
    let t: u16 = fx.mem.read_obj(GuestAddress(RESP)).unwrap();
    let s: u16 = fx.mem.read_obj(GuestAddress(RESP + 8)).unwrap();
    (t, s)
}

fn block(i: u64) -> u64 {
    REGION + i * BLOCK_SIZE
}

fn config(dev: &Mem) -> [u64; 7] {
    let mut c = [0u8; 56];
    dev.read_config(0, &mut c);
    let mut out = [0u64; 7];
    for (i, o) in out.iter_mut().enumerate() {
        let mut w = [0u8; 8];
        w.copy_from_slice(&c[i * 8..i * 8 + 8]);
        *o = u64::from_le_bytes(w);
    }
    out
}

#[test]
fn identity_and_config_space() {
    let fx = fixture();
    assert_eq!(fx.dev.device_type(), TYPE_MEM);
    assert_eq!(fx.dev.avail_features(), VIRTIO_F_VERSION_1);
    assert_eq!(fx.dev.queue_max_sizes().len(), 1);
    // block_size, node_id+padding, addr, region_size, usable, plugged, requested
    assert_eq!(config(&fx.dev), [BLOCK_SIZE, 0, REGION, SIZE, SIZE, 0, 0]);
    let mut past = [0xffu8; 8];
    fx.dev.read_config(56, &mut past);
    assert_eq!(past, [0; 8]);
}

#[test]
fn regions_are_placed_above_ram_and_4g() {
    assert_eq!(region_for(256 << 20, 0), None);
    assert_eq!(region_for(256 << 20, 768 << 20), Some((4 << 30, 768 << 20)));
    // Rounded up to whole memory blocks.
    assert_eq!(region_for(256 << 20, 100 << 20), Some((4 << 30, 128 << 20)));
    // RAM above 4 GiB: the next 128 MiB boundary past it.
    let end = (4u64 << 30) + (1 << 30) + (1 << 20);
    assert_eq!(region_for(end, 1 << 30), Some(((5u64 << 30) + (128 << 20), 1 << 30)));
    assert!(Mem::new(REGION + (1 << 20), SIZE, None).is_err(), "misaligned");
    assert!(Mem::new(1 << 30, SIZE, None).is_err(), "below 4 GiB");
    assert!(Mem::new(REGION, SIZE + BLOCK_SIZE, None).is_err(), "not whole memory blocks");
    // The region must be a region of the memory given.
    assert!(Mem::new(REGION + SIZE, SIZE, Some(memory_with_region())).is_err());
}

#[test]
fn plug_within_the_requested_size_and_nack_beyond() {
    let mut fx = fixture();
    assert_eq!(request(&mut fx, REQ_PLUG, block(0), 1).0, RESP_NACK, "nothing requested yet");
    fx.dev.set_requested_size(3 * BLOCK_SIZE).unwrap();
    assert_eq!(request(&mut fx, REQ_PLUG, block(0), 2).0, RESP_ACK);
    assert_eq!(fx.dev.plugged_size(), 2 * BLOCK_SIZE);
    // Plugged memory is usable by the guest and by device emulation.
    fx.mem.write_obj(0xabcdu32, GuestAddress(block(1) + 4096)).unwrap();
    assert_eq!(fx.mem.read_obj::<u32>(GuestAddress(block(1) + 4096)).unwrap(), 0xabcd);
    assert_eq!(request(&mut fx, REQ_PLUG, block(5), 2).0, RESP_NACK, "past the requested size");
    assert_eq!(request(&mut fx, REQ_PLUG, block(5), 1).0, RESP_ACK);
    assert_eq!(config(&fx.dev)[5], 3 * BLOCK_SIZE, "plugged_size in config space");
    assert_eq!(fx.dev.plugged_ranges(), vec![(block(0), 2 * BLOCK_SIZE), (block(5), BLOCK_SIZE)]);
    assert_eq!(fx.dev.error_count(), 0);
    assert_eq!(fx.dq.used_idx(&fx.mem), 4);
    assert_eq!(fx.dq.used_elem(&fx.mem, 3), (0, 10));
}

#[test]
fn unplug_discards_and_state_reports() {
    let mut fx = fixture();
    fx.dev.set_requested_size(4 * BLOCK_SIZE).unwrap();
    assert_eq!(request(&mut fx, REQ_PLUG, block(10), 4).0, RESP_ACK);
    fx.mem.write_obj(7u64, GuestAddress(block(11))).unwrap();
    assert_eq!(request(&mut fx, REQ_STATE, block(10), 4), (RESP_ACK, STATE_PLUGGED));
    assert_eq!(request(&mut fx, REQ_STATE, block(9), 2), (RESP_ACK, STATE_MIXED));
    assert_eq!(request(&mut fx, REQ_STATE, block(0), 9), (RESP_ACK, STATE_UNPLUGGED));
    assert_eq!(request(&mut fx, REQ_UNPLUG, block(11), 1).0, RESP_ACK);
    assert_eq!(fx.dev.plugged_size(), 3 * BLOCK_SIZE);
    assert_eq!(request(&mut fx, REQ_STATE, block(10), 4), (RESP_ACK, STATE_MIXED));
    // Unplugging what is not plugged is an error.
    assert_eq!(request(&mut fx, REQ_UNPLUG, block(11), 1).0, RESP_ERROR);
    // Plugged again, its old contents are gone.
    assert_eq!(request(&mut fx, REQ_PLUG, block(11), 1).0, RESP_ACK);
    assert_eq!(fx.mem.read_obj::<u64>(GuestAddress(block(11))).unwrap(), 0);
    // Plugging what is plugged is an error too.
    fx.dev.set_requested_size(8 * BLOCK_SIZE).unwrap();
    assert_eq!(request(&mut fx, REQ_PLUG, block(12), 2).0, RESP_ERROR);
    assert_eq!(fx.dev.error_count(), 2);
}

#[test]
fn unplug_all_empties_the_region() {
    let mut fx = fixture();
    fx.dev.set_requested_size(SIZE).unwrap();
    assert_eq!(request(&mut fx, REQ_PLUG, block(0), 3).0, RESP_ACK);
    assert_eq!(request(&mut fx, REQ_PLUG, block(63), 1).0, RESP_ACK);
    fx.mem.write_obj(9u8, GuestAddress(block(63))).unwrap();
    assert_eq!(request(&mut fx, REQ_UNPLUG_ALL, 0, 0).0, RESP_ACK);
    assert_eq!(fx.dev.plugged_size(), 0);
    assert!(fx.dev.plugged_ranges().is_empty());
    assert_eq!(config(&fx.dev)[5], 0);
    assert_eq!(request(&mut fx, REQ_STATE, block(0), 64), (RESP_ACK, STATE_UNPLUGGED));
    assert_eq!(request(&mut fx, REQ_PLUG, block(63), 1).0, RESP_ACK);
    assert_eq!(fx.mem.read_obj::<u8>(GuestAddress(block(63))).unwrap(), 0);
}

#[test]
fn invalid_ranges_are_errors_not_panics() {
    let mut fx = fixture();
    fx.dev.set_requested_size(SIZE).unwrap();
    for (kind, addr, nb) in [
        (REQ_PLUG, block(0), 0),                 // no blocks
        (REQ_PLUG, block(0) + 4096, 1),          // misaligned
        (REQ_PLUG, REGION - BLOCK_SIZE, 1),      // below the region
        (REQ_PLUG, block(63), 2),                // past its end
        (REQ_PLUG, block(64), 1),                // just past it
        (REQ_UNPLUG, u64::MAX - 4095, u16::MAX), // overflow
        (REQ_STATE, block(0), u16::MAX),         // far past its end
        (REQ_STATE, u64::MAX, 1),
        (REQ_PLUG, 0, 1),                        // RAM
        (77, block(0), 1),                       // unknown type
    ] {
        assert_eq!(request(&mut fx, kind, addr, nb).0, RESP_ERROR, "{kind} {addr:#x} {nb}");
    }
    assert_eq!(fx.dev.error_count(), 10);
    assert_eq!(fx.dev.plugged_size(), 0);
}

#[test]
fn malformed_chains_are_answered_or_dropped() {
    let mut fx = fixture();
    write_req(&fx.mem, REQ_STATE, block(0), 1);
    // Request too short: ERROR in the response.
    fx.dq.set_desc(&fx.mem, 0, REQ, 23, VIRTQ_DESC_F_NEXT, 1);
    fx.dq.set_desc(&fx.mem, 1, RESP, 10, VIRTQ_DESC_F_WRITE, 0);
    assert_eq!(post(&mut fx).0, RESP_ERROR);
    // Request write-only: ERROR.
    fx.dq.set_desc(&fx.mem, 0, REQ, 24, VIRTQ_DESC_F_NEXT | VIRTQ_DESC_F_WRITE, 1);
    assert_eq!(post(&mut fx).0, RESP_ERROR);
    // Request outside guest memory: ERROR.
    fx.dq.set_desc(&fx.mem, 0, u64::MAX - 10, 24, VIRTQ_DESC_F_NEXT, 1);
    assert_eq!(post(&mut fx).0, RESP_ERROR);
    // Response read-only or short: nowhere to answer; returned unused.
    fx.dq.set_desc(&fx.mem, 0, REQ, 24, VIRTQ_DESC_F_NEXT, 1);
    fx.dq.set_desc(&fx.mem, 1, RESP, 10, 0, 0);
    assert_eq!(post(&mut fx).0, 0xffff);
    fx.dq.set_desc(&fx.mem, 1, RESP, 9, VIRTQ_DESC_F_WRITE, 0);
    assert_eq!(post(&mut fx).0, 0xffff);
    // A lone descriptor.
    fx.dq.set_desc(&fx.mem, 0, REQ, 24, 0, 0);
    assert_eq!(post(&mut fx).0, 0xffff);
    // Response outside guest memory.
    fx.dq.set_desc(&fx.mem, 0, REQ, 24, VIRTQ_DESC_F_NEXT, 1);
    fx.dq.set_desc(&fx.mem, 1, u64::MAX - 4, 10, VIRTQ_DESC_F_WRITE, 0);
    fx.dq.push_avail(&fx.mem, 0);
    fx.dev.process_queue(0).unwrap();
    // A loop.
    fx.dq.set_desc(&fx.mem, 1, RESP, 10, VIRTQ_DESC_F_WRITE | VIRTQ_DESC_F_NEXT, 0);
    assert_eq!(post(&mut fx).0, 0xffff);
    assert_eq!(fx.dq.used_idx(&fx.mem), 8, "every chain is returned");
    assert_eq!(fx.dq.used_elem(&fx.mem, 3), (0, 0));
    assert!(fx.dev.error_count() >= 7, "errors: {}", fx.dev.error_count());
    // Queue-level errors.
    fx.dq.push_avail(&fx.mem, 1000);
    assert!(fx.dev.process_queue(0).is_err());
    fx.dq.set_avail_idx(&fx.mem, 5000);
    assert!(fx.dev.process_queue(0).is_err());
    assert!(fx.dev.process_queue(1).is_err());
}

#[test]
fn a_new_requested_size_raises_the_config_interrupt() {
    let mut fx = fixture();
    let generation = fx.dev.config_generation();
    fx.dev.set_requested_size(10 * BLOCK_SIZE).unwrap();
    assert_eq!(config(&fx.dev)[6], 10 * BLOCK_SIZE);
    assert_ne!(fx.dev.config_generation(), generation);
    assert_eq!(fx.irq.status.load(Ordering::SeqCst) & VIRTIO_MMIO_INT_CONFIG, VIRTIO_MMIO_INT_CONFIG);
    assert_eq!(fx.irq.evt.read().unwrap(), 1);
    // Not whole blocks, or more than the region: refused, nothing changes.
    assert!(fx.dev.set_requested_size(BLOCK_SIZE + 1).is_err());
    assert!(fx.dev.set_requested_size(SIZE + BLOCK_SIZE).is_err());
    assert_eq!(fx.dev.requested_size(), 10 * BLOCK_SIZE);
    assert!(fx.irq.evt.read().is_err(), "no second interrupt");
    // A plug changes the generation but raises no config interrupt.
    let generation = fx.dev.config_generation();
    fx.irq.status.store(0, Ordering::SeqCst);
    assert_eq!(request(&mut fx, REQ_PLUG, block(0), 1).0, RESP_ACK);
    assert_ne!(fx.dev.config_generation(), generation);
    assert_eq!(fx.irq.status.load(Ordering::SeqCst) & VIRTIO_MMIO_INT_CONFIG, 0);
}

#[test]
fn persist_round_trip_keeps_plugged_memory() {
    let mut fx = fixture();
    fx.dev.set_requested_size(6 * BLOCK_SIZE).unwrap();
    assert_eq!(request(&mut fx, REQ_PLUG, block(2), 3).0, RESP_ACK);
    assert_eq!(request(&mut fx, REQ_PLUG, block(40), 1).0, RESP_ACK);
    fx.mem.write_obj(0x55u8, GuestAddress(block(40) + 100)).unwrap();
    let state = fx.dev.save();
    check(&state).unwrap();
    let bytes = crate::snapshot::format::encode(&state).unwrap();
    let decoded = crate::snapshot::format::decode(&bytes).unwrap();
    assert_eq!(state, decoded);
    let ctx = MemContext {
        host: Some(fx.mem.clone()),
        device: DeviceContext { mem: fx.mem.clone(), irq: IrqTrigger::new().unwrap(), acked_features: VIRTIO_F_VERSION_1 },
    };
    let back = Mem::restore(ctx, &decoded).unwrap();
    assert_eq!(back.save(), state);
    assert!(back.is_activated());
    assert_eq!(config(&back), [BLOCK_SIZE, 0, REGION, SIZE, SIZE, 4 * BLOCK_SIZE, 6 * BLOCK_SIZE]);
    assert_eq!(fx.mem.read_obj::<u8>(GuestAddress(block(40) + 100)).unwrap(), 0x55);
    // The restored device goes on where the old one stopped (its queue too).
    fx.dev = back;
    assert_eq!(request(&mut fx, REQ_PLUG, block(41), 3).0, RESP_NACK);
    assert_eq!(request(&mut fx, REQ_PLUG, block(41), 2).0, RESP_ACK);
    assert_eq!(request(&mut fx, REQ_STATE, block(2), 3), (RESP_ACK, STATE_PLUGGED));
}

#[test]
fn untrusted_state_is_checked() {
    let mut fx = fixture();
    fx.dev.set_requested_size(2 * BLOCK_SIZE).unwrap();
    assert_eq!(request(&mut fx, REQ_PLUG, block(0), 2).0, RESP_ACK);
    let good = fx.dev.save();
    check(&good).unwrap();
    type Spoil = Box<dyn Fn(&mut super::persist::MemState)>;
    let bad: Vec<(&str, Spoil)> = vec![
        ("plugged size", Box::new(|s| s.plugged_size = BLOCK_SIZE)),
        ("bitmap length", Box::new(|s| s.bitmap.push(0))),
        ("short bitmap", Box::new(|s| s.bitmap.clear())),
        ("region grown under its bitmap", Box::new(|s| s.region_size = 256 << 20)),
        ("misaligned region", Box::new(|s| s.addr += BLOCK_SIZE)),
        ("region in low memory", Box::new(|s| s.addr = 0)),
        ("huge region", Box::new(|s| s.region_size = 1 << 50)),
        ("odd region", Box::new(|s| s.region_size = 3 << 20)),
        ("block size", Box::new(|s| s.block_size = 4096)),
        ("requested not whole blocks", Box::new(|s| s.requested_size = 4096)),
        ("requested past the region", Box::new(|s| s.requested_size = 2 * SIZE)),
        ("wrapping region", Box::new(|s| s.addr = u64::MAX - (SIZE - 1) - (128 << 20) + 1)),
    ];
    for (what, f) in bad {
        let mut s = good.clone();
        f(&mut s);
        assert!(check(&s).is_err(), "{what} accepted");
        let ctx = MemContext {
            host: None,
            device: DeviceContext { mem: fx.mem.clone(), irq: IrqTrigger::new().unwrap(), acked_features: 0 },
        };
        assert!(Mem::restore(ctx, &s).is_err(), "{what} restored");
    }
}

/// A full snapshot writes the plugged blocks (and RAM) and leaves the
/// unplugged ones holes without reading them; an incremental one drops
/// pages of unplugged blocks; a restore maps the file and takes access
/// away from the unplugged blocks again.
#[test]
fn snapshot_memory_skips_unplugged_blocks_and_restores_plugged_ones() {
    use crate::snapshot::microvm::{
        map_memory, readable_runs, write_full, HotplugView, MemoryKind, MemoryState, PageRun, RegionState,
        MEMORY_FILE,
    };
    let mut fx = fixture();
    fx.dev.set_requested_size(4 * BLOCK_SIZE).unwrap();
    assert_eq!(request(&mut fx, REQ_PLUG, block(2), 2).0, RESP_ACK);
    assert_eq!(request(&mut fx, REQ_PLUG, block(40), 1).0, RESP_ACK);
    assert_eq!(request(&mut fx, REQ_PLUG, block(41), 1).0, RESP_ACK);
    assert_eq!(request(&mut fx, REQ_UNPLUG, block(41), 1).0, RESP_ACK);
    fx.mem.write_obj(0x1122_3344u32, GuestAddress(block(3) + 8)).unwrap();
    fx.mem.write_obj(0x99u8, GuestAddress(block(40) + 4096 * 7)).unwrap();
    fx.mem.write_obj(0x42u8, GuestAddress(0x7000)).unwrap();
    let view = HotplugView { addr: REGION, size: SIZE, bitmap: fx.dev.bitmap().to_vec() };
    assert!(view.readable(block(40)) && !view.readable(block(41)) && view.readable(0));

    let dir = tempfile::tempdir().unwrap();
    let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(dir.path().join(MEMORY_FILE)).unwrap();
    let pages = write_full(&f, &fx.mem, Some(&view)).unwrap();
    assert!(pages >= 3, "{pages}");
    let total = RAM as u64 + SIZE;
    assert_eq!(f.metadata().unwrap().len(), total);
    use std::os::unix::fs::MetadataExt;
    assert!(f.metadata().unwrap().blocks() * 512 < 8 << 20, "unplugged and zero memory are holes");

    // Incremental: every page of the region dirty (as after a plug), only
    // the plugged ones kept; RAM pages pass.
    let ram_pages = RAM as u64 / 4096;
    let runs = vec![PageRun { first: 7, count: 1 }, PageRun { first: ram_pages, count: SIZE / 4096 }];
    let kept = readable_runs(&runs, &fx.mem, Some(&view));
    let per_block = BLOCK_SIZE / 4096;
    assert_eq!(
        kept,
        vec![
            PageRun { first: 7, count: 1 },
            PageRun { first: ram_pages + 2 * per_block, count: 2 * per_block },
            PageRun { first: ram_pages + 40 * per_block, count: per_block },
        ]
    );
    assert_eq!(readable_runs(&runs, &fx.mem, None), runs);

    // Restore: map the file, then the device re-applies its bitmap.
    let regions = vec![
        RegionState { guest_addr: 0, size: RAM as u64 },
        RegionState { guest_addr: REGION, size: SIZE },
    ];
    let chain = vec![(dir.path().to_path_buf(), MemoryState { regions, kind: MemoryKind::Full })];
    let mem = map_memory(&chain).unwrap();
    let state = fx.dev.save();
    let ctx = MemContext {
        host: Some(mem.clone()),
        device: DeviceContext { mem: mem.clone(), irq: IrqTrigger::new().unwrap(), acked_features: VIRTIO_F_VERSION_1 },
    };
    let back = Mem::restore(ctx, &state).unwrap();
    assert_eq!(back.plugged_ranges(), vec![(block(2), 2 * BLOCK_SIZE), (block(40), BLOCK_SIZE)]);
    assert_eq!(mem.read_obj::<u32>(GuestAddress(block(3) + 8)).unwrap(), 0x1122_3344);
    assert_eq!(mem.read_obj::<u8>(GuestAddress(block(40) + 4096 * 7)).unwrap(), 0x99);
    assert_eq!(mem.read_obj::<u8>(GuestAddress(0x7000)).unwrap(), 0x42);
    // Block 41 is PROT_NONE again: checked through the kernel, not by
    // touching it (that would be SIGSEGV).
    let probe = mem.get_host_address(GuestAddress(block(41))).unwrap();
    assert!(!readable_by_kernel(probe));
    assert!(readable_by_kernel(mem.get_host_address(GuestAddress(block(40))).unwrap()));
}

/// Whether the kernel can read one byte at `p` (write(2) from it to a
/// pipe fails with EFAULT on PROT_NONE memory instead of faulting us).
fn readable_by_kernel(p: *mut u8) -> bool {
    let mut fds = [0i32; 2];
    // SAFETY: plain syscalls on fds we own; `p` is only read by the kernel.
    unsafe {
        assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
        let n = libc::write(fds[1], p.cast(), 1);
        libc::close(fds[0]);
        libc::close(fds[1]);
        n == 1
    }
}
