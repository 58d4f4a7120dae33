//! Generates the ttrpc service and protobuf messages from `proto/agent.proto`
//! with the pure-Rust parser of ttrpc-codegen (no `protoc` needed).

use std::error::Error;
use std::fs;
use std::path::PathBuf;

fn main() -> Result<(), Box<dyn Error>> {
    println!("cargo:rerun-if-changed=proto/agent.proto");
    let out = PathBuf::from(std::env::var("OUT_DIR")?).join("gen");
    fs::create_dir_all(&out)?;
    ttrpc_codegen::Codegen::new()
        .inputs(["proto/agent.proto"])
        .include("proto")
        .rust_protobuf()
        .rust_protobuf_customize(
            ttrpc_codegen::ProtobufCustomize::default()
                .gen_mod_rs(false)
                .generate_accessors(true),
        )
        .customize(ttrpc_codegen::Customize {
            async_all: true,
            ..Default::default()
        })
        .out_dir(&out)
        .run()?;
    // `include!` cannot take files with inner attributes or inner doc
    // comments: drop those lines.
    for entry in fs::read_dir(&out)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "rs") {
            let text = fs::read_to_string(&path)?;
            let kept: Vec<&str> = text
                .lines()
                .filter(|l| !l.starts_with("#!") && !l.starts_with("//!"))
                .collect();
            fs::write(&path, kept.join("\n"))?;
        }
    }
    Ok(())
}
