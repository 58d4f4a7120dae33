//! Kubernetes pods through containerd's CRI plugin, as the kubelet makes
//! them (RunPodSandbox, CreateContainer, StartContainer, ExecSync,
//! StopPodSandbox, RemovePodSandbox), with runtime handler `burrow` and,
//! as the control that shows a test passing for the wrong reason, `runc`.
//! Run inside hack/testhost (or on a host with hardware KVM).

#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use burrow_tests::containerd::{walk, CLEAN};
use burrow_tests::cri::{Cri, Pod};

/// Two containers in one pod, each writing a file only it should see.
fn pod_of_two(cri: &Cri, handler: &str) -> (Pod, Vec<String>) {
    let pod = cri.run_pod(&format!("pod-{handler}"), handler);
    let mut ids = Vec::new();
    for name in ["one", "two"] {
        let script = format!("echo {name} > /only-{name}; exec sleep 2147483647");
        let id = cri
            .create_container(&pod, name, &["sh", "-c", &script])
            .unwrap_or_else(|e| {
                panic!(
                    "CreateContainer {name}: {e}\n{}",
                    cri.containerd.diagnostics()
                )
            });
        cri.start_container(&id);
        ids.push(id);
    }
    (pod, ids)
}

fn boot_id(cri: &Cri, id: &str) -> String {
    let e = cri.exec(id, &["cat", "/proc/sys/kernel/random/boot_id"]);
    assert_eq!(e.code, 0, "{e:?}");
    let b = e.stdout.trim().to_string();
    assert_eq!(b.len(), 36, "a boot id: {e:?}");
    b
}

/// Each container sees its own file and not the other's.
fn files_are_private(cri: &Cri, ids: &[String]) {
    let names = ["one", "two"];
    for (i, id) in ids.iter().enumerate() {
        let own = format!("/only-{}", names[i]);
        let start = Instant::now();
        loop {
            let e = cri.exec(id, &["cat", &own]);
            if e.code == 0 {
                assert_eq!(e.stdout.trim(), names[i], "{e:?}");
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "{own} never appeared: {e:?}"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        let other = format!("/only-{}", names[1 - i]);
        let e = cri.exec(id, &["cat", &other]);
        assert_ne!(e.code, 0, "container {} sees {other}: {e:?}", names[i]);
        assert!(e.stderr.contains("No such file"), "{e:?}");
    }
}

/// As CRI asks: the pod's IPC namespace is common to its containers; mount
/// and PID namespaces are each one's own. (On the node's network the UTS
/// namespace is the node's: the guest's under burrow.)
fn namespaces_are_the_pods(cri: &Cri, ids: &[String]) {
    let ns = |id: &str, kind: &str| {
        let e = cri.exec(id, &["readlink", &format!("/proc/self/ns/{kind}")]);
        assert_eq!(e.code, 0, "{e:?}");
        assert!(e.stdout.starts_with(&format!("{kind}:[")), "{e:?}");
        e.stdout.trim().to_string()
    };
    assert_eq!(
        ns(&ids[0], "ipc"),
        ns(&ids[1], "ipc"),
        "one IPC namespace for the pod"
    );
    for kind in ["mnt", "pid"] {
        assert_ne!(
            ns(&ids[0], kind),
            ns(&ids[1], kind),
            "a {kind} namespace per container"
        );
    }
}

fn host_boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .unwrap()
        .trim()
        .to_string()
}

/// burrow-vmm pid files under the state directory of CRI's namespace.
fn vmm_pids(cri: &Cri) -> Vec<std::path::PathBuf> {
    let dir = cri.containerd.burrow_state().join("k8s.io");
    walk(&dir)
        .into_iter()
        .filter(|p| p.ends_with("vmm.pid"))
        .collect()
}

#[test]
fn burrow_pod_runs_its_containers_in_one_vm() {
    // Two slots: the third container has none.
    let cri = Cri::start_with("cri-burrow", "pod_disk_slots = 2");
    let (pod, ids) = pod_of_two(&cri, "burrow");
    // Under the test's state_dir, CRI's namespace and 64-character ids make
    // the sockets' paths longer than a unix socket address holds.
    let sock = cri
        .containerd
        .burrow_state()
        .join("k8s.io")
        .join(&pod.id)
        .join("vsock.sock");
    assert!(sock.as_os_str().len() > 107, "{}", sock.display());
    assert!(sock.exists(), "{}", sock.display());

    let (a, b) = (boot_id(&cri, &ids[0]), boot_id(&cri, &ids[1]));
    assert_eq!(a, b, "both containers run on one guest kernel");
    assert_ne!(a, host_boot_id(), "that kernel is not the test host's");
    let pids = vmm_pids(&cri);
    assert_eq!(pids.len(), 1, "one VM for the pod: {pids:?}");
    assert!(pids[0].starts_with(cri.containerd.burrow_state().join("k8s.io").join(&pod.id)));
    files_are_private(&cri, &ids);
    namespaces_are_the_pods(&cri, &ids);

    // A third container: no slot left, a clear error when its task is
    // made (StartContainer), the others untouched.
    let three = cri
        .create_container(&pod, "three", &["sleep", "1000"])
        .unwrap();
    let e = cri
        .try_start_container(&three)
        .expect_err("a container beyond the pod's slots");
    assert!(e.message().contains("block slots"), "{e:?}");
    assert_eq!(boot_id(&cri, &ids[1]), a);
    assert_eq!(vmm_pids(&cri).len(), 1);

    cri.remove_pod(&pod.id);
    cri.containerd.assert_clean(CLEAN);
    assert!(!Path::new(&sock).exists());
}

#[test]
fn runc_pod_runs_its_containers_on_the_host_kernel() {
    let cri = Cri::start("cri-runc");
    let (pod, ids) = pod_of_two(&cri, "runc");
    let (a, b) = (boot_id(&cri, &ids[0]), boot_id(&cri, &ids[1]));
    assert_eq!(a, b);
    assert_eq!(a, host_boot_id(), "runc containers share the host's kernel");
    assert!(vmm_pids(&cri).is_empty(), "runc starts no VM");
    files_are_private(&cri, &ids);
    namespaces_are_the_pods(&cri, &ids);
    cri.remove_pod(&pod.id);
    cri.containerd.assert_clean(CLEAN);
}
