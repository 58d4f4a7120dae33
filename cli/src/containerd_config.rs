//! Registering burrow in containerd's config for CRI (Kubernetes
//! RuntimeClass handler `burrow`). `ctr` and nerdctl need no config: they
//! find `containerd-shim-burrow-v2` on containerd's PATH.

use toml_edit::{value, Array, DocumentMut, Item, Table};

/// CRI runtime handler name (Kubernetes `RuntimeClass.handler`).
pub const HANDLER: &str = "burrow";
/// containerd runtime type.
pub const RUNTIME_TYPE: &str = "io.containerd.burrow.v2";
/// Annotations CRI passes through to the shim (per-pod burrow settings).
const ANNOTATIONS: &str = "io.burrow.*";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("containerd config is not valid TOML: {0}")]
    Parse(#[from] toml_edit::TomlError),
    #[error(
        "containerd config version {0} is not supported: migrate it with \
         `containerd config migrate` (version 2 for containerd 1.x, 3 for 2.x)"
    )]
    Version(i64),
    #[error("containerd config has `{0}` that is not a table")]
    NotATable(String),
}

/// Add (or update) burrow's runtime entry. Returns the new text and whether
/// anything changed. An empty input gives a fresh version-2 config.
pub fn register(text: &str) -> Result<(String, bool), ConfigError> {
    let mut doc: DocumentMut = if text.trim().is_empty() {
        "version = 2\n".parse()?
    } else {
        text.parse()?
    };
    let version = doc.get("version").and_then(Item::as_integer).unwrap_or(1);
    let cri_plugin = match version {
        2 => "io.containerd.grpc.v1.cri",
        3 => "io.containerd.cri.v1.runtime",
        v => return Err(ConfigError::Version(v)),
    };
    let path = ["plugins", cri_plugin, "containerd", "runtimes", HANDLER];

    let mut table: &mut Table = doc.as_table_mut();
    let mut walked = String::new();
    for key in path {
        walked = if walked.is_empty() {
            key.to_string()
        } else {
            format!("{walked}.{key}")
        };
        let entry = table.entry(key).or_insert_with(|| {
            let mut t = Table::new();
            t.set_implicit(true);
            Item::Table(t)
        });
        table = entry
            .as_table_mut()
            .ok_or_else(|| ConfigError::NotATable(walked.clone()))?;
    }
    table.set_implicit(false);
    let before = table.to_string();
    if table.get("runtime_type").and_then(Item::as_str) != Some(RUNTIME_TYPE) {
        table["runtime_type"] = value(RUNTIME_TYPE);
    }
    for key in ["pod_annotations", "container_annotations"] {
        let wanted = table
            .get(key)
            .and_then(Item::as_array)
            .is_some_and(|a| a.len() == 1 && a.get(0).and_then(|v| v.as_str()) == Some(ANNOTATIONS));
        if !wanted {
            let mut list = Array::new();
            list.push(ANNOTATIONS);
            table[key] = value(list);
        }
    }
    let changed = table.to_string() != before;
    Ok((doc.to_string(), changed))
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEBIAN: &str = r#"version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "/etc/cni/net.d"
  [plugins."io.containerd.internal.v1.opt"]
    path = "/var/lib/containerd/opt"
"#;

    #[test]
    fn adds_runtime_to_debian_config_and_keeps_the_rest() {
        let (out, changed) = register(DEBIAN).unwrap();
        assert!(changed);
        assert!(out.contains(r#"bin_dir = "/usr/lib/cni""#), "{out}");
        let doc: toml::Table = toml::from_str(&out).unwrap();
        let rt = &doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["burrow"];
        assert_eq!(rt["runtime_type"].as_str(), Some(RUNTIME_TYPE));
        assert_eq!(rt["pod_annotations"][0].as_str(), Some("io.burrow.*"));
    }

    #[test]
    fn is_idempotent() {
        let (once, _) = register(DEBIAN).unwrap();
        let (twice, changed) = register(&once).unwrap();
        assert!(!changed, "second run changes nothing");
        assert_eq!(once, twice);
    }

    #[test]
    fn fresh_and_v3_configs() {
        let (out, changed) = register("").unwrap();
        assert!(changed);
        let doc: toml::Table = toml::from_str(&out).unwrap();
        assert_eq!(doc["version"].as_integer(), Some(2));
        let (out, _) = register("version = 3\n").unwrap();
        let doc: toml::Table = toml::from_str(&out).unwrap();
        let rt = &doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["burrow"];
        assert_eq!(rt["runtime_type"].as_str(), Some(RUNTIME_TYPE));
    }

    #[test]
    fn refuses_bad_input() {
        assert!(matches!(register("[plugins"), Err(ConfigError::Parse(_))));
        assert!(matches!(
            register("[plugins]\nx = 1\n"),
            Err(ConfigError::Version(1))
        ));
        let err = register("version = 2\nplugins = 3\n").unwrap_err();
        assert!(err.to_string().contains("plugins"), "{err}");
    }
}
