//! Finds the system libfabric with pkg-config (libfabric >= 1.15), compiles the C shim over its
//! `static inline` calls against the same headers, and generates bindings over both. The
//! library is linked dynamically, so the binaries run against the libfabric `fi_info` reports.

use std::path::PathBuf;

const MIN_LIBFABRIC: &str = "1.15";

fn main() {
    for file in ["wrapper.h", "shim.h", "shim.c"] {
        println!("cargo:rerun-if-changed={file}");
    }
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    let fabric = match pkg_config::Config::new().atleast_version(MIN_LIBFABRIC).probe("libfabric") {
        Ok(lib) => lib,
        Err(err) => panic!(
            "libfabric >= {MIN_LIBFABRIC} was not found with pkg-config ({err}).\n\
             On Debian/Ubuntu: apt-get install libfabric-dev pkg-config libclang-dev"
        ),
    };
    let mut shim = cc::Build::new();
    shim.file("shim.c").warnings(true);
    for path in &fabric.include_paths {
        shim.include(path);
    }
    shim.compile("xfer_fabric_shim");

    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        // The shim's wrappers and the library's real symbols; the static inline originals are
        // left out (they have no symbol to link).
        .allowlist_function("xf_.*|fi_getinfo|fi_freeinfo|fi_dupinfo|fi_strerror|fi_version|fi_tostr")
        .allowlist_type("fi_.*|fid_.*|fid")
        .allowlist_var("FI_.*")
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .generate_comments(false)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for path in &fabric.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    let bindings = builder.generate().expect("bindgen over <rdma/fabric.h>");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR is set by cargo"));
    bindings.write_to_file(out.join("bindings.rs")).expect("write bindings.rs");
}
