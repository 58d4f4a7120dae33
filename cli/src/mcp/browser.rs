//! The MCP browser tools: `browser_navigate`, `browser_snapshot` (the
//! visible interactive elements with indexes), `browser_click`,
//! `browser_type` (by index) and `browser_screenshot` (image content), on
//! the sandbox's Chromium. Page text and element lists are shown up to
//! [`INLINE_PAGE`] bytes; the rest is kept and paged with `read_output`.

use burrow_vmm_api::sandbox_control::SandboxRequest;
use burrow_vmm_api::sandbox_tools::{
    BrowseOutput, BrowseRequest, ElementRequest, ScreenshotRequest, ToolReply,
};
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, ContentBlock};
use rmcp::{tool, tool_router, ErrorData};
use schemars::JsonSchema;
use serde::Deserialize;

use super::redact::{redact, Redacted};
use super::{failed, output, shown, Burrow};

/// Bytes of page text or element list shown inline.
pub const INLINE_PAGE: usize = 4 * 1024;
/// How long a browser call may take (Chromium's first start in a slow
/// guest, and the page's load).
const BROWSER_ALLOWANCE: std::time::Duration = std::time::Duration::from_secs(900);

#[derive(Debug, Deserialize, JsonSchema)]
pub struct NavigateArgs {
    /// The sandbox (container id).
    pub sandbox: String,
    /// The URL to load (http, https, file, data or about).
    pub url: String,
    /// Wait this long for the page to load (default 30).
    #[serde(default)]
    pub timeout_secs: Option<u64>,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct SandboxArgs {
    /// The sandbox (container id).
    pub sandbox: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct ClickArgs {
    /// The sandbox (container id).
    pub sandbox: String,
    /// The element's index in browser_snapshot's list.
    pub index: u32,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct TypeArgs {
    /// The sandbox (container id).
    pub sandbox: String,
    /// The element's index in browser_snapshot's list.
    pub index: u32,
    /// The text to type at the element's caret.
    pub text: String,
}

#[derive(Debug, Deserialize, JsonSchema)]
pub struct ScreenshotArgs {
    /// The sandbox (container id).
    pub sandbox: String,
    /// Viewport width in CSS pixels (default: as it is, initially 1280).
    #[serde(default)]
    pub width: Option<u32>,
    /// Viewport height in CSS pixels (default: as it is, initially 800).
    #[serde(default)]
    pub height: Option<u32>,
}

impl Burrow {
    /// A page for the model: URL and title after a navigation, then its
    /// text (redacted) inline up to [`INLINE_PAGE`], the rest kept for
    /// read_output.
    fn show_page(&self, out: BrowseOutput) -> CallToolResult {
        let mut text = String::new();
        if let Some(url) = &out.url {
            text.push_str(&format!("url: {url}\n"));
        }
        if let Some(title) = &out.title {
            text.push_str(&format!("title: {title}\n"));
        }
        let page = redact(&out.text, false);
        let mut found = page.found.clone();
        found.extend(redact(&text, false).found);
        let reference = if page.text.len() > INLINE_PAGE {
            let mut store = self.store.lock().unwrap_or_else(|p| p.into_inner());
            store.keep(page.text.clone(), String::new())
        } else {
            String::new()
        };
        text = redact(&text, false).text;
        text.push_str(&output::inline(&page.text, INLINE_PAGE, "text", &reference));
        if out.truncated {
            text.push_str(&format!(
                "\n[the page has more than the {} bytes read]",
                page.text.len()
            ));
        }
        shown(Redacted { text, found })
    }

    /// Send browser request `req` to sandbox `id`.
    async fn browser(&self, id: &str, req: SandboxRequest) -> Result<ToolReply, String> {
        self.ask(id, req, BROWSER_ALLOWANCE).await
    }

    /// Run page request `req` and show the page it leaves.
    async fn page_call(&self, id: &str, req: SandboxRequest) -> Result<CallToolResult, ErrorData> {
        let name = req.name();
        Ok(match self.browser(id, req).await {
            Ok(ToolReply::Browse(out)) => self.show_page(out),
            Ok(_) => failed(format!(
                "the shim answered {name} with another tool's result"
            )),
            Err(e) => failed(e),
        })
    }
}

#[tool_router(router = browser_router, vis = "pub")]
impl Burrow {
    /// Load a URL in the sandbox's browser (a sandbox started with the annotation
    /// io.burrow.browser=true) and return its title and text (4 KiB inline, the rest by
    /// read_output).
    #[tool(annotations(
        read_only_hint = false,
        destructive_hint = false,
        open_world_hint = true
    ))]
    async fn browser_navigate(
        &self,
        Parameters(a): Parameters<NavigateArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        let req = SandboxRequest::Browse(BrowseRequest {
            url: Some(a.url),
            elements: false,
            timeout_secs: a.timeout_secs.unwrap_or(30),
        });
        self.page_call(&a.sandbox, req).await
    }

    /// List the visible interactive elements of the sandbox browser's page, one a line:
    /// `[12] button "Submit"`. The indexes stay the same for the page's life; browser_click
    /// and browser_type take them.
    #[tool(annotations(read_only_hint = true, open_world_hint = false))]
    async fn browser_snapshot(
        &self,
        Parameters(a): Parameters<SandboxArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        let req = SandboxRequest::Browse(BrowseRequest {
            url: None,
            elements: true,
            timeout_secs: 0,
        });
        self.page_call(&a.sandbox, req).await
    }

    /// Click the element with this index (from browser_snapshot); returns the page's text after.
    #[tool(annotations(
        read_only_hint = false,
        destructive_hint = true,
        open_world_hint = true
    ))]
    async fn browser_click(
        &self,
        Parameters(a): Parameters<ClickArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        let req = SandboxRequest::Click(ElementRequest {
            index: a.index,
            text: None,
        });
        self.page_call(&a.sandbox, req).await
    }

    /// Type text into the element with this index (from browser_snapshot); returns the
    /// page's text after.
    #[tool(annotations(
        read_only_hint = false,
        destructive_hint = false,
        open_world_hint = true
    ))]
    async fn browser_type(
        &self,
        Parameters(a): Parameters<TypeArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        let req = SandboxRequest::Type(ElementRequest {
            index: a.index,
            text: Some(a.text),
        });
        self.page_call(&a.sandbox, req).await
    }

    /// A PNG screenshot of the sandbox browser's page, as an image.
    #[tool(annotations(read_only_hint = true, open_world_hint = false))]
    async fn browser_screenshot(
        &self,
        Parameters(a): Parameters<ScreenshotArgs>,
    ) -> Result<CallToolResult, ErrorData> {
        let req = SandboxRequest::Screenshot(ScreenshotRequest {
            width: a.width.unwrap_or(0),
            height: a.height.unwrap_or(0),
        });
        Ok(match self.browser(&a.sandbox, req).await {
            Ok(ToolReply::Screenshot(shot)) => CallToolResult::success(vec![
                ContentBlock::image(shot.png_base64, "image/png"),
                ContentBlock::text(format!("{}x{} screenshot", shot.width, shot.height)),
            ]),
            Ok(_) => failed("the shim answered screenshot with another tool's result"),
            Err(e) => failed(e),
        })
    }
}
