//! containerd's CRI plugin, driven as the kubelet drives it: a
//! [`Containerd`] whose CRI plugin has a `burrow` runtime handler beside
//! `runc`, the test images imported into the `k8s.io` namespace, and a
//! blocking client for the CRI calls the tests make (the `k8s-cri` crate's
//! generated tonic client for CRI v1, which containerd 1.6 serves).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use hyper_util::rt::TokioIo;
use k8s_cri::v1 as cri;
use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::containerd::{Containerd, NESTED_CONFIG};

/// The busybox image CRI containers run (tests/images/busybox).
pub const BUSYBOX: &str = "docker.io/library/busybox:latest";
/// The pod sandbox image (tests/images/pause), containerd 1.6's default
/// `sandbox_image`, named in the config all the same.
pub const PAUSE: &str = "registry.k8s.io/pause:3.6";

/// A containerd with its CRI plugin and a client for it.
pub struct Cri {
    pub containerd: Containerd,
    rt: tokio::runtime::Runtime,
    channel: Channel,
    /// Pods run and not yet removed (removed on drop).
    pods: std::sync::Mutex<Vec<String>>,
}

/// A pod: its sandbox id and the config its containers are created with.
pub struct Pod {
    pub id: String,
    pub config: cri::PodSandboxConfig,
}

/// What ExecSync returned.
#[derive(Debug)]
pub struct Exec {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
}

/// How long a nested guest may take for one CRI call (RunPodSandbox boots
/// a VM under emulation).
const CALL: Duration = Duration::from_secs(600);

impl Cri {
    /// containerd for test `name` with the CRI plugin: runtime handlers
    /// `burrow` and `runc`, no CNI (the tests' pods use the node's
    /// network), the busybox and pause images in `k8s.io`.
    pub fn start(name: &str) -> Self {
        Self::start_with(name, "")
    }

    /// Like [`start`](Self::start), with `burrow_extra` lines appended to
    /// the burrow config.
    pub fn start_with(name: &str, burrow_extra: &str) -> Self {
        Self::start_on(name, burrow_extra, None)
    }

