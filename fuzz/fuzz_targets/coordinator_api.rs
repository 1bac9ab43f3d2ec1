//! The bodies the coordinator's HTTP API and the sidecar read from each other (`pd-api`), and
//! vLLM's `kv_transfer_params` the sidecar and the simulator read from engines: errors, never
//! panics; whatever decodes survives a re-encode unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pd_api::{EngineSpec, Heartbeat, Notices, PairDecision, PairRequest, Report};
use pd_protocols::kv_params::KvTransferParams;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// Decodes `data` as `T`; when it does, checks that the canonical encoding decodes to the same.
fn round_trip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(data: &[u8]) -> Option<T> {
    let value: T = serde_json::from_slice(data).ok()?;
    let again: T = serde_json::from_slice(&serde_json::to_vec(&value).expect("encodes")).expect("re-decodes");
    assert_eq!(again, value);
    Some(value)
}

fuzz_target!(|data: &[u8]| {
    if let Some(spec) = round_trip::<EngineSpec>(data) {
        let _ = spec.validate();
    }
    round_trip::<Heartbeat>(data);
    round_trip::<PairRequest>(data);
    round_trip::<PairDecision>(data);
    let _ = serde_json::from_slice::<Report>(data);
    let _ = serde_json::from_slice::<Notices>(data);
    if let Some(params) = round_trip::<KvTransferParams>(data) {
        let _ = (params.is_valid_for_pull(), params.first_group().len());
    }
});
