//! KVM structs in the state file, through kvm-bindings' own serde (its
//! "serde" feature: each struct as its bytes, a JSON array of numbers).
//! kvm-bindings reads back any length, zero-filling or cutting to fit (to
//! carry state across kernel versions); a snapshot here is only restored
//! by the same build, so a block of the wrong size is a bad file and is
//! refused: use `#[serde(with = "exact")]` (or `exact::option`,
//! `exact::vec`) on such fields. `kvm_fpu` has no serde in kvm-bindings:
//! [`KvmFpu`] gives it one through `serde(remote)`.

use kvm_bindings::kvm_fpu;
use serde::de::value::BytesDeserializer;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Rebuild a `T` from exactly `size_of::<T>()` bytes with its own serde.
fn from_exact_bytes<T: DeserializeOwned, E: serde::de::Error>(bytes: &[u8]) -> Result<T, E> {
    let size = std::mem::size_of::<T>();
    if bytes.len() != size {
        let name = std::any::type_name::<T>();
        let name = name.rsplit("::").next().unwrap_or(name);
        return Err(E::custom(format!(
            "{name} is {size} bytes, state has {}",
            bytes.len()
        )));
    }
    T::deserialize(BytesDeserializer::<E>::new(bytes))
}

/// A kvm-bindings struct, read back only at its exact size.
pub mod exact {
    use super::*;

    pub fn serialize<T: Serialize, S: Serializer>(v: &T, s: S) -> Result<S::Ok, S::Error> {
        v.serialize(s)
    }

    pub fn deserialize<'de, T: DeserializeOwned, D: Deserializer<'de>>(
        d: D,
    ) -> Result<T, D::Error> {
        from_exact_bytes(&Vec::<u8>::deserialize(d)?)
    }

    /// `Option<T>` of such a struct.
    pub mod option {
        use super::super::*;

        pub fn serialize<T: Serialize, S: Serializer>(
            v: &Option<T>,
            s: S,
        ) -> Result<S::Ok, S::Error> {
            v.serialize(s)
        }

        pub fn deserialize<'de, T: DeserializeOwned, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Option<T>, D::Error> {
            Option::<Vec<u8>>::deserialize(d)?
                .map(|b| from_exact_bytes(&b))
                .transpose()
        }
    }

    /// `Vec<T>` of such structs.
    pub mod vec {
        use super::super::*;

        pub fn serialize<T: Serialize, S: Serializer>(v: &[T], s: S) -> Result<S::Ok, S::Error> {
            v.serialize(s)
        }

        pub fn deserialize<'de, T: DeserializeOwned, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Vec<T>, D::Error> {
            Vec::<Vec<u8>>::deserialize(d)?
                .iter()
                .map(|b| from_exact_bytes(b))
                .collect()
        }
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
        #[serde(with = "exact")]
        regs: kvm_regs,
        #[serde(with = "exact::option")]
        xsave: Option<kvm_xsave>,
        #[serde(with = "exact::vec")]
        msrs: Vec<kvm_msr_entry>,
        #[serde(with = "KvmFpu")]
        fpu: kvm_fpu,
    }

    #[test]
    fn round_trip_and_exact_length() {
        let mut xsave = kvm_xsave::default();
        xsave.region[3] = 0xdead_beef;
        let s = S {
            regs: kvm_regs {
                rip: 0x1234,
                rax: u64::MAX,
                ..Default::default()
            },
            xsave: Some(xsave),
            msrs: vec![kvm_msr_entry {
                index: 0x10,
                data: 7,
                ..Default::default()
            }],
            fpu: kvm_fpu {
                fcw: 0x37f,
                mxcsr: 0x1f80,
                xmm: [[9; 16]; 16],
                ..Default::default()
            },
        };
        let json = serde_json::to_value(&s).unwrap();
        let back: S = serde_json::from_value(json.clone()).unwrap();
        assert_eq!(back.regs, s.regs);
        assert_eq!(back.xsave.unwrap().region[3], 0xdead_beef);
        assert_eq!(back.msrs, s.msrs);
        assert_eq!(back.fpu, s.fpu);
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
