//! Snapshot state of the i8042: nothing worth keeping across a restore
//! (its buffer only holds probe replies); recreated fresh.
