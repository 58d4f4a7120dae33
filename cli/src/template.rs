//! `burrow template build|ls`: warm templates made ahead of the first
//! container that needs one, and what is in the cache
//! (`burrow_shim::vm::template_build`).

use anyhow::{Context, Result};
use burrow_shim::config::Config;
use burrow_shim::vm::template_build;

#[derive(clap::Args)]
pub struct BuildArgs {
    /// vCPUs (default: the config's `vcpus.default`, what a container
    /// without a CPU limit gets).
    #[arg(long)]
    vcpus: Option<u32>,
    /// Guest memory in MiB (default: the config's `memory_mib.default`).
    #[arg(long)]
    memory_mib: Option<u64>,
    /// The shape of `ctr run --net-host` (no NIC) instead of `ctr run`'s.
    #[arg(long)]
    no_nic: bool,
    /// The shape of a container with `io.burrow.browser=true`: the
    /// config's `browser_image` as the VM's first disk.
    #[arg(long)]
    browser: bool,
}

fn config() -> Result<Config> {
    Config::load()
        .context("reading the burrow config ($BURROW_CONFIG, else /etc/burrow/config.toml)")
}

/// `v` if the config's bounds hold it, else an error naming `flag`.
fn within<T: PartialOrd + std::fmt::Display>(flag: &str, v: T, (min, max): (T, T)) -> Result<T> {
    anyhow::ensure!(
        min <= v && v <= max,
        "{flag} {v} is outside the config's {min}..={max}"
    );
    Ok(v)
}

/// Build (unless published already) the template a plain `ctr run` of
/// this shape restores; prints its key and where it is.
pub fn build(a: BuildArgs) -> Result<i32> {
    let cfg = config()?;
    let mut shape = template_build::default_shape(&cfg, !a.no_nic);
    shape.browser = a.browser;
    if let Some(v) = a.vcpus {
        shape.vcpus = within("--vcpus", v, (cfg.vcpus.min, cfg.vcpus.max))?;
    }
    if let Some(m) = a.memory_mib {
        shape.memory_mib = within("--memory-mib", m, (cfg.memory_mib.min, cfg.memory_mib.max))?;
    }
    let started = std::time::Instant::now();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let built = rt.block_on(template_build::build(cfg, shape))?;
    let what = if built.built {
        format!("built in {:.1} s", started.elapsed().as_secs_f64())
    } else {
        "already built".to_string()
    };
    println!("template {} {what}: {}", built.key, built.dir.display());
    Ok(0)
}

/// One line per published template: key, disk use, shape.
pub fn ls() -> Result<i32> {
    let cfg = config()?;
    let all = template_build::list(&cfg);
    if all.is_empty() {
        eprintln!("no templates in {}", cfg.template_dir.display());
    }
    for t in all {
        let shape = t.info.get("shape").and_then(|s| s.as_str()).unwrap_or("?");
        println!("{}\t{} MiB\t{shape}", t.key, t.disk_bytes.div_ceil(1 << 20));
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::within;

    #[test]
    fn sizes_outside_the_configs_bounds_are_refused_by_name() {
        assert_eq!(within("--vcpus", 2u32, (1, 4)).ok(), Some(2));
        let e = within("--memory-mib", 8192u64, (128, 4096)).expect_err("too big");
        assert_eq!(
            e.to_string(),
            "--memory-mib 8192 is outside the config's 128..=4096"
        );
    }
}
