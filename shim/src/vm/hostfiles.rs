//! /etc/resolv.conf, /etc/hosts and /etc/hostname for the guest: CRI (and
//! nerdctl) bind-mount them from host files, which a VM cannot mount. The
//! guest spec keeps each such mount with its source pointing at a file the
//! agent writes from the contents carried in an annotation
//! (`burrow_protocol::net::HOST_FILES`); other bind mounts stay stripped.

use std::io::Read;

use burrow_protocol::net::{
    HOST_FILES, HOST_FILE_ANNOTATION, HOST_FILE_SOURCE, MAX_HOST_FILE_BYTES,
};
use serde_json::{Map, Value};

/// A regular host file's contents, if it is at most the carried size.
fn read_small(path: &str) -> Option<String> {
    let f = std::fs::File::open(path).ok()?;
    if !f.metadata().ok()?.is_file() {
        return None;
    }
    let mut text = String::new();
    let limit = u64::try_from(MAX_HOST_FILE_BYTES).ok()? + 1;
    f.take(limit).read_to_string(&mut text).ok()?;
    (text.len() <= MAX_HOST_FILE_BYTES).then_some(text)
}

/// Put into `guest` (the spec after `spec::for_guest`) the network-identity
/// bind mounts of `host`, with their files' contents; drop any such
/// annotation the spec came with. Returns the destinations carried.
pub fn carry(host: &Value, guest: &mut Value) -> Vec<String> {
    let mut carried = Vec::new();
    let Some(obj) = guest.as_object_mut() else {
        return carried;
    };
    let mut annotations = obj
        .remove("annotations")
        .and_then(|a| match a {
            Value::Object(m) => Some(m),
            _ => None,
        })
        .unwrap_or_default();
    annotations.retain(|k, _| !k.starts_with(HOST_FILE_ANNOTATION));
    let mut mounts = Vec::new();
    for m in host
        .get("mounts")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let dest = m.get("destination").and_then(Value::as_str);
        let Some((dest, name)) = HOST_FILES.iter().find(|(d, _)| Some(*d) == dest) else {
            continue;
        };
        let Some(mo) = m.as_object().filter(|mo| crate::spec::is_bind(mo)) else {
            continue;
        };
        let Some(text) = mo
            .get("source")
            .and_then(Value::as_str)
            .and_then(read_small)
        else {
            tracing::info!("{dest}: the bind mount's source is not a small regular file");
            continue;
        };
        let ro = mo
            .get("options")
            .and_then(Value::as_array)
            .is_some_and(|o| o.iter().any(|x| x.as_str() == Some("ro")));
        let mut options = vec![Value::from("bind")];
        if ro {
            options.push("ro".into());
        }
        let mut guest_mount = Map::new();
        guest_mount.insert("destination".into(), (*dest).into());
        guest_mount.insert("type".into(), "bind".into());
        guest_mount.insert("source".into(), format!("{HOST_FILE_SOURCE}{name}").into());
        guest_mount.insert("options".into(), options.into());
        mounts.push(Value::Object(guest_mount));
        annotations.insert(format!("{HOST_FILE_ANNOTATION}{name}"), text.into());
        carried.push((*dest).to_string());
    }
    if !annotations.is_empty() {
        obj.insert("annotations".into(), Value::Object(annotations));
    }
    if !mounts.is_empty() {
        match obj.get_mut("mounts").and_then(Value::as_array_mut) {
            Some(existing) => existing.extend(mounts),
            None => {
                obj.insert("mounts".into(), Value::Array(mounts));
            }
        }
    }
    carried
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn carries_resolv_conf_and_hosts_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let resolv = dir.path().join("resolv.conf");
        std::fs::write(&resolv, "nameserver 10.88.0.1\n").unwrap();
        let hosts = dir.path().join("hosts");
        std::fs::write(&hosts, "10.88.0.5 me\n").unwrap();
        let big = dir.path().join("big");
        std::fs::write(&big, vec![b'x'; MAX_HOST_FILE_BYTES + 1]).unwrap();
        let host = json!({
            "mounts": [
                {"destination": "/etc/resolv.conf", "type": "bind", "source": resolv, "options": ["rbind", "ro"]},
                {"destination": "/etc/hosts", "source": hosts, "options": ["rbind", "rw"]},
                {"destination": "/etc/hostname", "type": "bind", "source": big, "options": ["rbind"]},
                {"destination": "/data", "type": "bind", "source": "/etc/shadow", "options": ["rbind"]},
            ],
            "annotations": {"io.burrow.file.passwd": "x", "a": "b"},
        });
        let (mut guest, _) = crate::spec::for_guest(&host);
        let carried = carry(&host, &mut guest);
        assert_eq!(carried, ["/etc/resolv.conf", "/etc/hosts"]);
        assert_eq!(
            guest["mounts"],
            json!([
                {"destination": "/etc/resolv.conf", "type": "bind", "source": "burrow-file:resolv.conf", "options": ["bind", "ro"]},
                {"destination": "/etc/hosts", "type": "bind", "source": "burrow-file:hosts", "options": ["bind"]},
            ])
        );
        assert_eq!(
            guest["annotations"],
            json!({
                "a": "b",
                "io.burrow.file.resolv.conf": "nameserver 10.88.0.1\n",
                "io.burrow.file.hosts": "10.88.0.5 me\n",
            }),
            "the spec's own io.burrow.file.* annotations are dropped"
        );
    }
}
