//! The NIC against a driver written here, with a datagram socket pair as
//! the tap (one read or write is one frame there too).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use virtio_bindings::virtio_net::{VIRTIO_NET_F_MAC, VIRTIO_NET_F_MRG_RXBUF};
use vm_memory::{Bytes, GuestAddress};

use super::device::{tap_offload, BUDGET, FEATURES, RXQ, TXQ};
use super::persist::NetContext;
use super::tap::VNET_HDR_LEN;
use super::*;
use crate::devices::virtio::persist::DeviceContext;
use crate::devices::virtio::queue::testing::*;
use crate::devices::virtio::{Active, IrqTrigger, VirtioDevice, VIRTIO_F_VERSION_1};
use crate::snapshot::Persist;
use crate::GuestMemoryMmap;

const MAC: [u8; 6] = [0x0a, 0x58, 0x0a, 0x04, 0x00, 0x05];
const RX_BUFS: u64 = 0x10_0000;
const TX_BUFS: u64 = 0x20_0000;
const BUF: u32 = 1526;

/// Non-blocking datagram socket pair: (device side, "host" side).
fn pair() -> (OwnedFd, OwnedFd) {
    let mut fds = [0; 2];
    // SAFETY: socketpair fills two descriptors, owned right away.
    let r = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_DGRAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    };
    assert_eq!(r, 0);
    // SAFETY: both were just created.
    unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) }
}

fn send(host: &OwnedFd, frame: &[u8]) {
    // SAFETY: write of a live buffer to our own socket.
    let n = unsafe { libc::write(host.as_raw_fd(), frame.as_ptr().cast(), frame.len()) };
    assert_eq!(n, frame.len() as isize);
}

