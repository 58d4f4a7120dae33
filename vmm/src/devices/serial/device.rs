use std::io::{Read, Write};
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

/// Raises an IRQ line through an irqfd.
#[derive(Clone, Debug)]
pub struct IrqEvt(pub Arc<EventFd>);

impl vm_superio::Trigger for IrqEvt {
    type E = std::io::Error;
    fn trigger(&self) -> std::io::Result<()> {
        self.0.write(1)
    }
}

/// Where the console goes.
pub type SerialOut = Box<dyn Write + Send>;

/// COM1: eight registers at 0x3f8.
pub struct Serial {
    pub(super) uart: vm_superio::Serial<IrqEvt, vm_superio::serial::NoEvents, SerialOut>,
}

impl Serial {
    pub fn new(irq: IrqEvt, out: SerialOut) -> Self {
        Self {
            uart: vm_superio::Serial::new(irq, out),
        }
    }

    pub fn read(&mut self, offset: u8) -> u8 {
        self.uart.read(offset)
    }

    pub fn write(&mut self, offset: u8, value: u8) {
        if let Err(e) = self.uart.write(offset, value) {
            tracing::debug!("serial write: {e:?}");
        }
        if offset == 0 {
            // Console output should reach the log promptly.
            let _ = self.uart.writer_mut().flush();
        }
    }

    /// Queue input bytes for the guest; returns how many fit.
    pub fn enqueue_input(&mut self, bytes: &[u8]) -> usize {
        self.uart.enqueue_raw_bytes(bytes).unwrap_or(0)
    }

    /// Host input (a terminal on stdin in standalone mode): read what is
    /// available from `input` and queue it for the guest. Returns false
    /// at end of input.
    pub fn handle_input(&mut self, input: &mut impl Read) -> bool {
        let mut buf = [0u8; 64];
        match input.read(&mut buf) {
            Ok(0) => false,
            Ok(n) => {
                self.enqueue_input(buf.get(..n).unwrap_or_default());
                true
            }
            Err(e) => {
                e.kind() == std::io::ErrorKind::Interrupted
                    || e.kind() == std::io::ErrorKind::WouldBlock
            }
        }
    }
}
