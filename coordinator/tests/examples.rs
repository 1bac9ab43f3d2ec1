//! The example deployments in `examples/` (repository root) are real configuration: every
//! coordinator option file and cluster file there must load as pd-coordinator would load it.

use std::path::{Path, PathBuf};

use pd_coordinator::config::{ClusterFile, Config};

fn examples() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples")
}

/// Files under `dir` (recursively) whose name satisfies `pick`, sorted.
fn files(dir: &Path, pick: &dyn Fn(&str) -> bool) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).expect("examples/ is readable") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            out.extend(files(&path, pick));
        } else if path.file_name().and_then(|n| n.to_str()).is_some_and(pick) {
            out.push(path);
        }
    }
    out.sort();
    out
}

#[test]
fn every_example_coordinator_config_loads() {
    let configs = files(&examples(), &|n| n == "coordinator.toml");
    assert!(configs.len() >= 2, "expected the local and two-node coordinator configs, found {configs:?}");
    for path in configs {
        let args = ["pd-coordinator", "--config", path.to_str().expect("utf-8 path")];
        let config = Config::from_args(args.iter().map(|s| s.to_string()).collect())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        config.store_url().unwrap_or_else(|e| panic!("{}: store: {e}", path.display()));
        assert_ne!(config.listen.port(), 0, "{}: the API needs a fixed port sidecars can reach", path.display());
    }
}

#[test]
fn every_example_cluster_file_loads_and_validates() {
    let clusters = files(&examples(), &|n| n == "cluster.toml");
    assert!(!clusters.is_empty(), "expected examples/two-node/cluster.toml");
    for path in clusters {
        let cluster = ClusterFile::load(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(!cluster.engines.is_empty(), "{}: no engines", path.display());
        for engine in &cluster.engines {
            engine.validate().unwrap_or_else(|e| panic!("{}: engine {}: {e}", path.display(), engine.id));
        }
        let roles: Vec<_> = cluster.engines.iter().map(|e| format!("{:?}", e.role)).collect();
        assert!(roles.iter().any(|r| r.contains("Prefill")), "{}: no prefill engine", path.display());
        assert!(roles.iter().any(|r| r.contains("Decode")), "{}: no decode engine", path.display());
    }
}

/// CONFIG.md's pd-coordinator section lists exactly the flags of this build.
#[test]
fn config_reference_is_current() {
    use clap::CommandFactory;
    let page = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../CONFIG.md");
    if let Err(e) = pd_config_file::reference::check_section(&page, &Config::command()) {
        panic!("{e}");
    }
}
