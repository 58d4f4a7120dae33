//! The i8042 has no host-side events: it only reacts to guest port I/O.
//! Its one outgoing event, CPU reset, is an eventfd the VMM loop watches.
