//! Compiles proto/coordinator.proto with the protoc that `protoc-bin-vendored` ships (`PROTOC`
//! overrides it). etcd-client's own build script still needs a system protoc with the well-known
//! types: Debian's protobuf-compiler and libprotobuf-dev (ci/install-deps.sh).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("PROTOC").is_none() {
        let protoc = protoc_bin_vendored::protoc_bin_path()?;
        std::env::set_var("PROTOC", protoc);
    }
    println!("cargo:rerun-if-changed=proto/coordinator.proto");
    tonic_prost_build::configure().compile_protos(&["proto/coordinator.proto"], &["proto"])?;
    Ok(())
}
