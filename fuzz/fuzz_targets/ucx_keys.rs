//! UCX remote keys from a peer's metadata, checked before any byte reaches UCX: errors, never
//! panics; a key that decodes re-encodes to the same bytes and covers only its own range.
#![no_main]

use libfuzzer_sys::fuzz_target;
use xfer_ucx::UcxRemoteKey;

fuzz_target!(|data: &[u8]| {
    let Ok(key) = UcxRemoteKey::decode(data) else { return };
    assert_eq!(key.encode(), data);
    assert!(key.covers(key.base, key.len));
    // A key of u64::MAX bytes has no longer range to refuse (the check itself must not overflow).
    assert!(key.len.checked_add(1).is_none_or(|longer| !key.covers(key.base, longer)));
});
