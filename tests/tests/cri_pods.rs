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
use burrow_tests::devmapper::ThinPool;
use k8s_cri::v1 as cri;

/// Two containers in one pod, each writing a file only it should see.
fn pod_of_two(cri: &Cri, handler: &str) -> (Pod, Vec<String>) {
    let pod = cri.run_pod(&format!("pod-{handler}"), handler);
    let mut ids = Vec::new();
    for name in ["one", "two"] {
        let script =
            format!("echo {name} > /only-{name}; echo hello from {name}; exec sleep 2147483647");
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

/// Allocated bytes of `path`.
fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    path.metadata().unwrap_or_else(|e| panic!("{}: {e}", path.display())).blocks() * 512
}

/// A pod's containers of one image (`ids`, busybox) share its layer cache
/// image: linked into the pod's image directory, not copied, one for all of
/// them; each container's root is an overlay whose writes go to its own
/// disk (8 MiB written in one grow that disk, not the shared one).
fn layers_are_shared(cri: &Cri, pod: &str, ids: &[String]) {
    use std::os::unix::fs::MetadataExt;
    let dir = cri.containerd.image_dir().join("k8s.io").join(pod);
    let files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .flatten()
        .map(|e| e.path())
        .collect();
    let layers: Vec<_> = files
        .iter()
        .filter(|f| f.file_name().is_some_and(|n| n.to_string_lossy().starts_with("+layer-")))
        .collect();
    assert_eq!(layers.len(), 1, "one shared image layer for both containers: {files:?}");
    let layer = layers[0];
    let md = layer.metadata().unwrap();
    let cache = walk(cri.containerd.layer_cache_dir());
    let linked = cache.iter().filter(|f| {
        f.metadata()
            .is_ok_and(|m| (m.dev(), m.ino()) == (md.dev(), md.ino()))
    });
    assert_eq!(
        linked.count(),
        1,
        "the shared layer is the layer cache's image, linked: {} (cache: {cache:?})",
        layer.display()
    );
    let own = dir.join(format!("{}.rootfs.img", ids[0]));
    let (layer_before, own_before) = (allocated(layer), allocated(&own));
    let e = cri.exec(
        &ids[0],
        &["sh", "-c", "dd if=/dev/zero of=/big bs=1M count=8 2>/dev/null && sync && grep ' / ' /proc/mounts"],
    );
    assert_eq!(e.code, 0, "{e:?}");
    assert!(e.stdout.starts_with("overlay / overlay rw"), "the root is a writable overlay: {e:?}");
    let (layer_after, own_after) = (allocated(layer), allocated(&own));
    assert_eq!(layer_after, layer_before, "the shared layer is not written");
    assert_eq!(layer.metadata().unwrap().len(), md.len());
    assert!(
        own_after >= own_before + (8 << 20),
        "the write went to the container's own disk: {own_before} -> {own_after} bytes"
    );
    let e = cri.exec(&ids[1], &["ls", "/big"]);
    assert_ne!(e.code, 0, "the other container does not see it: {e:?}");
    let e = cri.exec(&ids[0], &["rm", "/big"]);
    assert_eq!(e.code, 0, "{e:?}");
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

/// What each container printed is in its CRI log at `log_path`, in the
/// CRI log format (`<time> stdout F <line>`).
fn logs_reach_log_path(cri: &Cri, pod: &str) {
    for name in ["one", "two"] {
        wait_for_log_line(cri, pod, name, &format!(" stdout F hello from {name}"));
    }
}

/// Container `name`'s CRI log file in pod `pod`.
fn log_file(cri: &Cri, pod: &str, name: &str) -> std::path::PathBuf {
    cri.containerd
        .dir()
        .join("pod-logs")
        .join(pod)
        .join(format!("{name}.log"))
}

/// Wait up to a minute for a line of container `name`'s log that ends
/// with `want`.
fn wait_for_log_line(cri: &Cri, pod: &str, name: &str, want: &str) {
    let path = log_file(cri, pod, name);
    let start = Instant::now();
    loop {
        let log = std::fs::read_to_string(&path).unwrap_or_default();
        if log.lines().any(|l| l.ends_with(want)) {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{} lacks {want:?}: {log:?}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// As the kubelet restarts a container that died: stop and remove it,
/// create it again (attempt 1) in the same pod, start it.
fn restart(cri: &Cri, pod: &Pod, id: &str, name: &str) -> String {
    cri.stop_container(id, 0);
    cri.remove_container(id);
    let script = format!("echo {name} again > /only-{name}; exec sleep 2147483647");
    let new = cri
        .create_container_attempt(pod, name, 1, &["sh", "-c", &script])
        .unwrap_or_else(|e| panic!("CreateContainer {name} attempt 1: {e}"));
    cri.start_container(&new);
    new
}

/// `burrow sandbox ARGS` for CRI's namespace; its stdout.
fn burrow_sandbox(cri: &Cri, args: &[&str]) -> String {
    let state = cri.containerd.burrow_state().display().to_string();
    let mut all = vec!["sandbox", "--state-dir", &state, "-n", "k8s.io"];
    all.extend_from_slice(args);
    let r = cri.containerd.burrow(&all);
    assert_eq!(r.code, Some(0), "burrow {all:?}: {r:?}");
    r.stdout
}

/// `burrow exec` addresses a pod's container by its container id (the
/// pod's shim serves it); the pod's id, with two containers, is refused
/// with both ids, never run in the pause container.
fn tools_by_container_and_pod_id(cri: &Cri, pod: &str, ids: &[String]) {
    let state = cri.containerd.burrow_state().display().to_string();
    let exec = |id: &str, cmd: &[&str]| {
        let mut all = vec!["exec", "--state-dir", &state, "-n", "k8s.io", id, "--"];
        all.extend_from_slice(cmd);
        cri.containerd.burrow(&all)
    };
    for (id, name) in ids.iter().zip(["one", "two"]) {
        let r = exec(id, &["cat", &format!("/only-{name}")]);
        assert_eq!((r.code, r.stdout.trim()), (Some(0), name), "{r:?}");
    }
    let r = exec(pod, &["true"]);
    assert_eq!(r.code, Some(125), "{r:?}");
    assert!(
        r.stderr.contains("runs 2 containers")
            && r.stderr.contains(&ids[0])
            && r.stderr.contains(&ids[1]),
        "{r:?}"
    );
}

/// What `burrow sandbox ls` says of pod `id`: running or asleep.
fn pod_state(cri: &Cri, id: &str) -> String {
    burrow_sandbox(cri, &["ls"])
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(1) == Some(&id)).then(|| f.get(2).map(|s| s.to_string()).unwrap_or_default())
        })
        .unwrap_or_default()
}

/// A WebSocket to containerd's streaming server at `url` with Kubernetes'
/// channel protocol (v4.channel.k8s.io: each binary message starts with
/// its channel, 0 stdin, 1 stdout, 2 stderr, 3 status), reads bounded.
fn stream_socket(url: &str) -> Stream {
    use tungstenite::client::IntoClientRequest;
    let ws = url.replacen("http://", "ws://", 1);
    let mut req = ws.as_str().into_client_request().unwrap();
    req.headers_mut().insert(
        "Sec-WebSocket-Protocol",
        "v4.channel.k8s.io".parse().unwrap(),
    );
    let (sock, _) = tungstenite::connect(req).unwrap_or_else(|e| panic!("{url}: {e}"));
    if let tungstenite::stream::MaybeTlsStream::Plain(s) = sock.get_ref() {
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    }
    sock
}

type Stream = tungstenite::WebSocket<tungstenite::stream::MaybeTlsStream<std::net::TcpStream>>;

/// Send `text` on the stream's stdin channel.
fn send_stdin(sock: &mut Stream, text: &str) {
    let msg = [&[0u8][..], text.as_bytes()].concat();
    sock.send(tungstenite::Message::Binary(msg.into())).unwrap();
}

/// Read the stream's stdout and status channels until it ends, or until
/// `enough` says stdout holds what is wanted.
fn read_stream(sock: &mut Stream, enough: impl Fn(&str) -> bool) -> (String, String) {
    use tungstenite::Message;
    let (mut out, mut status) = (String::new(), String::new());
    while !enough(&out) {
        match sock.read() {
            Ok(Message::Binary(b)) => match b.split_first() {
                Some((1, data)) => out.push_str(&String::from_utf8_lossy(data)),
                Some((3, data)) => status.push_str(&String::from_utf8_lossy(data)),
                _ => {}
            },
            Ok(Message::Close(_)) | Err(_) => break,
            Ok(_) => {}
        }
    }
    (out, status)
}

/// `kubectl exec -it`'s path: CRI Exec with a terminal, streamed over a
/// WebSocket.
fn exec_with_a_terminal(cri: &Cri, id: &str) {
    let url = cri.exec_stream_url(id, &["sh"]);
    let mut sock = stream_socket(&url);
    send_stdin(&mut sock, "echo $((6*7)); tty; exit 3\n");
    let (out, status) = read_stream(&mut sock, |_| false);
    let lines: Vec<&str> = out.lines().map(str::trim).collect();
    assert!(lines.contains(&"42"), "no 42 on the terminal: {out:?}");
    assert!(
        lines.iter().any(|l| l.starts_with("/dev/pts/")),
        "not a terminal: {out:?}"
    );
    // The exit status comes back as a Status naming the code.
    assert!(
        status.contains("NonZeroExitCode") && status.contains("\"message\":\"3\""),
        "status channel: {status:?}"
    );
}

/// `kubectl attach -i`'s path: a container made with stdin open answers
/// what is written to it through CRI Attach, twice over two attaches (the
/// first one's end does not close its stdin), and its answers are in its
/// log too.
fn attach_to_stdin(cri: &Cri, pod: &Pod, pod_name: &str, handler: &str) {
    let id = cri
        .create_container_edited(
            pod,
            "echo",
            &["sh", "-c", "while read l; do echo \"got $l\"; done; echo stdin closed"],
            |c| {
                c.stdin = true;
                c.stdin_once = false;
            },
        )
        .unwrap();
    cri.start_container(&id);
    for word in ["first", "second"] {
        let want = format!("got {word}-{handler}");
        let mut sock = stream_socket(&cri.attach_url(&id));
        send_stdin(&mut sock, &format!("{word}-{handler}\n"));
        let (out, status) = read_stream(&mut sock, |o| o.lines().any(|l| l == want));
        assert!(
            out.lines().any(|l| l == want),
            "{handler}: attached stdout lacks {want:?}: {out:?} (status {status:?})"
        );
        let _ = sock.close(None);
        wait_for_log_line(cri, pod_name, "echo", &format!(" stdout F {want}"));
    }
    let log = std::fs::read_to_string(log_file(cri, pod_name, "echo")).unwrap_or_default();
    assert!(
        !log.contains("stdin closed"),
        "{handler}: the first attach's end closed the container's stdin: {log:?}"
    );
    let (state, _) = cri.container_status(&id);
    assert_eq!(state, cri::ContainerState::ContainerRunning, "{handler}");
}

/// An ExecSync given a timeout (an exec probe's `timeoutSeconds`) that its
/// command outlives: a CRI error that says the timeout passed, no sooner,
/// and the command is killed, not left running in the container.
fn exec_sync_times_out(cri: &Cri, id: &str, handler: &str) {
    const TIMEOUT: i64 = 2;
    let asked = Instant::now();
    let e = cri
        .try_exec(id, &["sh", "-c", "echo $$ > /probe.pid; exec sleep 600"], TIMEOUT)
        .expect_err("a command that outlives its ExecSync timeout");
    let took = asked.elapsed();
    assert!(
        e.message().contains("timeout") && e.message().contains("exceeded"),
        "{handler}: {e:?}"
    );
    assert!(
        took >= Duration::from_secs(TIMEOUT as u64) - Duration::from_millis(200)
            && took < Duration::from_secs(120),
        "{handler}: the {TIMEOUT} s ExecSync ended after {took:?}"
    );
    let pid = cri.exec(id, &["cat", "/probe.pid"]);
    assert_eq!(pid.code, 0, "{handler}: the command never ran: {pid:?}");
    let pid = pid.stdout.trim().to_string();
    assert!(pid.parse::<u32>().is_ok(), "{handler}: {pid:?}");
    let start = Instant::now();
    loop {
        let alive = cri.exec(id, &["kill", "-0", &pid]);
        if alive.code != 0 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "{handler}: the timed-out command (pid {pid}) still runs"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    // The container goes on: a later ExecSync answers.
    let e = cri.try_exec(id, &["echo", "after"], TIMEOUT).unwrap();
    assert_eq!((e.code, e.stdout.trim()), (0, "after"), "{handler}");
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
    layers_are_shared(&cri, &pod.id, &ids);
    tools_by_container_and_pod_id(&cri, &pod.id, &ids);
    namespaces_are_the_pods(&cri, &ids);
    logs_reach_log_path(&cri, "pod-burrow");
    exec_with_a_terminal(&cri, &ids[0]);

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

    // Restarted in the same pod: the slot it had is free again, and it
    // runs in the same VM.
    let two = restart(&cri, &pod, &ids[1], "two");
    assert_eq!(boot_id(&cri, &two), a, "the restarted container's VM");
    let e = cri.exec(&two, &["cat", "/only-two"]);
    assert_eq!(e.stdout.trim(), "two again", "{e:?}");
    assert_eq!(vmm_pids(&cri).len(), 1);

    // The whole pod sleeps (its VM snapshotted and stopped) and wakes
    // together on the next call: the same guest boot, both containers.
    let h = burrow_sandbox(&cri, &["hibernate", &pod.id]);
    assert!(h.contains("asleep"), "{h}");
    assert_eq!(pod_state(&cri, &pod.id), "asleep");
    assert_eq!(boot_id(&cri, &ids[0]), a, "woken, not rebooted");
    assert_eq!(pod_state(&cri, &pod.id), "running");
    let e = cri.exec(&two, &["cat", "/only-two"]);
    assert_eq!(e.stdout.trim(), "two again", "{e:?}");

    // `burrow sandbox fork` of a pod is refused at once, writing nothing: a
    // pod is copied whole, through CRI.
    let state = cri.containerd.burrow_state().display().to_string();
    let address = cri.containerd.socket().display().to_string();
    let r = cri.containerd.burrow(&[
        "sandbox", "--state-dir", &state, "-n", "k8s.io", "fork", &pod.id, "2", "--address", &address,
    ]);
    assert_ne!(r.code, Some(0), "{r:?}");
    assert!(r.stderr.contains("io.burrow.restore=NAME"), "{r:?}");
    let checkpoints = cri.containerd.snapshot_dir().join(".checkpoints");
    assert!(walk(&checkpoints).is_empty(), "{:?}", walk(&checkpoints));

    // The whole pod checkpointed by name (its VM and every container's
    // disk) while it runs on.
    let named = checkpoint_pod(&cri, &pod.id, "cp1");
    assert_eq!(pod_state(&cri, &pod.id), "running");
    assert_eq!(boot_id(&cri, &ids[0]), a);

    // A container that has exited is removed (the kubelet's garbage
    // collection) while the pod sleeps: the pod wakes to take its disk out
    // and sleeps no more; the other container carries on in the same VM.
    cri.stop_container(&two, 0);
    let h = burrow_sandbox(&cri, &["hibernate", &pod.id]);
    assert!(h.contains("asleep"), "{h}");
    cri.remove_container(&two);
    assert_eq!(boot_id(&cri, &ids[0]), a, "woken, not rebooted");
    let e = cri.exec(&ids[0], &["cat", "/only-one"]);
    assert_eq!(e.stdout.trim(), "one", "{e:?}");

    cri.remove_pod(&pod.id);
    cri.containerd.assert_clean(CLEAN);
    assert!(!Path::new(&sock).exists());

    restored_pod_continues(&cri, "cp1", &a);
    std::fs::remove_dir_all(&named).unwrap();
    cri.containerd.assert_clean(CLEAN);
}

/// `burrow sandbox checkpoint POD NAME` of a pod whose containers are
/// `one` and `two`: the manifest names both, each disk beside it by its
/// slot. Returns the checkpoint's directory.
fn checkpoint_pod(cri: &Cri, pod: &str, name: &str) -> std::path::PathBuf {
    let out = burrow_sandbox(cri, &["checkpoint", pod, name]);
    let named = cri.containerd.snapshot_dir().join(".checkpoints").join(name);
    assert!(out.contains(&named.display().to_string()), "{out}");
    let m: serde_json::Value =
        serde_json::from_slice(&std::fs::read(named.join("burrow.json")).unwrap()).unwrap();
    let members = m["pod"]["members"].as_array().unwrap_or_else(|| panic!("no pod members: {m}"));
    let mut names: Vec<&str> = members.iter().filter_map(|x| x["name"].as_str()).collect();
    names.sort_unstable();
    assert_eq!(names, ["one", "two"], "{m}");
    for x in members {
        let disk = named.join(format!("slot-{}.img", x["slot"]));
        assert!(disk.metadata().unwrap().len() > 0, "{}", disk.display());
    }
    // Both on one shared image layer, whose disk is there once.
    let lower = &members[0]["lower_slot"];
    assert!(lower.is_u64() && *lower == members[1]["lower_slot"], "{m}");
    assert!(named.join(format!("slot-{lower}.img")).metadata().unwrap().len() > 0);
    assert!(named.join("rootfs.img").exists());
    named
}

/// A pod started from the pod checkpoint `name` (the pod annotation
/// io.burrow.restore) of the pod `checkpoint_pod` saw: its VM is that
/// guest, not a new boot (`boot`), and the kubelet's containers of the same
/// names continue the checkpointed ones, their processes and disks, not
/// the commands they are given now. A checkpoint that is not there is a
/// clear RunPodSandbox error.
fn restored_pod_continues(cri: &Cri, name: &str, boot: &str) {
    let Err(e) =
        cri.try_run_pod("pod-nowhere", "burrow", false, &[("io.burrow.restore", "nowhere")])
    else {
        panic!("a pod restored from a checkpoint that is not there started");
    };
    assert!(e.message().contains("not a usable burrow checkpoint"), "{e:?}");
    cri.containerd.assert_clean(CLEAN);

    let pod = cri.run_pod_with("pod-restored", "burrow", false, &[("io.burrow.restore", name)]);
    let mut ids = Vec::new();
    for c in ["one", "two"] {
        let script = format!("echo new > /only-{c}; exec sleep 1000");
        let id = cri
            .create_container(&pod, c, &["sh", "-c", &script])
            .unwrap_or_else(|e| panic!("CreateContainer {c}: {e}\n{}", cri.containerd.diagnostics()));
        cri.start_container(&id);
        ids.push(id);
    }
    for id in &ids {
        assert_eq!(boot_id(cri, id), boot, "the checkpointed guest, not a new boot");
        let e = cri.exec(id, &["cat", "/proc/1/cmdline"]);
        assert!(e.stdout.contains("2147483647"), "the checkpointed init runs on: {e:?}");
    }
    let e = cri.exec(&ids[0], &["cat", "/only-one"]);
    assert_eq!(e.stdout.trim(), "one", "{e:?}");
    let e = cri.exec(&ids[1], &["cat", "/only-two"]);
    assert_eq!(e.stdout.trim(), "two again", "{e:?}");
    let e = cri.exec(&ids[1], &["cat", "/only-one"]);
    assert_ne!(e.code, 0, "each container still sees only its own disk: {e:?}");
    let pids = vmm_pids(cri);
    assert_eq!(pids.len(), 1, "one VM for the restored pod: {pids:?}");
    cri.remove_pod(&pod.id);
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
    logs_reach_log_path(&cri, "pod-runc");
    exec_with_a_terminal(&cri, &ids[0]);
    let two = restart(&cri, &pod, &ids[1], "two");
    assert_eq!(boot_id(&cri, &two), a);
    cri.remove_pod(&pod.id);
    cri.containerd.assert_clean(CLEAN);
}

const MIB: i64 = 1 << 20;

fn memory_limit(bytes: i64) -> cri::LinuxContainerResources {
    cri::LinuxContainerResources {
        memory_limit_in_bytes: bytes,
        ..Default::default()
    }
}

/// What ContainerStats says `id` has in memory.
fn working_set(cri: &Cri, id: &str) -> u64 {
    cri.stats(id)
        .memory
        .and_then(|m| m.working_set_bytes)
        .map(|v| v.value)
        .unwrap_or_else(|| panic!("no working set for {id}"))
}

/// What a container's processes hold, its /tmp and its cgroup's memory,
/// as seen from inside (for a failure's message).
const SEEN_FROM_INSIDE: &str = "for p in /proc/[0-9]*; do \
     echo \"$p $(tr '\\0' ' ' < $p/cmdline) $(grep VmRSS $p/status)\"; done; \
     ls -la /tmp; cat /sys/fs/cgroup/memory.current /sys/fs/cgroup/memory.stat | head -12";

/// One 48 MiB buffer, filled (dd is the only process holding it, so it is
/// the one the OOM killer picks).
const ALLOC_48M: [&str; 5] = ["dd", "if=/dev/zero", "of=/dev/null", "bs=48M", "count=1"];

/// Each container of a pod has its own memory limit, usage and OOM kills:
/// a container's limit holds however much memory the pod has, its OOM
/// kill leaves its siblings alone, the limit can be raised while it runs,
/// and ContainerStats counts each container's own memory. The pod shares
/// one PID namespace (`shareProcessNamespace`): each container sees the
/// others' processes. Under burrow the pod's annotation sizes its VM, a
/// container whose limit does not fit it grows the VM's memory (virtio-mem)
/// to the pod's sum of limits, and one past the configured maximum is
/// refused, the others untouched; then a pod sized only by its containers'
/// limits, as the kubelet sends them.
fn limits_are_each_containers_own(cri: &Cri, handler: &str) {
    let pod = cri.run_pod_with(
        &format!("limits-{handler}"),
        handler,
        true,
        &[("io.burrow.memory_mib", "384")],
    );
    let forever = ["sleep", "2147483647"];
    let tight = cri
        .create_container_with(&pod, "tight", &forever, Some(memory_limit(32 * MIB)))
        .unwrap();
    cri.start_container(&tight);
    // Its own init holds 16 MB once told to (an exec's background child
    // may go with the exec under runc). The sleep must not be the script's
    // last command: busybox sh execs that one, and the 16 MB go with it.
    let hold = "while [ ! -e /tmp/go ]; do sleep 1; done; x=$(yes | head -c 16000000); \
                sleep 2147483647; echo ${#x}";
    let free = cri
        .create_container(&pod, "free", &["sh", "-c", hold])
        .unwrap();
    cri.start_container(&free);

    // pause, tight and free each run `sleep 2147483647`: one PID namespace.
    let e = cri.exec(&tight, &["ps"]);
    assert_eq!(e.code, 0, "{e:?}");
    let sleeps = e
        .stdout
        .lines()
        .filter(|l| l.contains("sleep 2147483647"))
        .count();
    // (free's shell's command line has it too)
    assert!(
        sleeps >= 3,
        "{handler}: the pod's processes from tight: {e:?}"
    );

    // 16 MB held by a shell in `free`: its working set grows, tight's not.
    let (free0, tight0) = (working_set(cri, &free), working_set(cri, &tight));
    let e = cri.exec(&free, &["touch", "/tmp/go"]);
    assert_eq!(e.code, 0, "{e:?}");
    let start = Instant::now();
    loop {
        let grown = working_set(cri, &free).saturating_sub(free0);
        if grown > 12_000_000 {
            break;
        }
        if start.elapsed() > Duration::from_secs(120) {
            let seen = cri.exec(&free, &["sh", "-c", SEEN_FROM_INSIDE]);
            panic!(
                "{handler}: free's working set grew only {grown} bytes (from {free0}); \
                 inside: {seen:?}"
            );
        }
        std::thread::sleep(Duration::from_secs(1));
    }
    let tight1 = working_set(cri, &tight);
    assert!(
        tight1 < tight0 + 8_000_000,
        "{handler}: tight's working set went {tight0} -> {tight1} with free's memory"
    );

    // Past its 32 MiB: the OOM killer, in tight only.
    let e = cri.exec(&tight, &ALLOC_48M);
    assert_eq!(
        e.code,
        128 + 9,
        "{handler}: 48 MiB in a container limited to 32 MiB was not OOM-killed: {e:?}"
    );
    for id in [&tight, &free] {
        let e = cri.exec(id, &["echo", "alive"]);
        assert_eq!((e.code, e.stdout.trim()), (0, "alive"), "{handler}: {e:?}");
    }
    // Raised while running: the same allocation fits.
    cri.update_resources(&tight, memory_limit(256 * MIB));
    let e = cri.exec(&tight, &ALLOC_48M);
    assert_eq!(e.code, 0, "{handler}: 48 MiB under a 256 MiB limit: {e:?}");

    // 512 MiB: more than the 384 MiB pod VM holds, so burrow's grows.
    let big = cri
        .create_container_with(&pod, "big", &forever, Some(memory_limit(512 * MIB)))
        .unwrap();
    let started = cri.try_start_container(&big);
    let total_kib = memtotal_reaching(cri, &free, (256 + 448) * 1024);
    // Past memory_mib.max (16 GiB by default): no VM here may have that.
    let huge = cri
        .create_container_with(&pod, "huge", &forever, Some(memory_limit(20 << 30)))
        .unwrap();
    let huge_started = cri.try_start_container(&huge);
    if handler == "burrow" {
        started.unwrap_or_else(|e| {
            panic!(
                "a 512 MiB container in a 384 MiB pod VM that grows: {e:?}\n{}",
                cri.containerd.diagnostics()
            )
        });
        // 256 (tight, raised) + 512 MiB of limits and the guest's 64: the
        // VM grew from 384 to 832 MiB, all of the 448 MiB added to MemTotal.
        assert!(
            ((256 + 448) * 1024..=(384 + 448) * 1024).contains(&total_kib),
            "the pod's VM was to grow from 384 to 832 MiB: MemTotal {total_kib} kB"
        );
        let e = cri.exec(&big, &ALLOC_48M);
        assert_eq!(e.code, 0, "48 MiB in the grown VM's new container: {e:?}");
        let e = huge_started.expect_err("a container past memory_mib.max");
        assert!(e.message().contains("memory_mib.max"), "{e:?}");
    } else {
        huge_started.unwrap_or_else(|e| panic!("runc: {e:?}"));
        started.unwrap_or_else(|e| panic!("runc: {e:?}"));
        assert!(
            total_kib > 1024 * 1024,
            "runc shares the host's memory: MemTotal {total_kib} kB"
        );
    }
    for id in [&tight, &free] {
        assert_eq!(cri.exec(id, &["true"]).code, 0, "{handler}");
    }
    cri.remove_pod(&pod.id);

    sized_by_its_containers_limits(cri, handler);
    grows_with_its_containers(cri, handler);
    cri.containerd.assert_clean(CLEAN);
}

/// The CPUs `id` sees online (`/sys/devices/system/cpu/online`, e.g.
/// `0-2`), counted.
fn cpus_online(cri: &Cri, id: &str) -> u32 {
    let e = cri.exec(id, &["cat", "/sys/devices/system/cpu/online"]);
    assert_eq!(e.code, 0, "{e:?}");
    let mut n = 0;
    for part in e.stdout.trim().split(',') {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let (a, b): (u32, u32) = (a.parse().unwrap(), b.parse().unwrap());
        n += b - a + 1;
    }
    n
}

/// A pod started without pod-level resources (as an older kubelet, or a
/// CRI client that sends none, starts one) gets the default VM, and each
/// container's CPU and memory limits are added to it as the container
/// arrives, then UpdateContainerResources' larger CPU limit: the guest
/// brings the new vCPUs online and plugs the memory, and every container
/// of the pod sees them. runc, the control, shows the host's throughout.
fn grows_with_its_containers(cri: &Cri, handler: &str) {
    let pod = cri.run_pod(&format!("grows-{handler}"), handler);
    let first = cri.create_container(&pod, "first", &["sleep", "2147483647"]).unwrap();
    cri.start_container(&first);
    let at_start = cpus_online(cri, &first);
    let (memory_at_start, _) = machine_seen(cri, &first);
    let cpu = |quota: i64| cri::LinuxContainerResources {
        cpu_period: 100_000,
        cpu_quota: quota,
        ..Default::default()
    };
    let second = cri
        .create_container_with(
            &pod,
            "second",
            &["sleep", "2147483647"],
            Some(cri::LinuxContainerResources {
                memory_limit_in_bytes: 128 * MIB,
                ..cpu(150_000)
            }),
        )
        .unwrap();
    cri.start_container(&second);
    let after_second = (cpus_online(cri, &first), cpus_online(cri, &second));
    let memory_after = if handler == "burrow" {
        memtotal_reaching(cri, &first, memory_at_start + 120 * 1024)
    } else {
        machine_seen(cri, &first).0
    };
    cri.update_resources(&first, cpu(100_000));
    let after_update = cpus_online(cri, &second);
    if handler == "burrow" {
        assert_eq!(at_start, 1, "the default VM has one vCPU online");
        assert_eq!(
            after_second,
            (3, 3),
            "1 vCPU + 1.5 CPUs of the second container's limit, rounded up"
        );
        assert_eq!(after_update, 4, "1 + 1.5 + 1 CPUs after the update");
        assert!(
            (120 * 1024..=130 * 1024).contains(&(memory_after.saturating_sub(memory_at_start))),
            "the second container's 128 MiB added to the VM's MemTotal: {memory_at_start} -> {memory_after} kB"
        );
        let (_, seen) = machine_seen(cri, &second);
        assert_eq!(seen, 4, "/proc/cpuinfo lists the onlined vCPUs");
    } else {
        assert!(at_start >= 1);
        assert_eq!(after_second, (at_start, at_start), "runc: the host's CPUs");
        assert_eq!(after_update, at_start, "runc: the host's CPUs");
        let drift = memory_after.abs_diff(memory_at_start);
        assert!(drift < 64 * 1024, "runc: the host's memory, {memory_at_start} -> {memory_after} kB");
    }
    for id in [&first, &second] {
        assert_eq!(cri.exec(id, &["true"]).code, 0, "{handler}");
    }
    if handler == "burrow" {
        let named = grown_pod_restored_grows_on(cri, &pod.id, memory_after);
        std::fs::remove_dir_all(&named).unwrap();
    } else {
        cri.remove_pod(&pod.id);
    }
}

/// Pod `pod` of `grows_with_its_containers` (4 vCPUs online, `memory_kib`
/// MemTotal) checkpointed by name and removed, then restored as a new
/// pod: its containers taken over by name find the grown VM, and a third
/// container's limits are added to what the first two still ask for (a
/// restore that forgot them would not grow for it); once the third is
/// removed, the VM shrinks back. Returns the checkpoint's directory.
fn grown_pod_restored_grows_on(cri: &Cri, pod: &str, memory_kib: u64) -> std::path::PathBuf {
    let out = burrow_sandbox(cri, &["checkpoint", pod, "grown"]);
    let named = cri.containerd.snapshot_dir().join(".checkpoints").join("grown");
    assert!(out.contains(&named.display().to_string()), "{out}");
    cri.remove_pod(pod);
    let pod = cri.run_pod_with("grows-restored", "burrow", false, &[("io.burrow.restore", "grown")]);
    let mut ids = Vec::new();
    for c in ["first", "second"] {
        let id = cri
            .create_container(&pod, c, &["sleep", "2147483647"])
            .unwrap_or_else(|e| panic!("CreateContainer {c}: {e}\n{}", cri.containerd.diagnostics()));
        cri.start_container(&id);
        ids.push(id);
    }
    assert_eq!(cpus_online(cri, &ids[0]), 4, "the restored VM as it had grown");
    let (total, _) = machine_seen(cri, &ids[1]);
    assert!(total >= memory_kib, "the restored VM's memory as it had grown: {memory_kib} -> {total} kB");
    let third = cri
        .create_container_with(
            &pod,
            "third",
            &["sleep", "2147483647"],
            Some(cri::LinuxContainerResources {
                memory_limit_in_bytes: 64 * MIB,
                cpu_period: 100_000,
                cpu_quota: 100_000,
                ..Default::default()
            }),
        )
        .unwrap();
    cri.start_container(&third);
    assert_eq!(
        (cpus_online(cri, &third), cpus_online(cri, &ids[0])),
        (5, 5),
        "1 + 1 + 1.5 CPUs of the restored containers + 1 of the third, rounded up"
    );
    let grown = memtotal_reaching(cri, &third, total + 60 * 1024);
    assert!(
        (60 * 1024..=66 * 1024).contains(&grown.saturating_sub(total)),
        "the third container's 64 MiB added to the restored VM: {total} -> {grown} kB"
    );
    assert_eq!(vmm_pids(cri).len(), 1, "one VM for the restored pod");

    // The third leaves: the VM gives back the vCPU and the memory only it
    // needed (the guest unplugs what it can free, in its own time).
    cri.stop_container(&third, 0);
    cri.remove_container(&third);
    let cpus = wait_for(Duration::from_secs(60), || cpus_online(cri, &ids[0]), |n| *n == 4);
    assert_eq!(cpus, 4, "the third container's vCPU given back");
    let back = wait_for(Duration::from_secs(60), || machine_seen(cri, &ids[0]).0, |kib| {
        *kib <= total + 2 * 1024
    });
    assert!(
        back <= total + 2 * 1024,
        "the third container's 64 MiB given back: {total} -> {grown} -> {back} kB"
    );
    for id in &ids {
        assert_eq!(cri.exec(id, &["true"]).code, 0, "a member after the VM shrank");
    }
    cri.remove_pod(&pod.id);
    named
}

/// `probe()` once `done` holds of it, or what it is after `limit`.
fn wait_for<T>(limit: Duration, probe: impl Fn() -> T, done: impl Fn(&T) -> bool) -> T {
    let start = Instant::now();
    loop {
        let v = probe();
        if done(&v) || start.elapsed() > limit {
            return v;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// What `id` sees of its machine: MemTotal (kB) and its processors.
fn machine_seen(cri: &Cri, id: &str) -> (u64, usize) {
    let e = cri.exec(id, &["cat", "/proc/meminfo", "/proc/cpuinfo"]);
    assert_eq!(e.code, 0, "{e:?}");
    let total_kib = e
        .stdout
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or_else(|| panic!("no MemTotal: {e:?}"));
    let cpus = e.stdout.lines().filter(|l| l.starts_with("processor")).count();
    (total_kib, cpus)
}

/// `id`'s MemTotal (kB) once it is at least `kib`, or what it is after
/// 30 s: the guest onlines memory it plugged a moment after the plug.
fn memtotal_reaching(cri: &Cri, id: &str, kib: u64) -> u64 {
    wait_for(Duration::from_secs(30), || machine_seen(cri, id).0, |total| *total >= kib)
}

/// A pod whose containers declare limits and no burrow annotation: the
/// kubelet sends their sum in `LinuxPodSandboxConfig.resources`, and
/// burrow sizes the pod's VM from it (containerd passes it on as the
/// `io.kubernetes.cri.sandbox-*` annotations), so a container larger than
/// the default VM (512 MiB) starts in it. runc shares the host's machine.
fn sized_by_its_containers_limits(cri: &Cri, handler: &str) {
    let limits = |memory: i64| cri::LinuxContainerResources {
        memory_limit_in_bytes: memory,
        cpu_period: 100_000,
        cpu_quota: 150_000,
        ..Default::default()
    };
    let pod = cri.run_pod_sized(&format!("sized-{handler}"), handler, limits(640 * MIB));
    let big = cri
        .create_container_with(&pod, "big", &["sleep", "2147483647"], Some(limits(600 * MIB)))
        .unwrap();
    cri.try_start_container(&big).unwrap_or_else(|e| {
        panic!(
            "{handler}: a 600 MiB container in a pod whose containers sum to 640 MiB: {e:?}\n{}",
            cri.containerd.diagnostics()
        )
    });
    let (total_kib, cpus) = machine_seen(cri, &big);
    if handler == "burrow" {
        // 640 MiB for the containers + the guest's 64: more than a default
        // VM's MemTotal could be, at most the VM's size.
        assert!(
            (576 * 1024..=704 * 1024).contains(&total_kib),
            "the pod's VM was to have 640 + 64 MiB: MemTotal {total_kib} kB"
        );
        assert_eq!(cpus, 2, "1.5 CPUs of limits round up to 2 vCPUs");
    } else {
        assert!(
            total_kib > 1024 * 1024,
            "runc shares the host's memory: MemTotal {total_kib} kB"
        );
    }
    cri.remove_pod(&pod.id);
}

#[test]
fn burrow_pod_containers_have_their_own_limits_and_stats() {
    let cri = Cri::start_with("cri-burrow-limits", "pod_disk_slots = 3");
    limits_are_each_containers_own(&cri, "burrow");
}

#[test]
fn runc_pod_containers_have_their_own_limits_and_stats() {
    let cri = Cri::start("cri-runc-limits");
    limits_are_each_containers_own(&cri, "runc");
}

/// A pod on containerd's devmapper snapshotter, as a node set up for it
/// runs one: each container's root filesystem is a thin device of the
/// pool, which burrow hands its VM as is (the sandbox's as the boot disk,
/// the others through block slots) without building an image; the
/// containers see their image and their own writes, and removing the pod
/// leaves no container's device active. runc, the control, mounts the
/// same devices on the host.
fn pod_on_devmapper(handler: &str) {
    let pool = ThinPool::create(&format!("cri-dm-{handler}-{}", std::process::id()));
    let cri = Cri::start_on(
        &format!("cri-dm-{handler}"),
        "pod_disk_slots = 2",
        Some(("devmapper", pool.containerd_config())),
    );
    let before = pool.thin_devices().len();
    let (pod, ids) = pod_of_two(&cri, handler);
    files_are_private(&cri, &ids);
    for id in &ids {
        let e = cri.exec(id, &["sh", "-c", "ls /bin/busybox; grep ' / ' /proc/mounts"]);
        assert_eq!(e.code, 0, "{e:?}");
        assert!(
            e.stdout.starts_with("/bin/busybox\n") && e.stdout.contains(" / ext4 rw"),
            "{handler}: the root is the snapshot's ext4, writable, with the image in it: {e:?}"
        );
    }
    let active = pool.thin_devices().len();
    assert!(
        active >= before + 3,
        "{handler}: the pause and both containers on thin devices ({before} before, {active} now)"
    );
    if handler == "burrow" {
        let images: Vec<_> = walk(cri.containerd.image_dir())
            .into_iter()
            .chain(walk(&cri.containerd.burrow_state()))
            .filter(|f| f.display().to_string().ends_with(".rootfs.img"))
            .collect();
        assert!(images.is_empty(), "no rootfs image is built: {images:?}");
        let pids = vmm_pids(&cri);
        assert_eq!(pids.len(), 1, "one VM for the pod: {pids:?}");
        let pid: i32 = std::fs::read_to_string(&pids[0]).unwrap().trim().parse().unwrap();
        // The pause container's device and both members': as `--disk` and
        // through slots on a cold boot, all through slots from a template.
        let held = pool.held_by(pid);
        assert_eq!(
            held.len(),
            3,
            "the pod's VM holds the pause container's and both members' thin devices: {held:?}"
        );
    }
    cri.remove_pod(&pod.id);
    cri.containerd.assert_clean(CLEAN);
    let start = Instant::now();
    while pool.thin_devices().len() > before {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{handler}: the containers' thin devices outlived the pod: {:?}",
            pool.thin_devices()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    drop(cri);
    drop(pool);
}

#[test]
fn burrow_pod_on_devmapper_passes_its_thin_devices_through() {
    pod_on_devmapper("burrow");
}

#[test]
fn runc_pod_on_devmapper_mounts_the_same_devices() {
    pod_on_devmapper("runc");
}

/// SIGKILL `victim` (a command name) of `cri`'s burrow processes as soon as
/// one runs, while RunPodSandbox is under way; that call's answer.
fn kill_mid_create(cri: &Cri, name: &str, victim: &str) -> Result<Pod, tonic::Status> {
    std::thread::scope(|s| {
        let create = s.spawn(|| cri.try_run_pod(name, "burrow", false, &[]));
        let start = Instant::now();
        let pid = loop {
            let found = cri
                .containerd
                .burrow_processes()
                .into_iter()
                .find(|(_, cmdline)| cmdline.contains(victim));
            if let Some((pid, _)) = found {
                break pid;
            }
            assert!(
                start.elapsed() < Duration::from_secs(300) && !create.is_finished(),
                "no {victim} ever ran for {name}"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        // SAFETY: kill(2) on a pid just read from /proc.
        assert_eq!(
            unsafe { libc::kill(pid, libc::SIGKILL) },
            0,
            "kill {victim}"
        );
        create.join().unwrap()
    })
}

/// A pod whose VMM, or whose shim, is SIGKILLed while RunPodSandbox boots
/// its VM: a clear error, and nothing left (no process, state file or
/// mount); the node then runs pods as before.
#[test]
fn a_pod_killed_mid_create_leaves_nothing_behind() {
    let cri = Cri::start_with("cri-killed", "pod_disk_slots = 1");
    for victim in ["burrow-vmm", "containerd-shim-burrow-v2"] {
        let name = format!("killed-{}", &victim[..6]);
        match kill_mid_create(&cri, &name, victim) {
            Err(e) => assert!(!e.message().is_empty(), "{victim}: {e:?}"),
            Ok(pod) => panic!(
                "RunPodSandbox succeeded with its {victim} killed: {}\n{}",
                pod.id,
                cri.containerd.diagnostics()
            ),
        }
        cri.containerd.assert_clean(CLEAN);
        let left = cri.containerd.burrow_processes();
        assert!(left.is_empty(), "{victim} killed: {left:?}");
    }
    let pod = cri.run_pod("after-kills", "burrow");
    let id = cri.create_container(&pod, "c", &["sleep", "1000"]).unwrap();
    cri.start_container(&id);
    assert_ne!(boot_id(&cri, &id), host_boot_id());
    cri.remove_pod(&pod.id);
    cri.containerd.assert_clean(CLEAN);
}

/// GET `url` from inside container `id` (busybox wget, bounded by
/// `timeout`: its own -T crashes), retried while the server starts.
fn fetch_from(cri: &Cri, id: &str, url: &str) -> String {
    let start = Instant::now();
    loop {
        let e = cri.exec(id, &["timeout", "20", "wget", "-q", "-O", "-", url]);
        if e.code == 0 {
            return e.stdout;
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "{url} from {id}: {e:?}"
        );
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Three containers of one pod: a server on localhost in one is reached
/// by the other two (the pod has one network, under burrow the guest's,
/// which the node's own loopback is not). Then bad input, each a clear
/// CRI error that leaves the three running: an image that is not there, a
/// relative working directory, a program the image lacks. And
/// StopContainer's grace period, for a container that exits on SIGTERM
/// and one that ignores it. An ExecSync that outlives its timeout, and
/// Attach to a container's stdin.
fn three_containers_and_bad_input(cri: &Cri, handler: &str, port: u16) {
    let pod_name = format!("three-{handler}");
    let pod = cri.run_pod(&pod_name, handler);
    let serve = format!(
        "mkdir -p /www && echo served by web > /www/index.html && \
         exec httpd -f -p 127.0.0.1:{port} -h /www"
    );
    let web = cri
        .create_container(&pod, "web", &["sh", "-c", &serve])
        .unwrap();
    cri.start_container(&web);
    let mut ids = vec![web];
    for name in ["c1", "c2"] {
        let id = cri
            .create_container(&pod, name, &["sleep", "2147483647"])
            .unwrap();
        cri.start_container(&id);
        ids.push(id);
    }
    let url = format!("http://127.0.0.1:{port}/index.html");
    for id in &ids[1..] {
        assert_eq!(
            fetch_from(cri, id, &url).trim(),
            "served by web",
            "{handler}"
        );
    }
    let boot = boot_id(cri, &ids[0]);
    for id in &ids[1..] {
        assert_eq!(boot_id(cri, id), boot, "{handler}: one kernel for the pod");
    }
    // The node's loopback: the pod's under runc (node network), not under
    // burrow (the pod's localhost is the guest's).
    let from_node = std::net::TcpStream::connect(("127.0.0.1", port));
    if handler == "burrow" {
        assert_ne!(boot, host_boot_id());
        assert_eq!(vmm_pids(cri).len(), 1, "one VM for the three");
        assert!(
            from_node.is_err(),
            "the guest's localhost server is reachable on the node's loopback"
        );
    } else {
        assert!(from_node.is_ok(), "runc: {from_node:?}");
    }

    let absent = "burrow.test/absent:1";
    let e = cri
        .create_container_edited(&pod, "absent", &["true"], |c| {
            c.image = Some(cri::ImageSpec {
                image: absent.into(),
                ..Default::default()
            })
        })
        .expect_err("an image that is not present");
    assert!(e.message().contains(absent), "{handler}: {e:?}");
    let create_and_start = |name: &str, cmd: &[&str], cwd: &str| {
        cri.create_container_edited(&pod, name, cmd, |c| c.working_dir = cwd.into())
            .and_then(|id| cri.try_start_container(&id))
    };
    let e = create_and_start("relative", &["true"], "relative/dir")
        .expect_err("a relative working directory");
    assert!(
        e.message().to_lowercase().contains("absolute"),
        "{handler}: {e:?}"
    );
    let e = create_and_start("missing", &["/no/such/program"], "/")
        .expect_err("a program the image lacks");
    assert!(e.message().contains("/no/such/program"), "{handler}: {e:?}");
    assert!(
        e.message().to_lowercase().contains("no such file"),
        "{handler}: {e:?}"
    );

    // StopContainer's grace period, as the kubelet uses it: a container
    // that exits on SIGTERM ends with its own status, one that ignores it
    // is killed (137) once the timeout has passed, never before; the
    // others run on.
    const GRACE: i64 = 3;
    let stop = |name: &str, script: &str| {
        let id = cri.create_container(&pod, name, &["sh", "-c", script]).unwrap();
        cri.start_container(&id);
        // The shell has set its trap once it has written the file.
        let e = cri.exec(&id, &["sh", "-c", "while ! test -e /trapped; do sleep 0.1; done"]);
        assert_eq!(e.code, 0, "{handler} {name}: {e:?}");
        let asked = Instant::now();
        cri.stop_container(&id, GRACE);
        let (state, code) = cri.container_status(&id);
        assert_eq!(state, cri::ContainerState::ContainerExited, "{handler} {name}");
        (code, asked.elapsed())
    };
    let (code, _) = stop(
        "polite",
        "trap 'exit 7' TERM; touch /trapped; while true; do sleep 1; done",
    );
    assert_eq!(code, 7, "{handler}: the container's own exit on SIGTERM");
    let (code, took) = stop(
        "stubborn",
        "trap '' TERM; touch /trapped; while true; do sleep 1; done",
    );
    assert_eq!(code, 137, "{handler}: SIGKILL after the grace period");
    assert!(
        took >= Duration::from_secs(GRACE as u64) - Duration::from_millis(500),
        "{handler}: killed after {took:?}, before the {GRACE} s grace period"
    );

    exec_sync_times_out(cri, &ids[1], handler);
    attach_to_stdin(cri, &pod, &pod_name, handler);

    // The three are untouched.
    for id in &ids[1..] {
        assert_eq!(
            fetch_from(cri, id, &url).trim(),
            "served by web",
            "{handler}"
        );
    }
    assert_eq!(boot_id(cri, &ids[2]), boot);
    cri.remove_pod(&pod.id);
    cri.containerd.assert_clean(CLEAN);
}

#[test]
fn burrow_pod_of_three_shares_localhost_and_refuses_bad_input() {
    let cri = Cri::start_with("cri-burrow-three", "pod_disk_slots = 8");
    three_containers_and_bad_input(&cri, "burrow", 47101);
}

#[test]
fn runc_pod_of_three_shares_localhost_and_refuses_bad_input() {
    let cri = Cri::start("cri-runc-three");
    three_containers_and_bad_input(&cri, "runc", 47102);
}
