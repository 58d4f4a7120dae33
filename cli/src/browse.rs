//! `burrow browse|click|type|screenshot ID ...`: the sandbox's browser
//! (Chromium in the guest, for containers started with the annotation
//! `io.burrow.browser=true`) through its shim's control socket. `browse
//! --text` lists the page's visible interactive elements with indexes
//! (`[12] button "Submit"`) that `click` and `type` take.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use base64::Engine;
use burrow_vmm_api::sandbox_control::SandboxRequest;
use burrow_vmm_api::sandbox_tools::{
    BrowseOutput, BrowseRequest, ElementRequest, ScreenshotRequest, ToolReply,
};

use crate::tools::{Target, WAKE_ALLOWANCE};

/// How long a browser call may take: Chromium's first start in a slow
/// guest, and the page's load.
const BROWSER_ALLOWANCE: std::time::Duration = std::time::Duration::from_secs(900);

#[derive(clap::Args, Debug)]
pub struct BrowseArgs {
    #[command(flatten)]
    pub target: Target,
    /// Load this URL first (else: the page as it is).
    pub url: Option<String>,
    /// List the visible interactive elements with their indexes instead of
    /// the page's text.
    #[arg(long)]
    pub text: bool,
    /// Wait this long for the page to load.
    #[arg(long, default_value_t = 30)]
    pub timeout: u64,
}

#[derive(clap::Args, Debug)]
pub struct ClickArgs {
    #[command(flatten)]
    pub target: Target,
    /// The element's index in `burrow browse ID --text`.
    pub index: u32,
}

#[derive(clap::Args, Debug)]
pub struct TypeArgs {
    #[command(flatten)]
    pub target: Target,
    /// The element's index in `burrow browse ID --text`.
    pub index: u32,
    /// The text to type (inserted at the caret).
    pub text: String,
}

#[derive(clap::Args, Debug)]
pub struct ScreenshotArgs {
    #[command(flatten)]
    pub target: Target,
    /// Write the PNG here.
    #[arg(long)]
    pub out: PathBuf,
    /// Viewport width and height in CSS pixels (default: as it is).
    #[arg(long, default_value_t = 0)]
    pub width: u32,
    #[arg(long, default_value_t = 0)]
    pub height: u32,
}

/// The page a browser call left, or an error for another reply.
fn page(reply: ToolReply, verb: &str) -> Result<BrowseOutput> {
    match reply {
        ToolReply::Browse(out) => Ok(out),
        _ => bail!("the shim answered {verb} with another tool's result"),
    }
}

/// Print a page: its URL and title after a navigation, its text, and on
/// stderr whether it was cut.
fn print_page(out: &BrowseOutput) -> Result<()> {
    let mut o = std::io::stdout();
    if let Some(url) = &out.url {
        writeln!(o, "url: {url}")?;
    }
    if let Some(title) = &out.title {
        writeln!(o, "title: {title}")?;
    }
    o.write_all(out.text.as_bytes())?;
    if !out.text.ends_with('\n') && !out.text.is_empty() {
        writeln!(o)?;
    }
    o.flush()?;
    if out.truncated {
        eprintln!("[truncated: showing the first {} bytes]", out.text.len());
    }
    Ok(())
}

/// `burrow browse`.
pub fn browse(a: BrowseArgs) -> Result<i32> {
    let req = SandboxRequest::Browse(BrowseRequest {
        url: a.url,
        elements: a.text,
        timeout_secs: a.timeout,
    });
    let reply = a.target.ask(&req, BROWSER_ALLOWANCE + WAKE_ALLOWANCE)?;
    print_page(&page(reply, "browse")?)?;
    Ok(0)
}

/// `burrow click`.
pub fn click(a: ClickArgs) -> Result<i32> {
    let req = SandboxRequest::Click(ElementRequest {
        index: a.index,
        text: None,
    });
    let reply = a.target.ask(&req, BROWSER_ALLOWANCE + WAKE_ALLOWANCE)?;
    print_page(&page(reply, "click")?)?;
    Ok(0)
}

/// `burrow type`.
pub fn type_text(a: TypeArgs) -> Result<i32> {
    let req = SandboxRequest::Type(ElementRequest {
        index: a.index,
        text: Some(a.text),
    });
    let reply = a.target.ask(&req, BROWSER_ALLOWANCE + WAKE_ALLOWANCE)?;
    print_page(&page(reply, "type")?)?;
    Ok(0)
}

/// `burrow screenshot`.
pub fn screenshot(a: ScreenshotArgs) -> Result<i32> {
    let req = SandboxRequest::Screenshot(ScreenshotRequest {
        width: a.width,
        height: a.height,
    });
    let ToolReply::Screenshot(shot) = a.target.ask(&req, BROWSER_ALLOWANCE + WAKE_ALLOWANCE)?
    else {
        bail!("the shim answered screenshot with another tool's result");
    };
    let png = base64::engine::general_purpose::STANDARD
        .decode(shot.png_base64.as_bytes())
        .context("the screenshot is not base64")?;
    std::fs::write(&a.out, &png).with_context(|| format!("writing {}", a.out.display()))?;
    println!(
        "{}: {}x{} PNG, {} bytes",
        a.out.display(),
        shot.width,
        shot.height,
        png.len()
    );
    Ok(0)
}