    /// Like [`start_with`](Self::start_with), with CRI's containers on
    /// `snapshotter`: its name and its plugin's containerd config (the
    /// images are unpacked for it too).
    pub fn start_on(name: &str, burrow_extra: &str, snapshotter: Option<(&str, String)>) -> Self {
        let pause = crate::asset_from_env("BURROW_PAUSE_IMAGE", "tests/images/pause");
        let busybox = crate::asset_from_env("BURROW_BUSYBOX_IMAGE", "tests/images/busybox");
        let cri_config = format!(
            r#"[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.burrow]
      runtime_type = "io.containerd.burrow.v2"
      pod_annotations = ["io.burrow.*"]
      container_annotations = ["io.burrow.*"]
"#
        );
        let mut cri_config = cri_config;
        let mut import = vec!["-n", "k8s.io", "images", "import"];
        if let Some((snapshotter, plugin)) = &snapshotter {
            cri_config = cri_config.replacen(
                "    default_runtime_name = \"runc\"\n",
                &format!("    default_runtime_name = \"runc\"\n    snapshotter = \"{snapshotter}\"\n"),
                1,
            );
            cri_config.push_str(plugin);
            import.extend(["--snapshotter", *snapshotter]);
        }
        let burrow = format!("{burrow_extra}\n{NESTED_CONFIG}");
        let containerd = Containerd::start_with(name, &burrow, &cri_config);
        for image in [&pause, &busybox] {
            let path = image.display().to_string();
            let mut args = import.clone();
            args.push(&path);
            let r = containerd.ctr(&args);
            assert_eq!(r.code, Some(0), "importing {path}: {r:?}");
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("tokio runtime");
        let socket = containerd.socket().to_path_buf();
        let connector = tower::service_fn(move |_: Uri| {
            let socket = socket.clone();
            async move {
                let s = tokio::net::UnixStream::connect(socket).await?;
                Ok::<_, std::io::Error>(TokioIo::new(s))
            }
        });
        let channel = rt
            .block_on(Endpoint::from_static("http://[::]:50051").connect_with_connector(connector))
            .expect("connecting to containerd's CRI socket");
        let cri = Self {
            containerd,
            rt,
            channel,
            pods: std::sync::Mutex::new(Vec::new()),
        };
        for image in [PAUSE, BUSYBOX] {
            cri.wait_for_image(image);
        }
        cri
    }

    /// Run one runtime-service call (bounded by [`CALL`]).
    pub fn call<T, F, Fut>(&self, f: F) -> Result<T, tonic::Status>
    where
        F: FnOnce(RuntimeServiceClient<Channel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let client = RuntimeServiceClient::new(self.channel.clone());
        self.rt.block_on(async {
            tokio::time::timeout(CALL, f(client))
                .await
                .unwrap_or_else(|_| Err(tonic::Status::deadline_exceeded("test's limit")))
                .map(tonic::Response::into_inner)
        })
    }

    /// The CRI plugin learns of imported images from containerd's events:
    /// wait until it knows `image`.
    fn wait_for_image(&self, image: &str) {
        let mut images = ImageServiceClient::new(self.channel.clone());
        let start = Instant::now();
        loop {
            let req = cri::ImageStatusRequest {
                image: Some(cri::ImageSpec {
                    image: image.into(),
                    ..Default::default()
                }),
                verbose: false,
            };
            let found = self
                .rt
                .block_on(images.image_status(req))
                .map(|r| r.into_inner().image.is_some());
            if matches!(found, Ok(true)) {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the CRI plugin does not see {image}: {found:?}\n{}",
                self.containerd.diagnostics()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// RunPodSandbox `name` with runtime handler `handler`, on the node's
    /// network, each container in a PID namespace of its own (as the
    /// kubelet asks for v1 pods).
    pub fn run_pod(&self, name: &str, handler: &str) -> Pod {
        self.run_pod_with(name, handler, false, &[])
    }

    /// [`Cri::run_pod`]; with `share_pids` one PID namespace for the whole
    /// pod (`shareProcessNamespace: true`), and the pod's `annotations`.
    pub fn run_pod_with(
        &self,
        name: &str,
        handler: &str,
        share_pids: bool,
        annotations: &[(&str, &str)],
    ) -> Pod {
        self.try_run_pod(name, handler, share_pids, annotations)
            .unwrap_or_else(|e| {
                panic!(
                    "RunPodSandbox {name} ({handler}): {e}\n{}",
                    self.containerd.diagnostics()
                )
            })
    }

    /// [`Cri::run_pod`] with the pod's summed container limits in
    /// `LinuxPodSandboxConfig.resources`, as the kubelet sends them.
    pub fn run_pod_sized(
        &self,
        name: &str,
        handler: &str,
        resources: cri::LinuxContainerResources,
    ) -> Pod {
        self.run_pod_config(name, handler, false, &[], Some(resources))
            .unwrap_or_else(|e| {
                panic!(
                    "RunPodSandbox {name} ({handler}): {e}\n{}",
                    self.containerd.diagnostics()
                )
            })
    }

    /// [`Cri::run_pod_with`], its error returned.
    pub fn try_run_pod(
        &self,
        name: &str,
        handler: &str,
        share_pids: bool,
        annotations: &[(&str, &str)],
    ) -> Result<Pod, tonic::Status> {
        self.run_pod_config(name, handler, share_pids, annotations, None)
    }

    fn run_pod_config(
        &self,
        name: &str,
        handler: &str,
        share_pids: bool,
        annotations: &[(&str, &str)],
        resources: Option<cri::LinuxContainerResources>,
    ) -> Result<Pod, tonic::Status> {
        let pid = if share_pids {
            cri::NamespaceMode::Pod
        } else {
            cri::NamespaceMode::Container
        };
        let logs: PathBuf = self.containerd.dir().join("pod-logs").join(name);
        std::fs::create_dir_all(&logs).expect("pod log directory");
        let config = cri::PodSandboxConfig {
            metadata: Some(cri::PodSandboxMetadata {
                name: name.into(),
                uid: format!("uid-{name}"),
                namespace: "default".into(),
                attempt: 0,
            }),
            // None: on the node's network the pod has the node's UTS
            // namespace, where runc refuses to set a hostname.
            log_directory: logs.display().to_string(),
            annotations: annotations
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            linux: Some(cri::LinuxPodSandboxConfig {
                security_context: Some(cri::LinuxSandboxSecurityContext {
                    namespace_options: Some(cri::NamespaceOption {
                        network: cri::NamespaceMode::Node as i32,
                        pid: pid as i32,
                        ipc: cri::NamespaceMode::Pod as i32,
                        ..Default::default()
                    }),
                    ..Default::default()
                }),
                resources,
                ..Default::default()
            }),
            ..Default::default()
        };
        let req = cri::RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: handler.into(),
        };
        let id = self
            .call(|mut c| async move { c.run_pod_sandbox(req).await })?
            .pod_sandbox_id;
        self.pods
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(id.clone());
        Ok(Pod { id, config })
    }

    /// CreateContainer `name` running `cmd` (busybox) in `pod`; not started.
    pub fn create_container(
        &self,
        pod: &Pod,
        name: &str,
        cmd: &[&str],
    ) -> Result<String, tonic::Status> {
        self.create_container_with(pod, name, cmd, None)
    }

    /// [`Cri::create_container`] with the container's resource limits.
    pub fn create_container_with(
        &self,
        pod: &Pod,
        name: &str,
        cmd: &[&str],
        resources: Option<cri::LinuxContainerResources>,
    ) -> Result<String, tonic::Status> {
        self.create(pod, name, 0, cmd, resources)
    }

    /// [`Cri::create_container`] as the kubelet's `attempt`-th restart.
    pub fn create_container_attempt(
        &self,
        pod: &Pod,
        name: &str,
        attempt: u32,
        cmd: &[&str],
    ) -> Result<String, tonic::Status> {
        self.create(pod, name, attempt, cmd, None)
    }

    /// [`Cri::create_container`] with its config changed by `edit` first
    /// (another image, a working directory...).
    pub fn create_container_edited(
        &self,
        pod: &Pod,
        name: &str,
        cmd: &[&str],
        edit: impl FnOnce(&mut cri::ContainerConfig),
    ) -> Result<String, tonic::Status> {
        let mut req = Self::create_request(pod, name, 0, cmd, None);
        if let Some(config) = req.config.as_mut() {
            edit(config);
        }
        self.call(|mut c| async move { c.create_container(req).await })
            .map(|r| r.container_id)
    }

    fn create(
        &self,
        pod: &Pod,
        name: &str,
        attempt: u32,
        cmd: &[&str],
        resources: Option<cri::LinuxContainerResources>,
    ) -> Result<String, tonic::Status> {
        let req = Self::create_request(pod, name, attempt, cmd, resources);
        self.call(|mut c| async move { c.create_container(req).await })
            .map(|r| r.container_id)
    }

    /// The CreateContainerRequest the kubelet sends for `cmd` (busybox).
    fn create_request(
        pod: &Pod,
        name: &str,
        attempt: u32,
        cmd: &[&str],
        resources: Option<cri::LinuxContainerResources>,
    ) -> cri::CreateContainerRequest {
        cri::CreateContainerRequest {
            pod_sandbox_id: pod.id.clone(),
            config: Some(cri::ContainerConfig {
                metadata: Some(cri::ContainerMetadata {
                    name: name.into(),
                    attempt,
                }),
                image: Some(cri::ImageSpec {
                    image: BUSYBOX.into(),
                    ..Default::default()
                }),
                command: cmd.iter().map(|s| s.to_string()).collect(),
                log_path: if attempt == 0 {
                    format!("{name}.log")
                } else {
                    format!("{name}.{attempt}.log")
                },
                // As the kubelet asks for a pod without shareProcessNamespace.
                linux: Some(cri::LinuxContainerConfig {
                    resources,
                    security_context: Some(cri::LinuxContainerSecurityContext {
                        namespace_options: pod
                            .config
                            .linux
                            .as_ref()
                            .and_then(|l| l.security_context.as_ref())
                            .and_then(|s| s.namespace_options.clone()),
                        ..Default::default()
                    }),
                }),
                ..Default::default()
            }),
            sandbox_config: Some(pod.config.clone()),
        }
    }

    /// StartContainer `id` (CRI creates the task here, not in
    /// CreateContainer).
    pub fn try_start_container(&self, id: &str) -> Result<(), tonic::Status> {
        let req = cri::StartContainerRequest {
            container_id: id.into(),
        };
        self.call(|mut c| async move { c.start_container(req).await })
            .map(drop)
    }

    /// StartContainer `id`, then wait until CRI reports it running.
    pub fn start_container(&self, id: &str) {
        self.try_start_container(id).unwrap_or_else(|e| {
            panic!(
                "StartContainer {id}: {e}\n{}",
                self.containerd.diagnostics()
            )
        });
        let start = Instant::now();
        loop {
            let req = cri::ContainerStatusRequest {
                container_id: id.into(),
                verbose: false,
            };
            let state = self
                .call(|mut c| async move { c.container_status(req).await })
                .ok()
                .and_then(|r| r.status)
                .map(|s| s.state);
            if state == Some(cri::ContainerState::ContainerRunning as i32) {
                return;
            }
            assert!(
                start.elapsed() < CALL,
                "container {id} is not running: state {state:?}\n{}",
                self.containerd.diagnostics()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// ExecSync `cmd` in container `id`.
    pub fn exec(&self, id: &str, cmd: &[&str]) -> Exec {
        self.try_exec(id, cmd, 300).unwrap_or_else(|e| {
            panic!(
                "ExecSync {cmd:?} in {id}: {e}\n{}",
                self.containerd.diagnostics()
            )
        })
    }

    /// ExecSync `cmd` in container `id` with the kubelet's `timeout` in
    /// seconds (an exec probe's `timeoutSeconds`); CRI's error as it is.
    pub fn try_exec(&self, id: &str, cmd: &[&str], timeout: i64) -> Result<Exec, tonic::Status> {
        let req = cri::ExecSyncRequest {
            container_id: id.into(),
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
            timeout,
        };
        let r = self.call(|mut c| async move { c.exec_sync(req).await })?;
        Ok(Exec {
            code: r.exit_code,
            stdout: String::from_utf8_lossy(&r.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&r.stderr).into_owned(),
        })
    }

    /// Exec `cmd` in `id` through containerd's streaming server with a
    /// terminal and stdin (as `kubectl exec -it`): the URL to stream from.
    pub fn exec_stream_url(&self, id: &str, cmd: &[&str]) -> String {
        let req = cri::ExecRequest {
            container_id: id.into(),
            cmd: cmd.iter().map(|s| s.to_string()).collect(),
            tty: true,
            stdin: true,
            stdout: true,
            stderr: false,
        };
        self.call(|mut c| async move { c.exec(req).await })
            .unwrap_or_else(|e| panic!("Exec {cmd:?} in {id}: {e}"))
            .url
    }

    /// Attach to container `id`'s stdin, stdout and stderr through
    /// containerd's streaming server, without a terminal (as `kubectl
    /// attach -i`): the URL to stream from.
    pub fn attach_url(&self, id: &str) -> String {
        let req = cri::AttachRequest {
            container_id: id.into(),
            stdin: true,
            tty: false,
            stdout: true,
            stderr: true,
        };
        self.call(|mut c| async move { c.attach(req).await })
            .unwrap_or_else(|e| panic!("Attach to {id}: {e}"))
            .url
    }

    /// StopContainer `id`, SIGKILL after `timeout` seconds.
    pub fn stop_container(&self, id: &str, timeout: i64) {
        let req = cri::StopContainerRequest {
            container_id: id.into(),
            timeout,
        };
        self.call(|mut c| async move { c.stop_container(req).await })
            .unwrap_or_else(|e| {
                panic!("StopContainer {id}: {e}\n{}", self.containerd.diagnostics())
            });
    }

    /// ContainerStatus of `id`: its state and exit code.
    pub fn container_status(&self, id: &str) -> (cri::ContainerState, i32) {
        let req = cri::ContainerStatusRequest {
            container_id: id.into(),
            verbose: false,
        };
        let st = self
            .call(|mut c| async move { c.container_status(req).await })
            .unwrap_or_else(|e| panic!("ContainerStatus {id}: {e}"))
            .status
            .unwrap_or_else(|| panic!("ContainerStatus {id}: no status"));
        (st.state(), st.exit_code)
    }

    /// RemoveContainer `id`.
    pub fn remove_container(&self, id: &str) {
        let req = cri::RemoveContainerRequest {
            container_id: id.into(),
        };
        self.call(|mut c| async move { c.remove_container(req).await })
            .unwrap_or_else(|e| {
                panic!(
                    "RemoveContainer {id}: {e}\n{}",
                    self.containerd.diagnostics()
                )
            });
    }

    /// ContainerStats of `id`.
    pub fn stats(&self, id: &str) -> cri::ContainerStats {
        let req = cri::ContainerStatsRequest {
            container_id: id.into(),
        };
        self.call(|mut c| async move { c.container_stats(req).await })
            .unwrap_or_else(|e| panic!("ContainerStats {id}: {e}"))
            .stats
            .unwrap_or_else(|| panic!("ContainerStats {id}: no stats"))
    }

    /// UpdateContainerResources of `id` to `linux`.
    pub fn update_resources(&self, id: &str, linux: cri::LinuxContainerResources) {
        let req = cri::UpdateContainerResourcesRequest {
            container_id: id.into(),
            linux: Some(linux),
            ..Default::default()
        };
        self.call(|mut c| async move { c.update_container_resources(req).await })
            .unwrap_or_else(|e| {
                panic!(
                    "UpdateContainerResources {id}: {e}\n{}",
                    self.containerd.diagnostics()
                )
            });
    }

    /// StopPodSandbox and RemovePodSandbox (its containers go with it).
    pub fn remove_pod(&self, id: &str) {
        let stop = cri::StopPodSandboxRequest {
            pod_sandbox_id: id.into(),
        };
        self.call(|mut c| async move { c.stop_pod_sandbox(stop).await })
            .unwrap_or_else(|e| {
                panic!(
                    "StopPodSandbox {id}: {e}\n{}",
                    self.containerd.diagnostics()
                )
            });
        let remove = cri::RemovePodSandboxRequest {
            pod_sandbox_id: id.into(),
        };
        self.call(|mut c| async move { c.remove_pod_sandbox(remove).await })
            .unwrap_or_else(|e| {
                panic!(
                    "RemovePodSandbox {id}: {e}\n{}",
                    self.containerd.diagnostics()
                )
            });
        self.pods
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|p| p != id);
    }
}

impl Drop for Cri {
    fn drop(&mut self) {
        // A failed test's pods: stop and remove them so their shims end
        // their VMs before containerd goes.
        let pods = std::mem::take(&mut *self.pods.lock().unwrap_or_else(|p| p.into_inner()));
        for id in pods {
            for _ in 0..2 {
                let stop = cri::StopPodSandboxRequest {
                    pod_sandbox_id: id.clone(),
                };
                let _ = self.call(|mut c| async move { c.stop_pod_sandbox(stop).await });
                let remove = cri::RemovePodSandboxRequest {
                    pod_sandbox_id: id.clone(),
                };
                if self
                    .call(|mut c| async move { c.remove_pod_sandbox(remove).await })
                    .is_ok()
                {
                    break;
                }
            }
        }
    }
}
