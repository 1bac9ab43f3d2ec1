//! The committed seed corpora (`fuzz/seeds/<target>/`) are exactly what the encoders write
//! today, each is accepted by its target's decoder, and together they stay small. After a wire
//! format changes: `PD_FUZZ_SEEDS_WRITE=1 cargo test --workspace --all-features --locked --test
//! fuzz_seeds` rewrites them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use pd_fuzz_seeds::Seed;

/// The committed seeds together stay under this (the brief for the corpora: small).
const MAX_TOTAL_BYTES: usize = 200 << 10;

fn seeds_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../seeds")
}

/// The fuzz targets, as `fuzz/Cargo.toml` lists them.
fn fuzz_targets() -> Vec<String> {
    let manifest = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml")).unwrap();
    manifest
        .lines()
        .filter_map(|l| l.strip_prefix("name = \"")?.strip_suffix('"').map(str::to_string))
        .filter(|name| name != "xfer-fuzz")
        .collect()
}

/// Whether the target's own decoder takes the seed as a valid message.
fn accepted(seed: &Seed) -> bool {
    let bytes = &seed.bytes[..];
    match seed.target {
        "tcp_frames" => {
            matches!(xfer_tcp::frame::decode_request_frame(bytes), Ok(Some(_)))
                || xfer_tcp::frame::decode_response(bytes).is_ok()
                || xfer_tcp::frame::decode_hello(bytes).is_ok()
                || xfer_tcp::frame::decode_hello_reply(bytes).is_ok()
        }
        "tls_records" => {
            bytes.split_first_chunk::<{ xfer_tcp::records::HEADER }>().is_some_and(|(header, plaintext)| {
                xfer_tcp::records::body_len(header).is_ok_and(|len| len == plaintext.len() + 16)
                    && match xfer_tcp::records::decode_plaintext(plaintext) {
                        Ok(xfer_tcp::records::Content::Messages(mut messages)) => messages.all(|m| m.is_ok()),
                        other => other.is_ok(),
                    }
            })
        }
        "metadata_blob" => xfer::metadata::AgentMetadata::decode(bytes).is_ok(),
        "side_channel" => bytes.get(..9).and_then(|h| <&[u8; 9]>::try_from(h).ok()).is_some_and(|header| {
            xfer::side_channel::decode_request_header(header).is_ok_and(|(_, len)| len == bytes.len() - 9)
        }),
        "grant_claim" => xfer::grant_offer::recode_claim(bytes).is_ok_and(|canonical| canonical == bytes),
        "ucx_conn_info" => xfer_ucx::decode_conn_info(bytes).is_ok(),
        "ucx_keys" => xfer_ucx::UcxRemoteKey::decode(bytes).is_ok(),
        "kv_event_batch" | "kv_event_mutations" => pd_protocols::kv_events::decode_batch(bytes).is_ok(),
        "coordinator_api" => serde_json::from_slice::<serde_json::Value>(bytes).is_ok_and(|v| v.is_object()),
        "sidecar_engine_json" => {
            let first = bytes.split(|&b| b == 0).next().unwrap_or_default();
            pd_sidecar::json::Object::parse(first).is_ok()
        }
        "http_responses" => {
            let mut wire = bytes::BytesMut::from(&bytes[1..]);
            matches!(pd_http::client::framing::take_head(&mut wire, &http::Method::GET), Ok(Some(_)))
        }
        other => panic!("no check for the seeds of {other}"),
    }
}

#[test]
fn committed_seeds_are_what_the_encoders_write() {
    let dir = seeds_dir();
    let seeds = pd_fuzz_seeds::all();
    if std::env::var_os("PD_FUZZ_SEEDS_WRITE").is_some() {
        if dir.exists() {
            std::fs::remove_dir_all(&dir).unwrap();
        }
        for s in &seeds {
            std::fs::create_dir_all(dir.join(s.target)).unwrap();
            std::fs::write(dir.join(s.target).join(s.name), &s.bytes).unwrap();
        }
    }
    let targets = fuzz_targets();
    let mut committed = BTreeMap::new();
    for target in &targets {
        let target_dir = dir.join(target);
        let entries = std::fs::read_dir(&target_dir)
            .unwrap_or_else(|e| panic!("{} (every fuzz target needs seeds): {e}", target_dir.display()));
        for entry in entries {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            committed.insert((target.clone(), name), std::fs::read(&path).unwrap());
        }
    }
    let generated: BTreeMap<_, _> =
        seeds.iter().map(|s| ((s.target.to_string(), s.name.to_string()), s.bytes.clone())).collect();
    for (key, bytes) in &generated {
        assert!(targets.contains(&key.0), "seeds for {}, which fuzz/Cargo.toml does not list", key.0);
        assert_eq!(
            committed.get(key),
            Some(bytes),
            "{key:?} differs from the encoders' (PD_FUZZ_SEEDS_WRITE=1 rewrites it)"
        );
    }
    let stale: Vec<_> = committed.keys().filter(|k| !generated.contains_key(*k)).collect();
    assert!(stale.is_empty(), "committed seeds no encoder writes: {stale:?}");
    for target in &targets {
        let n = seeds.iter().filter(|s| *target == s.target).count();
        assert!(n >= 2, "{target} has {n} seeds");
    }
    for s in &seeds {
        assert!(accepted(s), "{}/{} is not a valid message for its target", s.target, s.name);
    }
    let total: usize = seeds.iter().map(|s| s.bytes.len()).sum();
    assert!(total < MAX_TOTAL_BYTES, "{total} bytes of seeds");
    println!("{} seeds for {} targets, {total} bytes", seeds.len(), targets.len());
}
