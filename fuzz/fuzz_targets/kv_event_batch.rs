//! KV-event batches from an engine's PUB socket, in any encoding: errors, never panics; a batch
//! that decodes survives a re-encode, in either layout, unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use pd_protocols::kv_events::{decode_batch, encode_batch, EventFormat};

fuzz_target!(|data: &[u8]| {
    let Ok(batch) = decode_batch(data) else { return };
    if batch.ts.is_nan() {
        return;
    }
    for format in [EventFormat::TaggedMap, EventFormat::LegacyArray] {
        assert_eq!(decode_batch(&encode_batch(&batch, format)).as_ref(), Ok(&batch), "{format:?}");
    }
});
