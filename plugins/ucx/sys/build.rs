//! Finds the system UCX with pkg-config (UCX >= 1.12) and generates bindings over its UCP
//! header. The library is linked dynamically, so the binaries run against the same UCX that
//! `ucx_info` and `ucx_perftest` report.

use std::path::PathBuf;

const MIN_UCX: &str = "1.12";

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    let ucx = match pkg_config::Config::new().atleast_version(MIN_UCX).probe("ucx") {
        Ok(lib) => lib,
        Err(err) => panic!(
            "UCX >= {MIN_UCX} was not found with pkg-config ({err}).\n\
             On Debian/Ubuntu: apt-get install libucx-dev pkg-config libclang-dev"
        ),
    };
    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .allowlist_function("ucp_.*|ucs_.*")
        .allowlist_type("ucp_.*|ucs_.*")
        .allowlist_var("UCP_.*|UCS_.*")
        // Plain integer constants: the flags are OR-ed together and compared as numbers.
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for path in &ucx.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = builder.generate().expect("bindgen over <ucp/api/ucp.h>");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    bindings.write_to_file(out.join("bindings.rs")).expect("write bindings.rs");
}
