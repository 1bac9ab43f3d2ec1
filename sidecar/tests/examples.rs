//! The example deployments in `examples/` (repository root) are real configuration: every
//! sidecar config there must load and resolve as pd-sidecar would, and say what its file name
//! says (engine id, role).

use std::path::{Path, PathBuf};

use pd_sidecar::config::{Config, Role};

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

/// Sidecar configs under `dir`: `sidecars/*.toml` and `sidecar-*.toml`, sorted.
fn sidecar_configs(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("examples/ is readable") {
        let path = entry.expect("entry").path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        if path.is_dir() {
            out.extend(sidecar_configs(&path));
        } else if name.ends_with(".toml")
            && (name.starts_with("sidecar-") || path.parent().is_some_and(|p| p.ends_with("sidecars")))
        {
            out.push(path);
        }
    }
    out.sort();
    out
}

#[test]
fn every_example_sidecar_config_loads_and_matches_its_name() {
    let configs = sidecar_configs(&examples());
    assert!(configs.len() >= 8, "expected 4 local and 4 two-node sidecar configs, found {configs:?}");
    for path in configs {
        let args = ["pd-sidecar", "--config", path.to_str().expect("utf-8 path")];
        let config = Config::from_args(args.iter().map(|s| s.to_string()).collect())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let resolved = config.resolve().unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let stem = path.file_stem().and_then(|s| s.to_str()).expect("file name");
        let engine = stem.strip_prefix("sidecar-").unwrap_or(stem);
        assert_eq!(config.engine_id.as_deref(), Some(engine), "{}: engine-id", path.display());
        let role = if engine.starts_with("prefill") { Role::Prefill } else { Role::Decode };
        assert_eq!(config.role, role, "{}: role", path.display());
        assert!(config.coordinator.is_some(), "{}: registers with no coordinator", path.display());
        assert!(config.kv_events.is_some(), "{}: the coordinator gets no KV events", path.display());
        assert_eq!(resolved.engines.len(), 1, "{}: one engine per sidecar", path.display());
        if role == Role::Decode {
            assert!(!resolved.prefills.is_empty(), "{}: a decode sidecar needs fallback prefills", path.display());
        }
    }
}

/// CONFIG.md's pd-sidecar section lists exactly the flags of this build.
#[test]
fn config_reference_is_current() {
    use clap::CommandFactory;
    let page = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../CONFIG.md");
    if let Err(e) = pd_config_file::reference::check_section(&page, &Config::command()) {
        panic!("{e}");
    }
}
