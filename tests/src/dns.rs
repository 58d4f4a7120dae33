//! A tiny DNS server for the tests: answers A queries for one name with one
//! address over UDP, NXDOMAIN for every other name, no answer (NODATA) for
//! other types of that name. It counts the queries it answered.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The server; it stops when dropped.
pub struct TinyDns {
    stop: Arc<AtomicBool>,
    answered: Arc<AtomicUsize>,
    addr: SocketAddr,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl TinyDns {
    /// Serve `name` → `ip` on `at` (UDP).
    pub fn start(at: SocketAddr, name: &str, ip: Ipv4Addr) -> std::io::Result<Self> {
        let sock = UdpSocket::bind(at)?;
        sock.set_read_timeout(Some(Duration::from_millis(200)))?;
        let addr = sock.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let answered = Arc::new(AtomicUsize::new(0));
        let (s, a, name) = (stop.clone(), answered.clone(), name.to_ascii_lowercase());
        let thread = std::thread::spawn(move || {
            let mut buf = [0u8; 512];
            while !s.load(Ordering::SeqCst) {
                let Ok((n, from)) = sock.recv_from(&mut buf) else {
                    continue;
                };
                if let Some(reply) = buf.get(..n).and_then(|q| answer(q, &name, ip)) {
                    if sock.send_to(&reply, from).is_ok() {
                        a.fetch_add(1, Ordering::SeqCst);
                    }
                }
            }
        });
        Ok(Self {
            stop,
            answered,
            addr,
            thread: Some(thread),
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// How many queries it answered.
    pub fn answered(&self) -> usize {
        self.answered.load(Ordering::SeqCst)
    }
}

impl Drop for TinyDns {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The reply to query `q`, or `None` when it is not one.
fn answer(q: &[u8], name: &str, ip: Ipv4Addr) -> Option<Vec<u8>> {
    let header = q.get(..12)?;
    if header.get(4..6)? != [0, 1] {
        return None;
    }
    // The question: labels, then type and class.
    let mut at = 12;
    let mut labels = Vec::new();
    loop {
        let len = usize::from(*q.get(at)?);
        at += 1;
        if len == 0 {
            break;
        }
        labels.push(String::from_utf8_lossy(q.get(at..at + len)?).to_ascii_lowercase());
        at += len;
    }
    let qtype = q.get(at..at + 2)?;
    let question = q.get(12..at + 4)?;
    let is_a = qtype == [0, 1];
    let known = labels.join(".") == name;
    let mut r = Vec::with_capacity(64);
    r.extend_from_slice(header.get(..2)?); // id
    let rcode = if known { 0 } else { 3 };
    r.extend_from_slice(&[0x81, 0x80 | rcode]); // response, RD, RA
    r.extend_from_slice(&[0, 1, 0, u8::from(known && is_a), 0, 0, 0, 0]);
    r.extend_from_slice(question);
    if known && is_a {
        r.extend_from_slice(&[0xc0, 12, 0, 1, 0, 1, 0, 0, 0, 60, 0, 4]);
        r.extend_from_slice(&ip.octets());
    }
    Some(r)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn query(name: &str, qtype: u8) -> Vec<u8> {
        let mut q = vec![0x12, 0x34, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0];
        for l in name.split('.') {
            q.push(l.len() as u8);
            q.extend_from_slice(l.as_bytes());
        }
        q.extend_from_slice(&[0, 0, qtype, 0, 1]);
        q
    }

    #[test]
    fn answers_its_name_over_udp() {
        let ip = Ipv4Addr::new(10, 1, 2, 3);
        let dns = TinyDns::start("127.0.0.1:0".parse().unwrap(), "web.burrow.test", ip).unwrap();
        let client = UdpSocket::bind("127.0.0.1:0").unwrap();
        client
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        client
            .send_to(&query("Web.Burrow.Test", 1), dns.addr())
            .unwrap();
        let mut buf = [0u8; 512];
        let n = client.recv(&mut buf).unwrap();
        let r = &buf[..n];
        assert_eq!(dns.answered(), 1);
        assert_eq!(&r[..2], &[0x12, 0x34]);
        assert_eq!(r[3] & 0x0f, 0, "NOERROR");
        assert_eq!(&r[6..8], &[0, 1], "one answer");
        assert_eq!(&r[r.len() - 4..], &[10, 1, 2, 3]);
        let aaaa = answer(&query("web.burrow.test", 28), "web.burrow.test", ip).unwrap();
        assert_eq!((aaaa[3] & 0x0f, &aaaa[6..8]), (0, &[0u8, 0][..]), "NODATA");
        let other = answer(&query("else.test", 1), "web.burrow.test", ip).unwrap();
        assert_eq!(other[3] & 0x0f, 3, "NXDOMAIN");
        assert!(answer(&[0; 5], "x", ip).is_none());
    }
}
