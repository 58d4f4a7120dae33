//! The production [`Launcher`]: spawn burrow-vmm ([`super::vmm`]), wait for
//! the guest's agent, bring the guest's clock (and after a restore, its
//! entropy) up to date. Its [`VmProcess`] is the VMM's control API.

use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;

use super::agent::{Agent, AgentAddr};
use super::lifecycle::{Killer, Launched, Launcher, VmProcess};
use super::vmm::{self, Vmm, VmmLaunch};
use crate::sandbox::Result;

/// Starts burrow-vmm for the sandbox whose state directory is `dir`
/// (`vmm.pid`, `vmm.log`, `console.log` go there).
pub struct VmmLauncher {
    pub dir: PathBuf,
    pub boot_timeout: Duration,
    pub agent_timeout: Duration,
    /// Kills the burrow-vmm spawned last.
    pub last: std::sync::Mutex<Option<Killer>>,
}

impl VmmLauncher {
    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Wait for the agent; fails early when the VMM exits meanwhile.
    async fn connect(&self, vmm: &Vmm, what: &str) -> Result<Agent> {
        let mut exited = vmm.exited();
        let addr = AgentAddr::Vsock {
            path: self.path("vsock.sock"),
            port: burrow_protocol::AGENT_VSOCK_PORT,
        };
        tokio::select! {
            r = Agent::connect(&addr, self.agent_timeout, self.boot_timeout) => r,
            _ = exited.wait_for(Option::is_some) => {
                let console = vmm::tail_of(&self.path("console.log"), 1024);
                Err(vmm.exit_error(what, &format!("guest console: {console}")))
            }
        }
    }
}

#[async_trait]
impl Launcher for VmmLauncher {
    async fn launch(&self, args: &VmmLaunch) -> Result<Launched> {
        let restoring = args.args.restore.is_some();
        let what = if restoring {
            "restoring the checkpoint"
        } else {
            "booting"
        };
        let started = std::time::Instant::now();
        let mut vmm = Vmm::spawn(args, &self.path("vmm.log"))?;
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(vmm.killer());
        let spawned = started.elapsed();
        let _ = std::fs::write(self.path("vmm.pid"), vmm.pid.to_string());
        let ready = async {
            let agent = self.connect(&vmm, what).await?;
            // Where a start's time goes (issue 16): the rest is in the
            // sandbox's "created" line.
            tracing::info!(
                "{what}: burrow-vmm spawned in {} ms, its agent answered {} ms later",
                spawned.as_millis(),
                started.elapsed().saturating_sub(spawned).as_millis()
            );
            if restoring {
                // A restored guest continues with the clock and RNG state
                // of its snapshot.
                agent.set_time_now().await?;
                agent.add_entropy().await?;
            } else if let Err(e) = agent.set_time_now().await {
                tracing::warn!("setting the guest clock: {e}");
            }
            Ok(agent)
        };
        match ready.await {
            Ok(agent) => Ok(Launched {
                vm: Box::new(vmm),
                agent,
            }),
            Err(e) => {
                vmm.kill().await;
                self.stopped();
                Err(e)
            }
        }
    }

    fn stopped(&self) {
        let _ = std::fs::remove_file(self.path("vmm.pid"));
    }

    fn killer(&self) -> Option<Killer> {
        self.last.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

#[async_trait]
impl VmProcess for Vmm {
    fn pid(&self) -> u32 {
        self.pid
    }

    fn exited(&self) -> watch::Receiver<Option<String>> {
        Vmm::exited(self)
    }

    async fn pause(&self) -> Result<()> {
        Vmm::pause(self).await
    }

    async fn resume(&self) -> Result<()> {
        Vmm::resume(self).await
    }

    async fn snapshot(&self, dir: &Path, incremental: bool) -> Result<String> {
        let info = Vmm::snapshot(self, dir, incremental).await?;
        Ok(format!(
            "{} memory pages, {} bytes of state, VMM took {} ms",
            info.memory_pages, info.state_bytes, info.took_ms
        ))
    }

    async fn stop(&mut self) {
        if self.exit_reason().is_none() {
            if let Err(e) = Vmm::stop(self).await {
                tracing::debug!("stopping the VM through its API: {e}");
            }
            let mut rx = Vmm::exited(self);
            if tokio::time::timeout(Duration::from_secs(3), rx.wait_for(Option::is_some))
                .await
                .is_err()
            {
                tracing::warn!("burrow-vmm did not stop; killing it");
            }
        }
        Vmm::kill(self).await;
    }

    async fn kill(&mut self) {
        Vmm::kill(self).await;
    }
}