fn recv(host: &OwnedFd) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; 70_000];
    // SAFETY: read into a live buffer from our own socket.
    let n = unsafe { libc::read(host.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    (n >= 0).then(|| {
        buf.truncate(n as usize);
        buf
    })
}

/// Whether `fd` is readable right now.
fn readable(fd: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: poll on one live pollfd.
    unsafe { libc::poll(&mut p, 1, 0) == 1 }
}

fn frame(len: usize, seed: u8) -> Vec<u8> {
    let mut f: Vec<u8> = (0..len)
        .map(|i| (i as u8).wrapping_mul(7).wrapping_add(seed))
        .collect();
    f.get_mut(..VNET_HDR_LEN).unwrap().fill(0);
    f
}

struct Guest {
    mem: GuestMemoryMmap,
    rxq: DriverQueue,
    txq: DriverQueue,
    net: Net,
    host: OwnedFd,
    irq: IrqTrigger,
    rx_posted: u16,
    tx_next: u16,
}

fn guest(acked: u64) -> Guest {
    let mem = memory(4 << 20);
    let rxq = DriverQueue::new(0x1000, 256);
    let txq = DriverQueue::new(0x8000, 256);
    let (dev, host) = pair();
    let mut net = Net::new(Tap::for_test(dev, "tap-test"), MAC).unwrap();
    let irq = IrqTrigger::new().unwrap();
    net.activate(Active {
        mem: mem.clone(),
        queues: vec![rxq.queue(&mem), txq.queue(&mem)],
        irq: irq.clone(),
        acked_features: acked,
    })
    .unwrap();
    Guest {
        mem,
        rxq,
        txq,
        net,
        host,
        irq,
        rx_posted: 0,
        tx_next: 0,
    }
}

impl Guest {
    /// Post receive buffer `i` (one descriptor of `len` bytes).
    fn post_rx(&mut self, len: u32) {
        let i = self.rx_posted;
        self.rxq.set_desc(
            &self.mem,
            i,
            RX_BUFS + u64::from(i) * 0x1000,
            len,
            VIRTQ_DESC_F_WRITE,
            0,
        );
        self.rxq.push_avail(&self.mem, i);
        self.rx_posted += 1;
    }

    /// Queue `data` for transmission as a header descriptor and a payload
    /// descriptor.
    fn post_tx(&mut self, data: &[u8]) {
        let i = self.tx_next;
        let addr = TX_BUFS + u64::from(i % 64) * 0x1000;
        self.mem.write_slice(data, GuestAddress(addr)).unwrap();
        let (d0, d1) = ((2 * i) % 256, (2 * i + 1) % 256);
        self.txq.set_desc(
            &self.mem,
            d0,
            addr,
            VNET_HDR_LEN as u32,
            VIRTQ_DESC_F_NEXT,
            d1,
        );
        self.txq.set_desc(
            &self.mem,
            d1,
            addr + VNET_HDR_LEN as u64,
            (data.len() - VNET_HDR_LEN) as u32,
            0,
            0,
        );
        self.txq.push_avail(&self.mem, d0);
        self.tx_next += 1;
    }

    fn rx_buf(&self, i: u16, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        self.mem
            .read_slice(&mut b, GuestAddress(RX_BUFS + u64::from(i) * 0x1000))
            .unwrap();
        b
    }
}

#[test]
fn config_space_holds_the_mac_and_offloads_follow_the_guest() {
    let g = guest(FEATURES);
    let mut mac = [0u8; 6];
    g.net.read_config(0, &mut mac);
    assert_eq!(mac, MAC);
    assert_eq!(g.net.device_type(), 1);
    assert_ne!(g.net.avail_features() & (1 << VIRTIO_NET_F_MRG_RXBUF), 0);
    assert_ne!(g.net.avail_features() & (1 << VIRTIO_NET_F_MAC), 0);
    assert_eq!(
        tap_offload(FEATURES),
        libc::TUN_F_CSUM | libc::TUN_F_TSO4 | libc::TUN_F_TSO6
    );
    // TSO without checksum offload would hand the guest frames it cannot take.
    assert_eq!(tap_offload(VIRTIO_F_VERSION_1 | (1 << 7) | (1 << 8)), 0);
}

#[test]
fn transmitted_frames_reach_the_tap_whole() {
    let mut g = guest(FEATURES);
    let f = frame(1000, 1);
    g.post_tx(&f);
    g.net.process_queue(TXQ).unwrap();
    assert_eq!(recv(&g.host).unwrap(), f);
    assert_eq!(g.txq.used_idx(&g.mem), 1);
    assert_eq!(g.irq.evt.read().unwrap(), 1, "the guest is told");
    assert_eq!(g.net.error_count(), 0);
}

#[test]
fn received_frame_spans_mergeable_buffers() {
    let mut g = guest(FEATURES);
    for _ in 0..4 {
        g.post_rx(BUF);
    }
    let f = frame(4000, 3);
    send(&g.host, &f);
    g.net.process_backend().unwrap();
    assert_eq!(g.rxq.used_idx(&g.mem), 3, "4000 bytes in 1526-byte buffers");
    let lens: Vec<u32> = (0..3).map(|n| g.rxq.used_elem(&g.mem, n).1).collect();
    assert_eq!(lens, [BUF, BUF, 4000 - 2 * BUF]);
    let mut got = Vec::new();
    for (i, &l) in lens.iter().enumerate() {
        got.extend(g.rx_buf(i as u16, l as usize));
    }
    assert_eq!(u16::from_le_bytes([got[10], got[11]]), 3, "num_buffers");
    assert_eq!(got.get(VNET_HDR_LEN..), f.get(VNET_HDR_LEN..));
    assert!(g.irq.evt.read().is_ok());
}

#[test]
fn frames_wait_for_receive_buffers_without_spinning() {
    let mut g = guest(FEATURES);
    let f = frame(200, 5);
    send(&g.host, &f);
    g.net.process_backend().unwrap();
    assert_eq!(g.rxq.used_idx(&g.mem), 0);
    // Nothing more to do until the guest posts buffers: the device's fd
    // must not stay readable (the VMM loop would spin on it).
    assert!(!readable(g.net.backend_fd().unwrap()));
    g.post_rx(BUF);
    g.net.process_queue(RXQ).unwrap();
    assert_eq!(g.rxq.used_idx(&g.mem), 1);
    assert_eq!(g.rxq.used_elem(&g.mem, 0).1, 200);
    assert_eq!(g.rx_buf(0, 200).get(VNET_HDR_LEN..), f.get(VNET_HDR_LEN..));
}

#[test]
fn a_flooded_queue_is_served_in_bounded_rounds() {
    let mut g = guest(FEATURES);
    let total = BUDGET + 36;
    for n in 0..total {
        g.post_tx(&frame(100, n as u8));
    }
    g.net.process_queue(TXQ).unwrap();
    assert_eq!(usize::from(g.txq.used_idx(&g.mem)), BUDGET);
    assert!(
        readable(g.net.backend_fd().unwrap()),
        "the device wakes itself for the rest"
    );
    g.net.process_backend().unwrap();
    assert_eq!(usize::from(g.txq.used_idx(&g.mem)), total);
    let mut frames = 0;
    while recv(&g.host).is_some() {
        frames += 1;
    }
    assert_eq!(frames, total);

    // The same on receive.
    for _ in 0..total {
        g.post_rx(BUF);
    }
    for n in 0..total {
        send(&g.host, &frame(100, n as u8));
    }
    g.net.process_backend().unwrap();
    assert_eq!(usize::from(g.rxq.used_idx(&g.mem)), BUDGET);
    assert!(readable(g.net.backend_fd().unwrap()));
    g.net.process_backend().unwrap();
    assert_eq!(usize::from(g.rxq.used_idx(&g.mem)), total);
}

#[test]
fn malformed_chains_are_counted_and_returned() {
    let mut g = guest(FEATURES);
    // Transmit: a device-writable descriptor, an address outside memory, a
    // frame larger than any Ethernet frame, a header-only frame.
    g.txq
        .set_desc(&g.mem, 0, TX_BUFS, 100, VIRTQ_DESC_F_WRITE, 0);
    g.txq.push_avail(&g.mem, 0);
    g.txq.set_desc(&g.mem, 1, u64::MAX - 50, 100, 0, 0);
    g.txq.push_avail(&g.mem, 1);
    g.txq
        .set_desc(&g.mem, 2, TX_BUFS, 60_000, VIRTQ_DESC_F_NEXT, 3);
    g.txq.set_desc(&g.mem, 3, TX_BUFS, 60_000, 0, 0);
    g.txq.push_avail(&g.mem, 2);
    g.txq
        .set_desc(&g.mem, 4, TX_BUFS, VNET_HDR_LEN as u32, 0, 0);
    g.txq.push_avail(&g.mem, 4);
    g.net.process_queue(TXQ).unwrap();
    assert_eq!(g.txq.used_idx(&g.mem), 4, "every chain goes back");
    assert_eq!(g.net.error_count(), 4);
    assert!(
        recv(&g.host).is_none(),
        "nothing malformed reaches the host"
    );

    // Receive: a device-readable buffer, then a good one; the frame lands
    // in the good one and the bad one is returned empty before it.
    g.rxq.set_desc(&g.mem, 0, RX_BUFS, BUF, 0, 0);
    g.rxq.push_avail(&g.mem, 0);
    g.rx_posted = 1;
    g.post_rx(BUF);
    send(&g.host, &frame(300, 9));
    g.net.process_backend().unwrap();
    assert_eq!(g.rxq.used_idx(&g.mem), 2);
    assert_eq!(g.rxq.used_elem(&g.mem, 0), (0, 0));
    assert_eq!(g.rxq.used_elem(&g.mem, 1), (1, 300));
    assert_eq!(g.net.error_count(), 5);

    // A bogus avail index is a queue-level error, not a panic.
    g.txq.set_avail_idx(&g.mem, 9000);
    assert!(g.net.process_queue(TXQ).is_err());
}

#[test]
fn without_mergeable_buffers_a_frame_too_big_for_the_buffer_is_dropped() {
    let mut g = guest(FEATURES & !(1 << VIRTIO_NET_F_MRG_RXBUF));
    g.post_rx(BUF);
    g.post_rx(BUF);
    send(&g.host, &frame(3000, 1));
    send(&g.host, &frame(500, 2));
    g.net.process_backend().unwrap();
    assert_eq!(g.rxq.used_idx(&g.mem), 2);
    assert_eq!(
        g.rxq.used_elem(&g.mem, 0),
        (0, 0),
        "too big: buffer back empty"
    );
    assert_eq!(g.rxq.used_elem(&g.mem, 1), (1, 500));
    assert_eq!(
        u16::from_le_bytes(g.rx_buf(1, 12)[10..12].try_into().unwrap()),
        1
    );
}

#[test]
fn state_round_trips_onto_a_new_tap() {
    let mut g = guest(FEATURES);
    g.post_rx(BUF);
    g.post_tx(&frame(100, 1));
    let state = g.net.save();
    assert_eq!((state.tap_name.as_str(), state.mac), ("tap-test", MAC));
    let (dev, host) = pair();
    let mut restored = Net::restore(
        NetContext {
            tap: Tap::for_test(dev, "tap-test"),
            device: DeviceContext {
                mem: g.mem.clone(),
                irq: IrqTrigger::new().unwrap(),
                acked_features: FEATURES,
            },
        },
        &state,
    )
    .unwrap();
    assert_eq!(restored.save(), state);
    // The transmit the guest queued before the snapshot goes out once
    // restored, and the receive buffer it posted is used.
    restored.on_restored().unwrap();
    assert_eq!(recv(&host).unwrap(), frame(100, 1));
    send(&host, &frame(64, 4));
    restored.process_backend().unwrap();
    assert_eq!(g.rxq.used_idx(&g.mem), 1);
    assert_eq!(g.rxq.used_elem(&g.mem, 0).1, 64);
}
