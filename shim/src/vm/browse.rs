//! The sandbox's browser: the shim attaches `rootfs/browser-image` (the
//! config's `browser_image`, read-only, one file shared by every sandbox)
//! as the VM's second disk when the container asks (annotation
//! `io.burrow.browser=true`, or `browser = true` in the config), and the
//! guest agent runs Chromium from it. The control socket's `browse`,
//! `click`, `type` and `screenshot` drive it; elements are addressed by the
//! index the element list gave them.

use std::path::PathBuf;

use base64::Engine;
use burrow_vmm_api::sandbox_control::SandboxRequest;
use burrow_vmm_api::sandbox_tools::{
    BrowseOutput, BrowseRequest, ElementRequest, ScreenshotOutput, ScreenshotRequest, ToolReply,
    MAX_BROWSE_TEXT, MAX_URL,
};

use super::VmSandbox;
use crate::config::Config;
use crate::sandbox::{Result, SandboxError};
use crate::spec;

impl VmSandbox {
    /// The browser image to attach to this sandbox's VM, if its container
    /// (`spec`, the one the VM starts for, or one registered already) asks
    /// for one; an error if it asks and there is none.
    pub(super) fn browser_image(
        &self,
        cfg: &Config,
        spec: &serde_json::Value,
    ) -> Result<Option<PathBuf>> {
        let wants = spec::wants_browser(spec, cfg)
            || self
                .registry()
                .values()
                .any(|c| spec::wants_browser(&c.spec, cfg));
        if !wants {
            return Ok(None);
        }
        if !cfg.browser_image.exists() {
            return Err(SandboxError::FailedPrecondition(format!(
                "the container asks for a browser ({}) but the browser image {} does not exist \
                 (build rootfs/browser-image and set browser_image in the burrow config)",
                spec::ANNOTATION_BROWSER,
                cfg.browser_image.display()
            )));
        }
        Ok(Some(cfg.browser_image.clone()))
    }

    /// Whether this sandbox's VM has the browser image.
    fn has_browser(&self) -> bool {
        match &self.cfg {
            Ok(cfg) => self
                .registry()
                .values()
                .any(|c| spec::wants_browser(&c.spec, cfg)),
            Err(_) => false,
        }
    }

    /// Run browser request `req`.
    pub(super) async fn tool_browser(&self, req: SandboxRequest) -> Result<ToolReply> {
        if !self.has_browser() {
            return Err(SandboxError::FailedPrecondition(format!(
                "this sandbox has no browser: start its container with the annotation {}=true",
                spec::ANNOTATION_BROWSER
            )));
        }
        let agent = self.awake_agent().await?;
        match req {
            SandboxRequest::Browse(r) => self.browse(&agent, r).await.map(ToolReply::Browse),
            SandboxRequest::Click(r) => {
                agent.browser_click(&r.selector()).await?;
                page_text(&agent, false).await.map(ToolReply::Browse)
            }
            SandboxRequest::Type(ElementRequest { index, text }) => {
                let r = ElementRequest { index, text: None };
                let text = text.unwrap_or_default();
                agent.browser_type(&r.selector(), &text).await?;
                page_text(&agent, false).await.map(ToolReply::Browse)
            }
            SandboxRequest::Screenshot(ScreenshotRequest { width, height }) => {
                let (png, width, height) = agent.browser_screenshot(width, height).await?;
                Ok(ToolReply::Screenshot(ScreenshotOutput {
                    png_base64: base64::engine::general_purpose::STANDARD.encode(png),
                    width,
                    height,
                }))
            }
            other => Err(SandboxError::InvalidArgument(format!(
                "{} is not a browser request",
                other.name()
            ))),
        }
    }

    async fn browse(&self, agent: &super::agent::Agent, r: BrowseRequest) -> Result<BrowseOutput> {
        let mut nav = None;
        if let Some(url) = &r.url {
            if url.is_empty() || url.len() > MAX_URL {
                return Err(SandboxError::InvalidArgument(format!(
                    "a URL is 1 to {MAX_URL} bytes"
                )));
            }
            let ms = u32::try_from(r.timeout_secs.saturating_mul(1000)).unwrap_or(u32::MAX);
            nav = Some(agent.browser_navigate(url, ms).await?);
        }
        let mut out = page_text(agent, r.elements).await?;
        if let Some((url, title)) = nav {
            out.url = Some(super::tools::cut(url));
            out.title = Some(super::tools::cut(title));
        }
        Ok(out)
    }
}

/// The page's text or element list, bounded.
async fn page_text(agent: &super::agent::Agent, elements: bool) -> Result<BrowseOutput> {
    let (text, truncated) = agent.browser_text(MAX_BROWSE_TEXT, elements).await?;
    Ok(BrowseOutput {
        url: None,
        title: None,
        text,
        truncated,
    })
}
