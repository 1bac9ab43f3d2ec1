//! The simulated engines of `examples/local/engines/*.toml` load as `pd-sim --config` loads them,
//! each on its own ports (the example starts all four on one machine).

use std::collections::HashSet;
use std::path::Path;

use pd_sim::config::Config;

#[test]
fn the_local_examples_engine_configs_load_on_distinct_ports() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/local/engines");
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .expect("examples/local/engines")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .collect();
    paths.sort();
    assert_eq!(paths.len(), 4, "2 prefill + 2 decode engines: {paths:?}");
    let mut ports = HashSet::new();
    for path in paths {
        let args = ["pd-sim", "--config", path.to_str().expect("utf-8 path")];
        let config = Config::from_args(args.iter().map(|s| s.to_string()).collect())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let stem = path.file_stem().and_then(|s| s.to_str()).expect("name");
        assert_eq!(config.engine_id.as_deref(), Some(stem), "{}: engine-id", path.display());
        let events = config.kv_events_endpoint.clone().unwrap_or_else(|| panic!("{}: no KV events", path.display()));
        for port in [config.port, config.xfer_port, port_of(&events)] {
            assert_ne!(port, 0, "{}: fixed ports, so sidecars can be configured with them", path.display());
            assert!(ports.insert(port), "{}: port {port} used twice", path.display());
        }
    }
}

fn port_of(endpoint: &str) -> u16 {
    endpoint.rsplit(':').next().and_then(|p| p.parse().ok()).unwrap_or(0)
}

/// CONFIG.md's pd-sim section lists exactly the flags of this build.
#[test]
fn config_reference_is_current() {
    use clap::CommandFactory;
    let page = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../CONFIG.md");
    if let Err(e) = pd_config_file::reference::check_section(&page, &Config::command()) {
        panic!("{e}");
    }
}
