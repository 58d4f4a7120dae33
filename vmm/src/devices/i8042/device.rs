use std::collections::VecDeque;
use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

pub const DATA_OFFSET: u16 = 0;
pub const COMMAND_OFFSET: u16 = 4;

const CMD_READ_CTR: u8 = 0x20;
const CMD_WRITE_CTR: u8 = 0x60;
const CMD_DISABLE_AUX: u8 = 0xa7;
const CMD_ENABLE_AUX: u8 = 0xa8;
const CMD_TEST_AUX: u8 = 0xa9;
const CMD_SELF_TEST: u8 = 0xaa;
const CMD_TEST_KBD: u8 = 0xab;
const CMD_DISABLE_KBD: u8 = 0xad;
const CMD_ENABLE_KBD: u8 = 0xae;
const CMD_READ_OUTP: u8 = 0xd0;
const CMD_WRITE_OUTP: u8 = 0xd1;
const CMD_WRITE_AUX: u8 = 0xd4;
const CMD_RESET_CPU: u8 = 0xfe;

const SB_OUT_DATA_AVAIL: u8 = 0x01;
const SB_SYSTEM_FLAG: u8 = 0x04;
const SB_CMD_DATA: u8 = 0x08;
const SB_KBD_ENABLED: u8 = 0x10;
const CTR_KBD_INT: u8 = 0x01;

const KBD_ACK: u8 = 0xfa;
const KBD_CMD_GET_ID: u8 = 0xf2;
const KBD_CMD_RESET: u8 = 0xff;
const KBD_BAT_OK: u8 = 0xaa;
pub(super) const MAX_BUFFER: usize = 16;

pub struct I8042 {
    pub(super) status: u8,
    pub(super) ctr: u8,
    pub(super) outp: u8,
    /// Command waiting for its data byte.
    pub(super) pending_cmd: Option<u8>,
    pub(super) buf: VecDeque<u8>,
    pub(super) irq: Arc<EventFd>,
    pub(super) reset: Arc<EventFd>,
}

impl I8042 {
    /// `irq` raises IRQ 1; `reset` is signalled when the guest resets the CPU.
    pub fn new(irq: Arc<EventFd>, reset: Arc<EventFd>) -> Self {
        Self {
            status: SB_SYSTEM_FLAG | SB_KBD_ENABLED,
            ctr: CTR_KBD_INT,
            outp: 0,
            pending_cmd: None,
            buf: VecDeque::new(),
            irq,
            reset,
        }
    }

    fn push(&mut self, b: u8) {
        if self.buf.len() < MAX_BUFFER {
            self.buf.push_back(b);
        }
        self.status |= SB_OUT_DATA_AVAIL;
    }

    fn kbd_interrupt(&self) {
        if self.ctr & CTR_KBD_INT != 0 && !self.buf.is_empty() {
            let _ = self.irq.write(1);
        }
    }

    /// Read port `0x60 + offset`.
    pub fn read(&mut self, offset: u16) -> u8 {
        match offset {
            DATA_OFFSET => {
                let b = self.buf.pop_front().unwrap_or(0);
                if self.buf.is_empty() {
                    self.status &= !SB_OUT_DATA_AVAIL;
                } else {
                    self.kbd_interrupt();
                }
                b
            }
            COMMAND_OFFSET => self.status,
            _ => 0xff,
        }
    }

    /// Write port `0x60 + offset`.
    pub fn write(&mut self, offset: u16, value: u8) {
        match offset {
            COMMAND_OFFSET => {
                self.status |= SB_CMD_DATA;
                match value {
                    CMD_RESET_CPU => {
                        tracing::info!("guest reset the CPU through the i8042");
                        let _ = self.reset.write(1);
                    }
                    CMD_READ_CTR => self.push(self.ctr),
                    CMD_WRITE_CTR | CMD_WRITE_OUTP | CMD_WRITE_AUX => self.pending_cmd = Some(value),
                    CMD_READ_OUTP => self.push(self.outp),
                    CMD_SELF_TEST => self.push(0x55),
                    CMD_TEST_KBD => self.push(0x00),
                    // No AUX (mouse) port: its test reports a clock line stuck low.
                    CMD_TEST_AUX => self.push(0x01),
                    CMD_DISABLE_KBD => self.status &= !SB_KBD_ENABLED,
                    CMD_ENABLE_KBD => self.status |= SB_KBD_ENABLED,
                    CMD_DISABLE_AUX | CMD_ENABLE_AUX => {}
                    _ => tracing::debug!("i8042: ignoring command {value:#x}"),
                }
            }
            DATA_OFFSET => {
                self.status &= !SB_CMD_DATA;
                match self.pending_cmd.take() {
                    Some(CMD_WRITE_CTR) => self.ctr = value,
                    Some(CMD_WRITE_OUTP) => self.outp = value,
                    Some(_) => {} // AUX writes: no mouse
                    None => {
                        // A keyboard command: acknowledge it like a PS/2 keyboard.
                        self.push(KBD_ACK);
                        match value {
                            KBD_CMD_GET_ID => {
                                self.push(0xab);
                                self.push(0x83);
                            }
                            KBD_CMD_RESET => self.push(KBD_BAT_OK),
                            _ => {}
                        }
                        self.kbd_interrupt();
                    }
                }
            }
            _ => {}
        }
    }
}
