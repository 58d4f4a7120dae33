//! `burrow sandbox fork ID N`: N copies of a running sandbox, each a new
//! containerd container and task (visible to `ctr`), continuing from one
//! instant of the source.
//!
//! The source's shim writes one named checkpoint (the VM paused for the
//! snapshot, then running on: [`SandboxRequest::Checkpoint`]); each copy is
//! `ctr run -d --annotation io.burrow.restore=NAME` of the source's image
//! and runtime, which its own shim restores: the memory file mapped
//! MAP_PRIVATE (the copies share its pages copy-on-write), the disk copied
//! (a reflink where the file system can), and a fresh identity (clock,
//! entropy with a CRNG reseed, guest hostname, machine id). The copies
//! start side by side, up to eight at once. The checkpoint goes once every
//! copy runs (their VMMs hold the memory file open).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::sandbox::{self, SandboxRequest};

/// The annotation a shim restores a named checkpoint from.
const RESTORE_ANNOTATION: &str = "io.burrow.restore";
/// Most copies one fork makes.
pub const MAX_COPIES: u32 = 64;
/// Most copies started at once.
const PARALLEL_STARTS: usize = 8;

/// `ctr` against containerd at `address`, in `namespace`.
fn ctr(address: &str, namespace: &str, args: &[&str]) -> Result<String> {
    let out = Command::new("ctr")
        .args(["--address", address, "--namespace", namespace])
        .args(args)
        .output()
        .context("running ctr (containerd's client)")?;
    if !out.status.success() {
        bail!(
            "ctr {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The source container's image and runtime, from `ctr containers info`.
/// A CRI pod's container is refused: its copies would be lone containers
/// outside any pod, and its VM holds the whole pod.
fn image_and_runtime(info: &str) -> Result<(String, String)> {
    let v: serde_json::Value = serde_json::from_str(info).context("ctr containers info")?;
    if v.pointer("/Spec/annotations/io.kubernetes.cri.container-type").is_some() {
        bail!(
            "it is a CRI pod's container: a pod is copied whole, through CRI: `burrow sandbox checkpoint POD NAME`, then pods started with the pod annotation io.burrow.restore=NAME"
        );
    }
    let image = v.get("Image").and_then(|i| i.as_str()).unwrap_or_default();
    let runtime = v
        .pointer("/Runtime/Name")
        .and_then(|r| r.as_str())
        .unwrap_or_default();
    if image.is_empty() || runtime.is_empty() {
        bail!("the container has no image or runtime to copy");
    }
    Ok((image.to_string(), runtime.to_string()))
}

/// containerd's socket: `address`, else $CONTAINERD_ADDRESS, else
/// containerd's default.
pub fn containerd_address(address: Option<String>) -> String {
    address
        .or_else(|| std::env::var("CONTAINERD_ADDRESS").ok())
        .unwrap_or_else(|| "/run/containerd/containerd.sock".into())
}

/// `ctr run -d` of container `new_id` restored from named checkpoint
/// `name` (its shim restores the whole VM from it instead of starting the
/// image's process; the image only satisfies ctr).
fn run_restored(
    address: &str,
    namespace: &str,
    (image, runtime): (&str, &str),
    name: &str,
    new_id: &str,
) -> Result<()> {
    let annotation = format!("{RESTORE_ANNOTATION}={name}");
    let args = [
        "run",
        "-d",
        "--runtime",
        runtime,
        "--annotation",
        &annotation,
        image,
        new_id,
    ];
    ctr(address, namespace, &args).map(|_| ())
}

/// Start a new sandbox `new_id` from named checkpoint `name` (written by
/// `burrow sandbox checkpoint` or MCP `checkpoint`), as a containerd
/// container with the image and runtime of sandbox `like` (normally the
/// one the checkpoint was taken of, which is left as it is). The
/// checkpoint stays, for further restores.
pub fn restore(address: &str, namespace: &str, like: &str, name: &str, new_id: &str) -> Result<()> {
    let info = ctr(address, namespace, &["containers", "info", like])
        .with_context(|| format!("the image and runtime of {like:?}"))?;
    let (image, runtime) = image_and_runtime(&info)?;
    run_restored(address, namespace, (&image, &runtime), name, new_id)
        .with_context(|| format!("restoring checkpoint {name} into a new sandbox {new_id}"))
}

/// The copies' ids: `<id>-fork-<k>`.
pub fn copy_ids(id: &str, n: u32) -> Vec<String> {
    (1..=n).map(|k| format!("{id}-fork-{k}")).collect()
}

/// Fork sandbox `id` (state directory `dir`) into `n` copies; returns their
/// ids.
pub fn fork(dir: &Path, address: &str, namespace: &str, id: &str, n: u32) -> Result<Vec<String>> {
    if n == 0 || n > MAX_COPIES {
        bail!("want 1..={MAX_COPIES} copies");
    }
    // Before anything is written: a pod's container is refused here.
    let (image, runtime) =
        image_and_runtime(&ctr(address, namespace, &["containers", "info", id])?)
            .with_context(|| format!("forking {id}"))?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos();
    let name = format!("fork-{nanos}");
    let reply = sandbox::request(
        dir,
        &SandboxRequest::Checkpoint { name: name.clone() },
        Duration::from_secs(600),
    )?;
    // The copies start side by side: each is its own shim restoring the
    // same checkpoint, mostly waiting on its own VM, so N copies take about
    // one restore's time rather than N.
    // At most PARALLEL_STARTS at once: each is a shim and a VM booting.
    let ids = copy_ids(id, n);
    let mut results: Vec<Result<()>> = Vec::with_capacity(ids.len());
    for batch in ids.chunks(PARALLEL_STARTS) {
        std::thread::scope(|s| {
            let started: Vec<_> = batch
                .iter()
                .map(|copy| {
                    let (image, runtime, name) = (&image, &runtime, &name);
                    s.spawn(move || run_restored(address, namespace, (image, runtime), name, copy))
                })
                .collect();
            results.extend(started.into_iter().map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("the thread starting it panicked")))
            }));
        });
    }
    let mut made = Vec::new();
    let mut failed = None;
    for (copy, result) in ids.into_iter().zip(results) {
        match result {
            Ok(()) => made.push(copy),
            Err(e) => {
                if failed.is_none() {
                    failed = Some(e.context(format!("starting copy {copy}")));
                }
            }
        }
    }
    if let Some(at) = &reply.dir {
        let _ = std::fs::remove_dir_all(at);
    }
    match failed {
        Some(e) if made.is_empty() => Err(e),
        Some(e) => Err(e.context(format!("{} started: {}", made.len(), made.join(" ")))),
        None => Ok(made),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_source_image_and_runtime_are_copied() {
        let info = r#"{"ID":"src","Image":"docker.io/library/busybox:latest",
            "Runtime":{"Name":"io.containerd.burrow.v2","Options":null}}"#;
        assert_eq!(
            image_and_runtime(info).unwrap(),
            (
                "docker.io/library/busybox:latest".to_string(),
                "io.containerd.burrow.v2".to_string()
            )
        );
        assert!(image_and_runtime(r#"{"ID":"src"}"#).is_err());
        let pod = r#"{"ID":"src","Image":"busybox","Runtime":{"Name":"io.containerd.burrow.v2"},
            "Spec":{"annotations":{"io.kubernetes.cri.container-type":"sandbox"}}}"#;
        let e = image_and_runtime(pod).unwrap_err().to_string();
        assert!(e.contains("io.burrow.restore=NAME"), "{e}");
        assert!(image_and_runtime("not json").is_err());
        assert_eq!(copy_ids("src", 2), ["src-fork-1", "src-fork-2"]);
    }
}
