//! The host side of vsock: unix-socket connections multiplexed onto the
//! guest's vsock ports, with the virtio credit flow control.

use std::collections::{HashMap, HashSet, VecDeque};
use std::io::{ErrorKind, Read, Write};
use std::num::Wrapping;
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::time::Instant;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::expiry::Expiry;
use super::packet::*;
use super::HOST_CID;

/// Receive buffer we advertise per connection (bytes from the guest not yet
/// written to the host socket).
pub const CONN_BUF_ALLOC: u32 = 256 * 1024;
/// Send a credit update once this much has been forwarded since the last.
const CREDIT_UPDATE_THRESHOLD: u32 = CONN_BUF_ALLOC / 4;
const MAX_CONNS: usize = 1024;
const MAX_CTRL_QUEUE: usize = 4096;
const MAX_CONNECT_LINE: usize = 64;
const LISTENER_TOKEN: u64 = 0;
const EXPIRY_TOKEN: u64 = u64::MAX;
const FIRST_LOCAL_PORT: u32 = 1 << 30;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConnState {
    /// Host connected and sent CONNECT; waiting for the guest's RESPONSE.
    HostConnecting,
    Established,
    /// The host side closed; we told the guest and wait for its RST.
    Closing,
}

pub(crate) struct Conn {
    stream: UnixStream,
    pub local_port: u32,
    pub peer_port: u32,
    pub state: ConnState,
    peer_buf_alloc: u32,
    peer_fwd_cnt: Wrapping<u32>,
    /// Bytes sent to the guest.
    rx_cnt: Wrapping<u32>,
    /// Bytes from the guest written to the host socket.
    fwd_cnt: Wrapping<u32>,
    last_fwd_cnt_sent: Wrapping<u32>,
    /// Bytes from the guest waiting for the host socket to accept them.
    pending_out: VecDeque<u8>,
    /// Bytes from the host waiting to go to the guest.
    pending_in: Vec<u8>,
    /// The host socket may have data (edge-triggered epoll).
    readable: bool,
    guest_shut_send: bool,
    guest_shut_rcv: bool,
    /// While it waits on the guest (its RESPONSE, or its RST after the
    /// host closed): dropped past this.
    deadline: Option<Instant>,
}

impl Conn {
    fn new(stream: UnixStream, local_port: u32, peer_port: u32, state: ConnState) -> Self {
        Self {
            stream,
            local_port,
            peer_port,
            state,
            peer_buf_alloc: 0,
            peer_fwd_cnt: Wrapping(0),
            rx_cnt: Wrapping(0),
            fwd_cnt: Wrapping(0),
            last_fwd_cnt_sent: Wrapping(0),
            pending_out: VecDeque::new(),
            pending_in: Vec::new(),
            readable: false,
            guest_shut_send: false,
            guest_shut_rcv: false,
            deadline: None,
        }
    }

    /// How many bytes the guest can take now.
    fn peer_credit(&self) -> u32 {
        let in_flight = (self.rx_cnt - self.peer_fwd_cnt).0;
        self.peer_buf_alloc.saturating_sub(in_flight)
    }

    fn wants_to_send(&self) -> bool {
        self.state == ConnState::Established
            && !self.guest_shut_rcv
            && (self.readable || !self.pending_in.is_empty())
            && self.peer_credit() > 0
    }
}

struct PendingHost {
    stream: UnixStream,
    line: Vec<u8>,
    /// Its CONNECT line must come before this.
    deadline: Instant,
}

pub(crate) struct Muxer {
    guest_cid: u64,
    uds_path: PathBuf,
    _listener: UnixListener,
    epoll: Epoll,
    conns: HashMap<u64, Conn>,
    ports: HashMap<(u32, u32), u64>,
    local_ports: HashSet<u32>,
    pending: HashMap<u64, PendingHost>,
    ctrl: VecDeque<Header>,
    next_token: u64,
    next_local_port: u32,
    expiry: Expiry,
    pub errors: u64,
}

