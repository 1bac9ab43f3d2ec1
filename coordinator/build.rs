//! Compiles proto/coordinator.proto. Inside the workspace `PROTOC` is `.cargo/vendored-protoc`
//! (set by `.cargo/config.toml`, so etcd-client's build script gets the same protoc); a build
//! outside it falls back to the `protoc-bin-vendored` crate's binary directly.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        let protoc = protoc_bin_vendored::protoc_bin_path()?;
        std::env::set_var("PROTOC", protoc);
    }
    println!("cargo:rerun-if-changed=proto/coordinator.proto");
    tonic_prost_build::configure().compile_protos(&["proto/coordinator.proto"], &["proto"])?;
    Ok(())
}
