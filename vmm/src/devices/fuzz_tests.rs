//! Bounded randomized tests (issue 15) of the devices a guest drives by
//! register: [`fuzz::port_io`](super::fuzz::port_io) and
//! [`fuzz::mmio_registers`](super::fuzz::mmio_registers) (also cargo-fuzz
//! targets) fed seeded random inputs, a few thousand each, in the normal
//! test suite; any panic is a bug.

use super::fuzz::{mmio_registers, port_io};

fn random_inputs(seed: u64, cases: usize, len: usize, run: fn(&[u8])) {
    let mut rng = fastrand::Rng::with_seed(seed);
    for _ in 0..cases {
        let data: Vec<u8> = (0..rng.usize(0..len)).map(|_| rng.u8(..)).collect();
        run(&data);
    }
    run(&[]);
}

#[test]
fn random_port_io_never_panics_and_output_is_bounded_by_writes() {
    random_inputs(0x5eed_0017, 2000, 1600, port_io);
}

#[test]
fn random_mmio_register_sequences_never_panic() {
    random_inputs(0x5eed_0018, 2000, 2400, |d| {
        mmio_registers(d);
    });
}

/// The MMIO harness reaches an activated device (queues set up, status
/// DRIVER_OK) often enough to exercise notifications, not only the
/// registers of a device that never starts.
#[test]
fn the_mmio_harness_activates_devices() {
    use super::virtio::mmio::*;
    let mut rng = fastrand::Rng::with_seed(0x5eed_0019);
    let mut driver_ok = 0;
    for _ in 0..500 {
        // A driver's setup: features, queue 0 at addresses in memory,
        // ready, then status; the harness reads (register, len, value).
        let mut data = vec![0u8];
        let mut write = |reg: u64, v: u8| {
            // `below(8)` >= 2 picks REGS; `below(3)` != 0 writes;
            // `below(4)` == 1 takes `below(16)`.
            let idx = super::fuzz::REGS
                .iter()
                .position(|&r| r == reg)
                .unwrap_or(0);
            data.extend([2, idx as u8, 2, 1, 1, v]);
        };
        write(REG_STATUS, 1);
        write(REG_STATUS, 3);
        write(REG_DRIVER_FEATURES_SEL, 1);
        write(REG_DRIVER_FEATURES, 1);
        write(REG_STATUS, 11);
        write(REG_QUEUE_SEL, 0);
        write(REG_QUEUE_NUM, 8);
        write(REG_QUEUE_READY, 1);
        write(REG_STATUS, 15);
        let status = super::fuzz::mmio_registers(&data);
        assert_eq!(
            status & (STATUS_DRIVER_OK | STATUS_NEEDS_RESET),
            STATUS_DRIVER_OK,
            "the setup alone: status {status:#x}"
        );
        data.extend((0..rng.usize(0..400)).map(|_| rng.u8(..)));
        if super::fuzz::mmio_registers(&data) & STATUS_DRIVER_OK != 0 {
            driver_ok += 1;
        }
    }
    assert!(driver_ok > 0, "no run kept its device running");
}
