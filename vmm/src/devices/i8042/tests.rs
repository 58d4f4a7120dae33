use std::sync::Arc;

use vmm_sys_util::eventfd::EventFd;

use super::device::{COMMAND_OFFSET, DATA_OFFSET};
use super::I8042;

fn dev() -> (I8042, Arc<EventFd>, Arc<EventFd>) {
    let irq = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
    let reset = Arc::new(EventFd::new(libc::EFD_NONBLOCK).unwrap());
    (I8042::new(irq.clone(), reset.clone()), irq, reset)
}

#[test]
fn reset_command_signals_reset() {
    let (mut d, _, reset) = dev();
    assert!(reset.read().is_err(), "nothing yet");
    // Linux's kb_wait: input buffer must read empty
    assert_eq!(d.read(COMMAND_OFFSET) & 0x02, 0);
    d.write(COMMAND_OFFSET, 0xfe);
    assert_eq!(reset.read().unwrap(), 1);
}

#[test]
fn controller_probe_answers() {
    let (mut d, _, _) = dev();
    d.write(COMMAND_OFFSET, 0xaa);
    assert_eq!(d.read(COMMAND_OFFSET) & 1, 1);
    assert_eq!(d.read(DATA_OFFSET), 0x55);
    assert_eq!(d.read(COMMAND_OFFSET) & 1, 0);
    d.write(COMMAND_OFFSET, 0x60);
    d.write(DATA_OFFSET, 0x47);
    d.write(COMMAND_OFFSET, 0x20);
    assert_eq!(d.read(DATA_OFFSET), 0x47);
}

#[test]
fn keyboard_commands_are_acked_with_interrupt() {
    let (mut d, irq, _) = dev();
    d.write(DATA_OFFSET, 0xf2);
    assert!(irq.read().is_ok());
    assert_eq!(d.read(DATA_OFFSET), 0xfa);
    assert_eq!(d.read(DATA_OFFSET), 0xab);
    assert_eq!(d.read(DATA_OFFSET), 0x83);
    assert_eq!(d.read(DATA_OFFSET), 0);
    for _ in 0..100 {
        d.write(DATA_OFFSET, 0xff);
    }
    assert_eq!(d.read(5), 0xff);
}
