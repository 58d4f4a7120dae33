use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::Duration;

use crate::GuestMemoryMmap;
use vm_memory::{Bytes, GuestAddress};

use super::device::{MAX_PKT_DATA, RXQ, TXQ};
use super::packet::*;
use super::*;
use crate::devices::virtio::queue::testing::*;
use crate::devices::virtio::{Active, IrqTrigger, VirtioDevice};

const CID: u64 = 3;
const RX_BUFS: u64 = 0x10_0000;
const TX_BUFS: u64 = 0x20_0000;

struct Guest {
    mem: GuestMemoryMmap,
    rxq: DriverQueue,
    txq: DriverQueue,
    vsock: Vsock,
    rx_seen: u16,
    tx_next: u16,
    dir: PathBuf,
}

impl Drop for Guest {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn guest(name: &str) -> Guest {
    let dir = std::env::temp_dir().join(format!("burrow-vsock-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mem = memory(4 << 20);
    let rxq = DriverQueue::new(0x1000, 16);
    let txq = DriverQueue::new(0x4000, 16);
    let evq = DriverQueue::new(0x8000, 16);
    let mut vsock = Vsock::new(CID, &dir.join("v.sock")).unwrap();
    vsock
        .activate(Active {
            mem: mem.clone(),
            queues: vec![rxq.queue(&mem), txq.queue(&mem), evq.queue(&mem)],
            irq: IrqTrigger::new().unwrap(),
            acked_features: 0,
        })
        .unwrap();
    let mut g = Guest { mem, rxq, txq, vsock, rx_seen: 0, tx_next: 0, dir };
    for i in 0..8 {
        g.post_rx(i);
    }
    g
}

impl Guest {
    fn post_rx(&mut self, i: u16) {
        let addr = RX_BUFS + u64::from(i) * 0x2000;
        // header and data in separate descriptors, as Linux 6.1 posts them
        self.rxq.set_desc(&self.mem, 2 * i, addr, HEADER_SIZE as u32, VIRTQ_DESC_F_WRITE | VIRTQ_DESC_F_NEXT, 2 * i + 1);
        self.rxq.set_desc(&self.mem, 2 * i + 1, addr + 64, 4096, VIRTQ_DESC_F_WRITE, 0);
        self.rxq.push_avail(&self.mem, 2 * i);
    }

    /// Packets the device put in the RX queue since the last call.
    fn take_rx(&mut self) -> Vec<(Header, Vec<u8>)> {
        let mut out = vec![];
        while self.rx_seen != self.rxq.used_idx(&self.mem) {
            let (id, len) = self.rxq.used_elem(&self.mem, self.rx_seen);
            self.rx_seen = self.rx_seen.wrapping_add(1);
            let addr = RX_BUFS + u64::from(id as u16 / 2) * 0x2000;
            let mut raw = [0u8; HEADER_SIZE];
            self.mem.read_slice(&mut raw, GuestAddress(addr)).unwrap();
            let h = Header::from_bytes(&raw);
            let mut data = vec![0u8; h.len as usize];
            self.mem.read_slice(&mut data, GuestAddress(addr + 64)).unwrap();
            assert_eq!(len as usize, HEADER_SIZE + data.len());
            out.push((h, data));
            self.post_rx(id as u16 / 2);
        }
        out
    }

    fn send(&mut self, h: Header, data: &[u8]) {
        let slot = self.tx_next % 8;
        self.tx_next += 1;
        let addr = TX_BUFS + u64::from(slot) * 0x2000;
        let mut h = h;
        h.len = data.len() as u32;
        self.mem.write_slice(&h.to_bytes(), GuestAddress(addr)).unwrap();
        self.mem.write_slice(data, GuestAddress(addr + 64)).unwrap();
        if data.is_empty() {
            self.txq.set_desc(&self.mem, 2 * slot, addr, HEADER_SIZE as u32, 0, 0);
        } else {
            self.txq.set_desc(&self.mem, 2 * slot, addr, HEADER_SIZE as u32, VIRTQ_DESC_F_NEXT, 2 * slot + 1);
            self.txq.set_desc(&self.mem, 2 * slot + 1, addr + 64, data.len() as u32, 0, 0);
        }
        self.txq.push_avail(&self.mem, 2 * slot);
        self.vsock.process_queue(TXQ).unwrap();
    }

    fn pump(&mut self) -> Vec<(Header, Vec<u8>)> {
        for _ in 0..50 {
            self.vsock.process_backend().unwrap();
            let got = self.take_rx();
            if !got.is_empty() {
                return got;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        vec![]
    }

    fn hdr(&self, src_port: u32, dst_port: u32, op: u16) -> Header {
        Header { src_cid: CID, dst_cid: HOST_CID, src_port, dst_port, len: 0, type_: VSOCK_TYPE_STREAM, op, flags: 0, buf_alloc: 65536, fwd_cnt: 0 }
    }
}

fn read_exact_timeout(s: &mut UnixStream, n: usize) -> Vec<u8> {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = vec![0u8; n];
    s.read_exact(&mut buf).unwrap();
    buf
}

#[test]
fn host_initiated_round_trip() {
    let mut g = guest("host");
    let mut host = UnixStream::connect(g.dir.join("v.sock")).unwrap();
    host.write_all(b"CONNECT 1024\n").unwrap();
    let pkts = g.pump();
    assert_eq!(pkts.len(), 1);
    let (req, _) = &pkts[0];
    assert_eq!((req.op, req.dst_port, req.dst_cid, req.src_cid), (OP_REQUEST, 1024, CID, HOST_CID));
    let local = req.src_port;
    g.send(g.hdr(1024, local, OP_RESPONSE), &[]);
    let ok = read_exact_timeout(&mut host, format!("OK {local}\n").len());
    assert_eq!(ok, format!("OK {local}\n").as_bytes());
    host.write_all(b"ping").unwrap();
    let pkts = g.pump();
    assert_eq!(pkts.len(), 1);
    assert_eq!(pkts[0].0.op, OP_RW);
    assert_eq!(pkts[0].1, b"ping");
    g.send(g.hdr(1024, local, OP_RW), b"pong");
    assert_eq!(read_exact_timeout(&mut host, 4), b"pong");
    // host closes: guest is told, then RSTs
    drop(host);
    let pkts = g.pump();
    assert_eq!(pkts[0].0.op, OP_SHUTDOWN);
    g.send(g.hdr(1024, local, OP_RST), &[]);
    assert_eq!(g.vsock.muxer.connection_count(), 0);
    assert_eq!(g.vsock.error_count(), 0);
}

#[test]
fn guest_initiated_round_trip() {
    let mut g = guest("guest");
    let listener = UnixListener::bind(g.dir.join("v.sock_5000")).unwrap();
    g.send(g.hdr(40000, 5000, OP_REQUEST), &[]);
    let pkts = g.take_rx();
    assert_eq!(pkts.len(), 1);
    assert_eq!((pkts[0].0.op, pkts[0].0.dst_port, pkts[0].0.src_port), (OP_RESPONSE, 40000, 5000));
    let (mut s, _) = listener.accept().unwrap();
    g.send(g.hdr(40000, 5000, OP_RW), b"hello");
    assert_eq!(read_exact_timeout(&mut s, 5), b"hello");
    s.write_all(b"world").unwrap();
    let pkts = g.pump();
    assert_eq!(pkts[0].1, b"world");
    // guest shuts down both ways: host sees EOF and the guest gets RST
    let mut h = g.hdr(40000, 5000, OP_SHUTDOWN);
    h.flags = SHUTDOWN_RCV | SHUTDOWN_SEND;
    g.send(h, &[]);
    let pkts = g.take_rx();
    assert_eq!(pkts[0].0.op, OP_RST);
    let mut rest = vec![];
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert_eq!(s.read_to_end(&mut rest).unwrap(), 0);
}

#[test]
fn connect_to_missing_listener_is_reset() {
    let mut g = guest("missing");
    g.send(g.hdr(40001, 6000, OP_REQUEST), &[]);
    let pkts = g.take_rx();
    assert_eq!(pkts[0].0.op, OP_RST);
    // data for an unknown connection is answered with RST, not forwarded
    g.send(g.hdr(40001, 6000, OP_RW), b"zzz");
    assert_eq!(g.take_rx()[0].0.op, OP_RST);
}

/// A packet the guest sends to any CID but the host's is refused with a
/// reset from the address it went to, of its own type: a guest kernel
/// takes a reset only from its socket's peer (Linux's
/// `vsock_check_source`), so one from the host's CID would be dropped and
/// the connect in the guest would hang until its timeout instead of
/// failing at once (seen from a container connecting to CID 1).
#[test]
fn a_packet_to_another_cid_is_reset_from_that_cid() {
    let mut g = guest("othercid");
    for cid in [0u64, 1, CID, 42, u64::from(u32::MAX)] {
        let mut h = g.hdr(40002, 1024, OP_REQUEST);
        h.dst_cid = cid;
        g.send(h, &[]);
        let pkts = g.take_rx();
        assert_eq!(pkts.len(), 1, "CID {cid}: {pkts:?}");
        let rst = pkts[0].0;
        assert_eq!(
            (rst.op, rst.type_),
            (OP_RST, VSOCK_TYPE_STREAM),
            "CID {cid}"
        );
        assert_eq!((rst.src_cid, rst.src_port), (cid, 1024), "CID {cid}");
        assert_eq!((rst.dst_cid, rst.dst_port), (CID, 40002), "CID {cid}");
    }
    // Another type (seqpacket, which the device does not offer) is reset
    // in its type, as the guest's socket would expect.
    let mut h = g.hdr(40003, 1024, OP_REQUEST);
    h.type_ = 2;
    g.send(h, &[]);
    let rst = g.take_rx()[0].0;
    assert_eq!((rst.op, rst.type_, rst.src_cid), (OP_RST, 2, HOST_CID));
    // A reset is never answered.
    let mut h = g.hdr(40004, 1024, OP_RST);
    h.dst_cid = 1;
    g.send(h, &[]);
    assert!(g.take_rx().is_empty());
}

#[test]
fn bad_connect_line_closes_host_stream() {
    let mut g = guest("badline");
    let mut host = UnixStream::connect(g.dir.join("v.sock")).unwrap();
    host.write_all(b"HELLO\n").unwrap();
    assert!(g.pump().is_empty());
    host.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 8];
    assert_eq!(host.read(&mut buf).unwrap(), 0);
}

#[test]
fn host_data_respects_guest_credit() {
    let mut g = guest("credit");
    let mut host = UnixStream::connect(g.dir.join("v.sock")).unwrap();
    host.write_all(b"CONNECT 7\n").unwrap();
    let local = g.pump()[0].0.src_port;
    let mut resp = g.hdr(7, local, OP_RESPONSE);
    resp.buf_alloc = 3;
    g.send(resp, &[]);
    read_exact_timeout(&mut host, format!("OK {local}\n").len());
    host.write_all(b"abcdef").unwrap();
    let pkts = g.pump();
    let total: usize = pkts.iter().map(|p| p.1.len()).sum();
    assert_eq!(total, 3, "only as much as the guest's buf_alloc");
    let mut upd = g.hdr(7, local, OP_CREDIT_UPDATE);
    upd.buf_alloc = 3;
    upd.fwd_cnt = 3;
    g.send(upd, &[]);
    let pkts = g.pump();
    assert_eq!(pkts.iter().flat_map(|p| p.1.clone()).collect::<Vec<_>>(), b"def");
}

#[test]
fn malformed_tx_chains_are_device_errors() {
    let mut g = guest("malformed");
    let before = g.vsock.error_count();
    // header descriptor too short
    g.txq.set_desc(&g.mem, 0, TX_BUFS, 10, 0, 0);
    g.txq.push_avail(&g.mem, 0);
    // header outside guest memory
    g.txq.set_desc(&g.mem, 1, u64::MAX - 8, 44, 0, 0);
    g.txq.push_avail(&g.mem, 1);
    // write-only header
    g.txq.set_desc(&g.mem, 2, TX_BUFS, 44, VIRTQ_DESC_F_WRITE, 0);
    g.txq.push_avail(&g.mem, 2);
    // header claims more data than allowed
    let mut h = g.hdr(1, 2, OP_RW);
    h.len = MAX_PKT_DATA + 1;
    g.mem.write_slice(&h.to_bytes(), GuestAddress(TX_BUFS + 0x100)).unwrap();
    g.txq.set_desc(&g.mem, 3, TX_BUFS + 0x100, 44, VIRTQ_DESC_F_NEXT, 4);
    g.txq.set_desc(&g.mem, 4, TX_BUFS + 0x1000, 16, 0, 0);
    g.txq.push_avail(&g.mem, 3);
    // a loop
    g.txq.set_desc(&g.mem, 5, TX_BUFS, 44, VIRTQ_DESC_F_NEXT, 6);
    g.txq.set_desc(&g.mem, 6, TX_BUFS, 44, VIRTQ_DESC_F_NEXT, 5);
    g.txq.push_avail(&g.mem, 5);
    g.vsock.process_queue(TXQ).unwrap();
    assert!(g.vsock.error_count() >= before + 4, "errors {}", g.vsock.error_count());
    assert_eq!(g.txq.used_idx(&g.mem), 5, "every chain is returned");
    // wrong CIDs / type
    let mut h = g.hdr(1, 2, OP_REQUEST);
    h.src_cid = 99;
    g.send(h, &[]);
    let mut h = g.hdr(1, 2, OP_REQUEST);
    h.type_ = 2;
    g.send(h, &[]);
    // malformed RX buffer (read-only)
    g.rxq.set_desc(&g.mem, 0, RX_BUFS, 44, 0, 0);
    g.rxq.push_avail(&g.mem, 0);
    g.vsock.process_queue(RXQ).unwrap();
    // bogus avail index is a queue-level error
    g.txq.set_avail_idx(&g.mem, 999);
    assert!(g.vsock.process_queue(TXQ).is_err());
    assert!(g.vsock.process_queue(9).is_err());
}

#[test]
fn reserved_cids_are_refused() {
    let dir = std::env::temp_dir();
    assert!(Vsock::new(2, &dir.join("x")).is_err());
    assert!(Vsock::new(1 << 40, &dir.join("x")).is_err());
}

/// Host CONNECT, the guest answers; returns the host stream and its local port.
fn established(g: &mut Guest, port: u32) -> (UnixStream, u32) {
    let mut host = UnixStream::connect(g.dir.join("v.sock")).unwrap();
    host.write_all(format!("CONNECT {port}\n").as_bytes()).unwrap();
    let local = g.pump()[0].0.src_port;
    g.send(g.hdr(port, local, OP_RESPONSE), &[]);
    read_exact_timeout(&mut host, format!("OK {local}\n").len());
    (host, local)
}

fn assert_eof(s: &mut UnixStream, what: &str) {
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 8];
    assert_eq!(s.read(&mut buf).unwrap_or(0), 0, "{what}: the host side is not closed");
}

#[test]
fn connections_waiting_on_their_peer_expire_and_live_ones_stay() {
    let mut g = guest("expire");
    let limit = Duration::from_millis(200);
    g.vsock.muxer.set_wait_limit(limit);
    // A host client that never sends its CONNECT line.
    let mut silent = UnixStream::connect(g.dir.join("v.sock")).unwrap();
    // A host CONNECT the guest never answers.
    let mut unanswered = UnixStream::connect(g.dir.join("v.sock")).unwrap();
    unanswered.write_all(b"CONNECT 1024\n").unwrap();
    let req = g.pump();
    assert_eq!(req[0].0.op, OP_REQUEST);
    let unanswered_port = req[0].0.src_port;
    // A connection the host closed; the guest never sends its RST.
    let (closing, closing_port) = established(&mut g, 1025);
    drop(closing);
    assert_eq!(g.pump()[0].0.op, OP_SHUTDOWN);
    // A live one, and a half-closed one the guest still reads from.
    let (mut live, live_port) = established(&mut g, 1026);
    std::thread::sleep(limit * 2);
    let mut rst = Vec::new();
    for _ in 0..10 {
        rst.extend(g.pump().into_iter().filter(|p| p.0.op == OP_RST).map(|p| p.0.src_port));
        if rst.len() >= 2 {
            break;
        }
    }
    rst.sort_unstable();
    let mut want = vec![unanswered_port, closing_port];
    want.sort_unstable();
    assert_eq!(rst, want, "the guest is told both are gone");
    assert_eq!(g.vsock.muxer.pending_count(), 0);
    assert_eq!(g.vsock.muxer.connection_count(), 1, "only the live connection is left");
    assert_eof(&mut silent, "no CONNECT line");
    assert_eof(&mut unanswered, "unanswered CONNECT");
    // The live connection still carries data, both ways.
    live.write_all(b"still").unwrap();
    let pkts = g.pump();
    assert_eq!((pkts[0].0.op, pkts[0].1.as_slice()), (OP_RW, &b"still"[..]));
    g.send(g.hdr(1026, live_port, OP_RW), b"here");
    assert_eq!(read_exact_timeout(&mut live, 4), b"here");
}

/// Random guest packets (ops, ports near the live connections, credit
/// fields, data) interleaved with host writes, reads and closes, over live
/// host connections: no panic, the table stays bounded, and a connection
/// made afterwards still works.
#[test]
fn random_packets_over_live_connections_never_panic() {
    let mut g = guest("random");
    let mut rng = fastrand::Rng::with_seed(0x5eed_0019);
    let listener = UnixListener::bind(g.dir.join("v.sock_5000")).unwrap();
    listener.set_nonblocking(true).unwrap();
    let mut hosts: Vec<(UnixStream, u32, u32)> = Vec::new();
    for round in 0..2000 {
        if hosts.len() < 4 && rng.u8(0..8) == 0 {
            let port = 1024 + rng.u32(0..4);
            let (h, local) = established(&mut g, port);
            h.set_nonblocking(true).unwrap();
            hosts.push((h, port, local));
        }
        let (src, dst) = match hosts.get(rng.usize(0..hosts.len().max(1))) {
            Some((_, port, local)) if rng.bool() => (*port, *local),
            _ => (rng.u32(0..8) + 40000, if rng.bool() { 5000 } else { rng.u32(..) }),
        };
        let mut h = g.hdr(src, dst, rng.u16(0..9));
        h.flags = rng.u32(0..4);
        h.buf_alloc = [0, 1, 4096, 65536, u32::MAX][rng.usize(0..5)];
        h.fwd_cnt = rng.u32(..);
        if rng.u8(0..10) == 0 {
            h.src_cid = rng.u64(..);
        }
        let data: Vec<u8> = (0..[0usize, 1, 100, 4000][rng.usize(0..4)]).map(|_| rng.u8(..)).collect();
        g.send(h, &data);
        if !hosts.is_empty() {
            let i = rng.usize(0..hosts.len());
            match rng.u8(0..4) {
                0 => {
                    let _ = hosts[i].0.write(&[b'x'; 100]);
                }
                1 => {
                    let mut buf = [0u8; 4096];
                    let _ = hosts[i].0.read(&mut buf);
                }
                2 if rng.u8(0..8) == 0 => {
                    hosts.swap_remove(i);
                }
                _ => {}
            }
        }
        while let Ok((s, _)) = listener.accept() {
            drop(s);
        }
        g.vsock.process_backend().unwrap();
        g.take_rx();
        assert!(g.vsock.muxer.connection_count() <= 1024, "round {round}");
    }
    drop(hosts);
    let (mut h, local) = established(&mut g, 7777);
    h.write_all(b"after").unwrap();
    let got = g.pump();
    assert!(got.iter().any(|p| p.0.op == OP_RW && p.1 == b"after" && p.0.src_port == local), "{:?}", got.len());
}
