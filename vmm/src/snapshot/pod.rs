//! Plain KVM structs (registers, LAPIC pages, irqchip state, ...) in the
//! state file: stored as their raw bytes, hex-encoded, and read back only
//! when the length matches the struct exactly. These are `repr(C)` structs
//! of integers and integer arrays, for which every byte pattern is valid.

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A KVM struct made only of integers (and arrays/unions of integers), so
/// that any byte pattern of its size is a valid value.
///
/// # Safety
/// Implement only for such types.
pub unsafe trait Plain: Default {}

macro_rules! plain {
    ($($t:ty),* $(,)?) => { $(
        // SAFETY: kvm-bindings' repr(C) struct of integer fields/arrays.
        unsafe impl Plain for $t {}
    )* };
}

plain!(
    kvm_bindings::kvm_regs,
    kvm_bindings::kvm_sregs,
    kvm_bindings::kvm_fpu,
    kvm_bindings::kvm_xsave,
    kvm_bindings::kvm_xcrs,
    kvm_bindings::kvm_lapic_state,
    kvm_bindings::kvm_mp_state,
    kvm_bindings::kvm_vcpu_events,
    kvm_bindings::kvm_debugregs,
    kvm_bindings::kvm_cpuid_entry2,
    kvm_bindings::kvm_msr_entry,
    kvm_bindings::kvm_irqchip,
    kvm_bindings::kvm_pit_state2,
    kvm_bindings::kvm_clock_data,
);

/// The raw bytes of `v`.
pub fn to_bytes<T: Plain>(v: &T) -> Vec<u8> {
    let len = std::mem::size_of::<T>();
    // SAFETY: `v` is a valid reference to `len` initialized bytes (Plain
    // types have no padding-dependent invariants; kvm-bindings zero-fill).
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), len) }.to_vec()
}

/// Rebuild a `T` from exactly `size_of::<T>()` bytes.
pub fn from_bytes<T: Plain>(bytes: &[u8]) -> Option<T> {
    if bytes.len() != std::mem::size_of::<T>() {
        return None;
    }
    let mut v = T::default();
    // SAFETY: the lengths match and any byte pattern is a valid `T` (Plain).
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), (&mut v as *mut T).cast::<u8>(), bytes.len()) };
    Some(v)
}

/// A [`Plain`] value that serializes as a hex string of its bytes.
#[derive(Debug, Default)]
pub struct Pod<T: Plain>(pub T);

impl<T: Plain> Pod<T> {
    pub fn bytes(&self) -> Vec<u8> {
        to_bytes(&self.0)
    }
}

impl<T: Plain> PartialEq for Pod<T> {
    fn eq(&self, other: &Self) -> bool {
        self.bytes() == other.bytes()
    }
}

impl<T: Plain> Clone for Pod<T> {
    fn clone(&self) -> Self {
        // The bytes came from a T of the same size.
        Self(from_bytes(&self.bytes()).unwrap_or_default())
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

pub fn hex(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(char::from(HEX[usize::from(b >> 4)]));
        s.push(char::from(HEX[usize::from(b & 15)]));
    }
    s
}

pub fn unhex(s: &str) -> Option<Vec<u8>> {
    fn nib(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        }
    }
    let b = s.as_bytes();
    if b.len() % 2 != 0 {
        return None;
    }
    b.chunks(2)
        .map(|p| match p {
            [h, l] => Some(nib(*h)? << 4 | nib(*l)?),
            _ => None,
        })
        .collect()
}

impl<T: Plain> Serialize for Pod<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&hex(&self.bytes()))
    }
}

impl<'de, T: Plain> Deserialize<'de> for Pod<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let bytes = unhex(&s).ok_or_else(|| serde::de::Error::custom("bad hex"))?;
        let len = bytes.len();
        from_bytes(&bytes).map(Pod).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "{} is {} bytes, state has {len}",
                std::any::type_name::<T>(),
                std::mem::size_of::<T>()
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_length_check() {
        let regs = kvm_bindings::kvm_regs { rip: 0x1234, rax: u64::MAX, ..Default::default() };
        let json = serde_json::to_string(&Pod(regs)).unwrap();
        let back: Pod<kvm_bindings::kvm_regs> = serde_json::from_str(&json).unwrap();
        assert_eq!(back.0.rip, 0x1234);
        assert_eq!(back.0.rax, u64::MAX);
        assert!(serde_json::from_str::<Pod<kvm_bindings::kvm_regs>>("\"00ff\"").is_err());
        assert!(serde_json::from_str::<Pod<kvm_bindings::kvm_regs>>("\"zz\"").is_err());
        assert_eq!(unhex(&hex(&[0, 0xab, 0x7f])).unwrap(), vec![0, 0xab, 0x7f]);
    }
}
