//! Events for the serial port: host input (a terminal on stdin in
//! standalone mode) becomes guest input.

use std::io::Read;

use super::Serial;

impl Serial {
    /// Read what is available from `input` and queue it for the guest.
    /// Returns false at end of input.
    pub fn handle_input(&mut self, input: &mut impl Read) -> bool {
        let mut buf = [0u8; 64];
        match input.read(&mut buf) {
            Ok(0) => false,
            Ok(n) => {
                self.enqueue_input(buf.get(..n).unwrap_or_default());
                true
            }
            Err(e) => e.kind() == std::io::ErrorKind::Interrupted || e.kind() == std::io::ErrorKind::WouldBlock,
        }
    }
}
