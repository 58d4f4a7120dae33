//! Snapshot state of the i8042: its status/control/output-port bytes, a
//! command waiting for its data byte and the output buffer.

use std::collections::VecDeque;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vmm_sys_util::eventfd::EventFd;

use super::device::MAX_BUFFER;
use super::I8042;
use crate::snapshot::Persist;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct I8042State {
    pub status: u8,
    pub ctr: u8,
    pub outp: u8,
    pub pending_cmd: Option<u8>,
    pub buf: Vec<u8>,
}

#[derive(Debug, thiserror::Error)]
#[error("i8042 state: output buffer holds {0} bytes (at most {MAX_BUFFER})")]
pub struct I8042PersistError(usize);

/// The IRQ 1 line and the CPU-reset line.
pub struct I8042Context {
    pub irq: Arc<EventFd>,
    pub reset: Arc<EventFd>,
}

impl Persist for I8042 {
    type State = I8042State;
    type Context = I8042Context;
    type Error = I8042PersistError;

    fn save(&self) -> I8042State {
        I8042State {
            status: self.status,
            ctr: self.ctr,
            outp: self.outp,
            pending_cmd: self.pending_cmd,
            buf: self.buf.iter().copied().collect(),
        }
    }

    fn restore(ctx: I8042Context, s: &I8042State) -> Result<Self, I8042PersistError> {
        if s.buf.len() > MAX_BUFFER {
            return Err(I8042PersistError(s.buf.len()));
        }
        let mut d = I8042::new(ctx.irq, ctx.reset);
        d.status = s.status;
        d.ctr = s.ctr;
        d.outp = s.outp;
        d.pending_cmd = s.pending_cmd;
        d.buf = s.buf.iter().copied().collect::<VecDeque<u8>>();
        Ok(d)
    }
}
