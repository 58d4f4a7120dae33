use std::io::Write;
use std::sync::{Arc, Mutex};

use vmm_sys_util::eventfd::EventFd;

use super::*;

#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn output_and_input() {
    let sink = Sink::default();
    let evt = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
    let mut s = Serial::new(IrqEvt(evt.clone()), Box::new(sink.clone()));
    for b in b"hi\n" {
        s.write(0, *b);
    }
    assert_eq!(&*sink.0.lock().unwrap(), b"hi\n");
    // enable the "data available" interrupt, then feed input
    s.write(1, 1);
    assert!(s.handle_input(&mut &b"x"[..]));
    assert_eq!(evt.read().unwrap(), 1);
    assert_eq!(s.read(5) & 1, 1, "LSR data ready");
    assert_eq!(s.read(0), b'x');
    assert!(!s.handle_input(&mut &b""[..]));
}
