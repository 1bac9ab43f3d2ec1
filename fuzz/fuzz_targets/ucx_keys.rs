//! UCX remote keys from a peer's metadata, checked before any byte reaches UCX: errors, never
//! panics; a key that decodes re-encodes to the same bytes and covers only its own range.
#![no_main]

use libfuzzer_sys::fuzz_target;
use xfer_ucx::UcxRemoteKey;

fuzz_target!(|data: &[u8]| {
    let Ok(key) = UcxRemoteKey::decode(data) else { return };
    assert_eq!(key.encode(), data);
    assert!(key.covers(key.base, key.len));
    assert!(!key.covers(key.base, key.len + 1) || key.len == u64::MAX);
});
