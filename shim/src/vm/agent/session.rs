//! The agent's detached-session calls (`StartSession`, `ReadSession`).

use std::time::Duration;

use burrow_protocol::agent as pb;

use super::Agent;
use crate::sandbox::{Result, SandboxError};

/// How much longer than its own wait a `ReadSession` may take to answer.
const READ_ALLOWANCE: Duration = Duration::from_secs(30);

impl Agent {
    /// Start `process` (OCI process JSON) in guest container `id` as a
    /// detached session; its id and pid.
    pub async fn start_session(
        &self,
        id: &str,
        process: &[u8],
        timeout_secs: u64,
    ) -> Result<(String, u32)> {
        let req = pb::StartSessionRequest {
            container_id: id.into(),
            oci_process: process.to_vec(),
            timeout_secs,
            ..Default::default()
        };
        let r = self
            .call("StartSession", self.client.start_session(Self::ctx(), &req))
            .await?;
        if r.session_id.len() > burrow_protocol::MAX_ID_LEN {
            return Err(SandboxError::Internal(
                "the agent answered an overlong session id".into(),
            ));
        }
        Ok((r.session_id, r.pid))
    }

    /// Session `session`'s output from `offset` (at most `max` bytes),
    /// waiting up to `wait` for some.
    pub async fn read_session(
        &self,
        session: &str,
        offset: u64,
        max: usize,
        wait: Duration,
    ) -> Result<pb::ReadSessionResponse> {
        let wait_ms = u32::try_from(wait.as_millis())
            .unwrap_or(u32::MAX)
            .min(burrow_protocol::MAX_SESSION_WAIT_MS);
        let req = pb::ReadSessionRequest {
            session_id: session.into(),
            offset,
            max_bytes: u32::try_from(max.min(burrow_protocol::MAX_CHUNK)).unwrap_or(0),
            wait_ms,
            ..Default::default()
        };
        let limit = Duration::from_millis(u64::from(wait_ms)) + READ_ALLOWANCE;
        let r = tokio::time::timeout(
            limit,
            self.call_unbounded("ReadSession", self.client.read_session(Self::ctx(), &req)),
        )
        .await
        .map_err(|_| {
            SandboxError::Timeout(format!(
                "the guest agent did not answer ReadSession within {}s",
                limit.as_secs()
            ))
        })??;
        if r.data.len() > max.min(burrow_protocol::MAX_CHUNK) {
            return Err(SandboxError::Internal(format!(
                "the agent sent {} bytes of session output, more than asked",
                r.data.len()
            )));
        }
        Ok(r)
    }
}