impl Muxer {
    pub fn new(guest_cid: u64, uds_path: &Path) -> std::io::Result<Self> {
        if uds_path.exists() {
            std::fs::remove_file(uds_path)?;
        }
        let listener =
            UnixListener::bind(burrow_vmm_api::sockpath::SocketPath::new(uds_path)?.path())?;
        listener.set_nonblocking(true)?;
        let epoll = Epoll::new()?;
        epoll.ctl(
            ControlOperation::Add,
            listener.as_raw_fd(),
            EpollEvent::new(EventSet::IN, LISTENER_TOKEN),
        )?;
        let expiry = Expiry::new()?;
        epoll.ctl(
            ControlOperation::Add,
            expiry.fd(),
            EpollEvent::new(EventSet::IN, EXPIRY_TOKEN),
        )?;
        Ok(Self {
            guest_cid,
            uds_path: uds_path.to_path_buf(),
            _listener: listener,
            epoll,
            conns: HashMap::new(),
            ports: HashMap::new(),
            local_ports: HashSet::new(),
            pending: HashMap::new(),
            ctrl: VecDeque::new(),
            next_token: 1,
            next_local_port: FIRST_LOCAL_PORT,
            expiry,
            errors: 0,
        })
    }

    pub fn epoll_fd(&self) -> i32 {
        self.epoll.as_raw_fd()
    }

    pub fn uds_path(&self) -> &Path {
        &self.uds_path
    }

    #[cfg(test)]
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    #[cfg(test)]
    pub fn pending_count(&self) -> usize {
        self.pending.len()
    }

    #[cfg(test)]
    pub fn set_wait_limit(&mut self, limit: std::time::Duration) {
        self.expiry.limit = limit;
    }

    /// Drop what waited past its deadline on the other side: a host
    /// connection without its CONNECT line (closed), a host CONNECT the
    /// guest did not answer, a host-closed connection the guest did not
    /// reset (both reset, so the guest forgets them too).
    fn expire(&mut self) {
        self.expiry.fired();
        let now = Instant::now();
        let late: Vec<u64> = self.pending.iter().filter(|(_, p)| p.deadline <= now).map(|(t, _)| *t).collect();
        for token in late {
            tracing::debug!("vsock: a host connection sent no CONNECT line in time; closing it");
            self.drop_pending(token);
        }
        let late: Vec<u64> =
            self.conns.iter().filter(|(_, c)| c.deadline.is_some_and(|d| d <= now)).map(|(t, _)| *t).collect();
        for token in late {
            if let Some(c) = self.conns.get(&token) {
                tracing::debug!("vsock: port {} waited on the guest too long ({:?}); reset", c.peer_port, c.state);
            }
            self.reset(token);
        }
        let next = self.pending.values().map(|p| p.deadline).chain(self.conns.values().filter_map(|c| c.deadline)).min();
        self.expiry.rearm(next);
    }

    fn header(&self, local_port: u32, peer_port: u32, op: u16) -> Header {
        Header {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: local_port,
            dst_port: peer_port,
            len: 0,
            type_: VSOCK_TYPE_STREAM,
            op,
            flags: 0,
            buf_alloc: CONN_BUF_ALLOC,
            fwd_cnt: 0,
        }
    }

    fn push_ctrl(&mut self, h: Header) {
        if self.ctrl.len() >= MAX_CTRL_QUEUE {
            self.errors += 1;
            crate::guest_warn!("vsock: control queue full (guest posts no RX buffers); dropping packet");
            return;
        }
        self.ctrl.push_back(h);
    }

    fn conn_ctrl(&mut self, token: u64, op: u16, flags: u32) {
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        c.last_fwd_cnt_sent = c.fwd_cnt;
        let mut h = Header {
            src_cid: HOST_CID,
            dst_cid: self.guest_cid,
            src_port: c.local_port,
            dst_port: c.peer_port,
            type_: VSOCK_TYPE_STREAM,
            op,
            flags,
            buf_alloc: CONN_BUF_ALLOC,
            fwd_cnt: c.fwd_cnt.0,
            len: 0,
        };
        h.len = 0;
        self.push_ctrl(h);
    }

