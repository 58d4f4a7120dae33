//! KVM structs in the state file, through kvm-bindings' own serde (its
//! "serde" feature: each struct as its bytes, a JSON array of numbers).
//! kvm-bindings reads back any length, zero-filling or cutting to fit (to
//! carry state across kernel versions); a snapshot here is only restored
//! by the same build, so a block of the wrong size is a bad file and is
//! refused: fields are [`Exact<T>`]. `kvm_fpu` has no serde in
//! kvm-bindings: [`KvmFpu`] gives it one through `serde(remote)`.

use std::ops::Deref;

use kvm_bindings::kvm_fpu;
use serde::de::value::BytesDeserializer;
use serde::de::{DeserializeOwned, Error as _};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A kvm-bindings struct stored with its own serde, read back only from
/// exactly `size_of::<T>()` bytes.
#[derive(Clone, Copy, Default)]
pub struct Exact<T>(pub T);

impl<T> Deref for Exact<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// `kvm_regs` for `kvm_bindings::x86_64::bindings::kvm_regs`.
fn short_name<T>() -> &'static str {
    let name = std::any::type_name::<T>();
    name.rsplit("::").next().unwrap_or(name)
}

impl<T> std::fmt::Debug for Exact<T> {
    // Not every KVM struct has Debug (unions inside); the size says enough.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({} bytes)",
            short_name::<T>(),
            std::mem::size_of::<T>()
        )
    }
}

impl<T: Serialize> Serialize for Exact<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de, T: DeserializeOwned> Deserialize<'de> for Exact<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let bytes = Vec::<u8>::deserialize(d)?;
        let size = std::mem::size_of::<T>();
        if bytes.len() != size {
            return Err(D::Error::custom(format!(
                "{} is {size} bytes, state has {}",
                short_name::<T>(),
                bytes.len()
            )));
        }
        T::deserialize(BytesDeserializer::<D::Error>::new(&bytes)).map(Exact)
    }
}

/// `kvm_fpu`, field for field (kvm-bindings gives it no serde).
#[derive(Serialize, Deserialize)]
#[serde(remote = "kvm_fpu")]
pub struct KvmFpu {
    pub fpr: [[u8; 16]; 8],
    pub fcw: u16,
    pub fsw: u16,
    pub ftwx: u8,
    pub pad1: u8,
    pub last_opcode: u16,
    pub last_ip: u64,
    pub last_dp: u64,
    pub xmm: [[u8; 16]; 16],
    pub mxcsr: u32,
    pub pad2: u32,
}

#[cfg(test)]
mod tests {
    use kvm_bindings::{kvm_msr_entry, kvm_regs, kvm_xsave};

    use super::*;

    #[derive(Serialize, Deserialize)]
    struct S {
        regs: Exact<kvm_regs>,
        xsave: Option<Exact<kvm_xsave>>,
        msrs: Vec<Exact<kvm_msr_entry>>,
        #[serde(with = "KvmFpu")]
        fpu: kvm_fpu,
    }

    #[test]
    fn round_trip_and_exact_length() {
        let mut xsave = kvm_xsave::default();
        xsave.region[3] = 0xdead_beef;
        let regs = kvm_regs {
            rip: 0x1234,
            rax: u64::MAX,
            ..Default::default()
        };
        let msr = kvm_msr_entry {
            index: 0x10,
            data: 7,
            ..Default::default()
        };
        let fpu = kvm_fpu {
            fcw: 0x37f,
            mxcsr: 0x1f80,
            xmm: [[9; 16]; 16],
            ..Default::default()
        };
        let s = S {
            regs: Exact(regs),
            xsave: Some(Exact(xsave)),
            msrs: vec![Exact(msr)],
            fpu,
        };
        let json = serde_json::to_value(&s).unwrap();
        let back: S = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(back.regs.0, regs);
        assert_eq!(back.xsave.unwrap().region[3], 0xdead_beef);
        assert_eq!(back.msrs.iter().map(|m| m.0).collect::<Vec<_>>(), vec![msr]);
        assert_eq!(back.fpu, fpu);
        assert_eq!(json["fpu"]["fcw"], 0x37f);

        let mut short = json.clone();
        short["regs"] = serde_json::json!([0, 255]);
        let e = serde_json::from_value::<S>(short)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("kvm_regs is 144 bytes, state has 2"), "{e}");
        let mut long = json.clone();
        long["msrs"][0].as_array_mut().unwrap().push(0.into());
        let e = serde_json::from_value::<S>(long).err().unwrap().to_string();
        assert!(e.contains("kvm_msr_entry is 16 bytes, state has 17"), "{e}");
        let mut none = json;
        none["xsave"] = serde_json::Value::Null;
        assert!(serde_json::from_value::<S>(none).unwrap().xsave.is_none());
    }
}