    /// Refuse the guest's packet `to` with a reset from the address it
    /// was sent to and of its type, as Linux's
    /// `virtio_transport_reset_no_sock` does. A guest kernel takes a reset
    /// only from its socket's peer (`vsock_check_source`): one from the
    /// host's CID for a packet to CID 1 or 0 would be dropped, and the
    /// connect in the guest would hang until its timeout instead of
    /// failing at once.
    fn rst_reply(&mut self, to: &Header) {
        if to.op == OP_RST {
            return;
        }
        let mut h = self.header(to.dst_port, to.src_port, OP_RST);
        h.src_cid = to.dst_cid;
        h.type_ = to.type_;
        self.push_ctrl(h);
    }

    fn register(&self, fd: i32, token: u64) -> std::io::Result<()> {
        self.epoll.ctl(
            ControlOperation::Add,
            fd,
            EpollEvent::new(
                EventSet::IN | EventSet::OUT | EventSet::READ_HANG_UP | EventSet::EDGE_TRIGGERED,
                token,
            ),
        )
    }

    fn remove(&mut self, token: u64) {
        if let Some(c) = self.conns.remove(&token) {
            self.ports.remove(&(c.local_port, c.peer_port));
            self.local_ports.remove(&c.local_port);
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                c.stream.as_raw_fd(),
                EpollEvent::default(),
            );
        }
    }

    fn reset(&mut self, token: u64) {
        self.conn_ctrl(token, OP_RST, 0);
        self.remove(token);
    }

    fn insert_conn(&mut self, token: u64, conn: Conn) {
        self.ports.insert((conn.local_port, conn.peer_port), token);
        self.local_ports.insert(conn.local_port);
        self.conns.insert(token, conn);
    }

    fn alloc_local_port(&mut self) -> Option<u32> {
        for _ in 0..=MAX_CONNS {
            let p = self.next_local_port;
            self.next_local_port = self.next_local_port.wrapping_add(1).max(FIRST_LOCAL_PORT);
            if !self.local_ports.contains(&p) {
                return Some(p);
            }
        }
        None
    }

    /// Handle one packet the guest sent.
    pub fn handle_tx(&mut self, hdr: &Header, data: &[u8]) {
        if hdr.dst_cid != HOST_CID || hdr.src_cid != self.guest_cid || hdr.type_ != VSOCK_TYPE_STREAM
        {
            self.errors += 1;
            tracing::debug!("vsock: dropping packet {hdr:?}");
            self.rst_reply(hdr);
            return;
        }
        let key = (hdr.dst_port, hdr.src_port);
        let Some(&token) = self.ports.get(&key) else {
            if hdr.op == OP_REQUEST {
                self.connect_to_host(hdr);
            } else {
                self.rst_reply(hdr);
            }
            return;
        };
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        c.peer_buf_alloc = hdr.buf_alloc;
        c.peer_fwd_cnt = Wrapping(hdr.fwd_cnt);
        match hdr.op {
            OP_RESPONSE if c.state == ConnState::HostConnecting => {
                let line = format!("OK {}\n", c.local_port);
                match c.stream.write(line.as_bytes()) {
                    Ok(n) if n == line.len() => {
                        c.state = ConnState::Established;
                        c.readable = true;
                        c.deadline = None;
                    }
                    _ => self.reset(token),
                }
            }
            OP_RW if c.state == ConnState::Established => {
                if c.pending_out.len() + data.len() > CONN_BUF_ALLOC as usize {
                    self.errors += 1;
                    crate::guest_warn!("vsock: guest overran its credit on port {}", c.peer_port);
                    self.reset(token);
                    return;
                }
                c.pending_out.extend(data);
                self.flush(token);
            }
            OP_RW => {}
            OP_CREDIT_UPDATE => {}
            OP_CREDIT_REQUEST => self.conn_ctrl(token, OP_CREDIT_UPDATE, 0),
            OP_SHUTDOWN => {
                c.guest_shut_send |= hdr.flags & SHUTDOWN_SEND != 0;
                c.guest_shut_rcv |= hdr.flags & SHUTDOWN_RCV != 0;
                if c.guest_shut_send && c.guest_shut_rcv {
                    self.flush(token);
                    self.reset(token);
                } else {
                    self.flush(token);
                }
            }
            OP_RST => self.remove(token),
            _ => {
                self.errors += 1;
                self.reset(token);
            }
        }
    }

    fn connect_to_host(&mut self, hdr: &Header) {
        if self.conns.len() + self.pending.len() >= MAX_CONNS {
            self.rst_reply(hdr);
            return;
        }
        let path = format!("{}_{}", self.uds_path.display(), hdr.dst_port);
        let stream = match burrow_vmm_api::sockpath::SocketPath::new(Path::new(&path))
            .and_then(|p| UnixStream::connect(p.path()))
        {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!("vsock: guest connect to {path}: {e}");
                self.rst_reply(hdr);
                return;
            }
        };
        let token = self.next_token;
        self.next_token += 1;
        if stream.set_nonblocking(true).is_err() || self.register(stream.as_raw_fd(), token).is_err() {
            self.rst_reply(hdr);
            return;
        }
        let mut c = Conn::new(stream, hdr.dst_port, hdr.src_port, ConnState::Established);
        c.peer_buf_alloc = hdr.buf_alloc;
        c.peer_fwd_cnt = Wrapping(hdr.fwd_cnt);
        c.readable = true;
        self.local_ports.insert(hdr.dst_port);
        self.insert_conn(token, c);
        self.conn_ctrl(token, OP_RESPONSE, 0);
    }

    /// Write what the guest sent to the host socket.
    fn flush(&mut self, token: u64) {
        let Some(c) = self.conns.get_mut(&token) else {
            return;
        };
        let mut failed = false;
        while !c.pending_out.is_empty() {
            let (a, _) = c.pending_out.as_slices();
            match c.stream.write(a) {
                Ok(0) => {
                    failed = true;
                    break;
                }
                Ok(n) => {
                    c.pending_out.drain(..n);
                    c.fwd_cnt += Wrapping(n as u32);
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => {
                    failed = true;
                    break;
                }
            }
        }
        if failed {
            self.reset(token);
            return;
        }
        if c.pending_out.is_empty() && c.guest_shut_send {
            let _ = c.stream.shutdown(std::net::Shutdown::Write);
        }
        if (c.fwd_cnt - c.last_fwd_cnt_sent).0 >= CREDIT_UPDATE_THRESHOLD {
            self.conn_ctrl(token, OP_CREDIT_UPDATE, 0);
        }
    }

    /// Drain the backend epoll and handle host-side socket events.
    pub fn handle_events(&mut self) -> std::io::Result<()> {
        let mut events = [EpollEvent::default(); 64];
        loop {
            let n = match self.epoll.wait(0, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            for ev in events.iter().take(n) {
                let token = ev.data();
                let set = ev.event_set();
                if token == LISTENER_TOKEN {
                    self.accept();
                } else if token == EXPIRY_TOKEN {
                    self.expire();
                } else if self.pending.contains_key(&token) {
                    self.read_connect_line(token);
                } else if let Some(c) = self.conns.get_mut(&token) {
                    if set.intersects(
                        EventSet::IN | EventSet::HANG_UP | EventSet::READ_HANG_UP | EventSet::ERROR,
                    ) {
                        c.readable = true;
                    }
                    if set.contains(EventSet::OUT) {
                        self.flush(token);
                    }
                }
            }
            if n < events.len() {
                return Ok(());
            }
        }
    }

    fn accept(&mut self) {
        loop {
            match self._listener.accept() {
                Ok((stream, _)) => {
                    if self.conns.len() + self.pending.len() >= MAX_CONNS {
                        crate::guest_warn!("vsock: too many connections; refusing");
                        continue;
                    }
                    let token = self.next_token;
                    self.next_token += 1;
                    if stream.set_nonblocking(true).is_err()
                        || self.register(stream.as_raw_fd(), token).is_err()
                    {
                        continue;
                    }
                    let deadline = self.expiry.deadline();
                    self.pending.insert(token, PendingHost { stream, line: Vec::new(), deadline });
                    // The CONNECT line may already be there.
                    self.read_connect_line(token);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return,
            }
        }
    }

    fn drop_pending(&mut self, token: u64) {
        if let Some(p) = self.pending.remove(&token) {
            let _ = self.epoll.ctl(
                ControlOperation::Delete,
                p.stream.as_raw_fd(),
                EpollEvent::default(),
            );
        }
    }

    fn read_connect_line(&mut self, token: u64) {
        let Some(p) = self.pending.get_mut(&token) else {
            return;
        };
        let mut buf = [0u8; MAX_CONNECT_LINE];
        let mut closed = false;
        loop {
            let room = MAX_CONNECT_LINE.saturating_sub(p.line.len());
            let Some(dst) = buf.get_mut(..room) else {
                break;
            };
            if dst.is_empty() {
                break;
            }
            match p.stream.read(dst) {
                Ok(0) => {
                    closed = true;
                    break;
                }
                Ok(n) => p.line.extend_from_slice(dst.get(..n).unwrap_or_default()),
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(_) => {
                    closed = true;
                    break;
                }
            }
            if p.line.contains(&b'\n') {
                break;
            }
        }
        let line_complete = p.line.contains(&b'\n');
        if closed && !line_complete {
            self.drop_pending(token);
            return;
        }
        let Some(p) = self.pending.get(&token) else {
            return;
        };
        let Some(nl) = p.line.iter().position(|&b| b == b'\n') else {
            if p.line.len() >= MAX_CONNECT_LINE {
                tracing::debug!("vsock: no CONNECT line from host; closing");
                self.drop_pending(token);
            }
            return;
        };
        let port = p.line.get(..nl).and_then(parse_connect);
        let Some(port) = port else {
            tracing::debug!("vsock: bad CONNECT line from host; closing");
            self.drop_pending(token);
            return;
        };
        let Some(local) = self.alloc_local_port() else {
            self.drop_pending(token);
            return;
        };
        let Some(p) = self.pending.remove(&token) else {
            return;
        };
        let mut c = Conn::new(p.stream, local, port, ConnState::HostConnecting);
        c.pending_in = p.line.get(nl + 1..).map(<[u8]>::to_vec).unwrap_or_default();
        c.deadline = Some(self.expiry.deadline());
        self.insert_conn(token, c);
        self.conn_ctrl(token, OP_REQUEST, 0);
    }

    /// Is there anything to send to the guest?
    pub fn has_rx(&self) -> bool {
        !self.ctrl.is_empty() || self.conns.values().any(Conn::wants_to_send)
    }

    /// The next packet for the guest; data (if any) is written to `buf`
    /// and its length returned. `None` if nothing can be sent now.
    pub fn next_rx(&mut self, buf: &mut [u8]) -> Option<(Header, usize)> {
        if let Some(h) = self.ctrl.pop_front() {
            return Some((h, 0));
        }
        if buf.is_empty() {
            return None;
        }
        let tokens: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| c.wants_to_send())
            .map(|(t, _)| *t)
            .collect();
        for token in tokens {
            let Some(c) = self.conns.get_mut(&token) else {
                continue;
            };
            let want = (c.peer_credit() as usize).min(buf.len());
            let Some(dst) = buf.get_mut(..want) else {
                continue;
            };
            let n = if !c.pending_in.is_empty() {
                let n = want.min(c.pending_in.len());
                dst.get_mut(..n)?.copy_from_slice(c.pending_in.get(..n)?);
                c.pending_in.drain(..n);
                n
            } else {
                match c.stream.read(dst) {
                    Ok(0) => {
                        // Host closed: tell the guest, wait for its RST.
                        c.readable = false;
                        c.state = ConnState::Closing;
                        c.deadline = Some(self.expiry.deadline());
                        self.conn_ctrl(token, OP_SHUTDOWN, SHUTDOWN_RCV | SHUTDOWN_SEND);
                        return self.ctrl.pop_front().map(|h| (h, 0));
                    }
                    Ok(n) => n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        c.readable = false;
                        continue;
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(_) => {
                        self.reset(token);
                        return self.ctrl.pop_front().map(|h| (h, 0));
                    }
                }
            };
            c.rx_cnt += Wrapping(n as u32);
            c.last_fwd_cnt_sent = c.fwd_cnt;
            let h = Header {
                src_cid: HOST_CID,
                dst_cid: self.guest_cid,
                src_port: c.local_port,
                dst_port: c.peer_port,
                len: n as u32,
                type_: VSOCK_TYPE_STREAM,
                op: OP_RW,
                flags: 0,
                buf_alloc: CONN_BUF_ALLOC,
                fwd_cnt: c.fwd_cnt.0,
            };
            return Some((h, n));
        }
        None
    }
}
