//! Agent metadata blobs from an untrusted peer: decode errors, never panics; whatever decodes
//! survives a re-encode unchanged.
#![no_main]

use libfuzzer_sys::fuzz_target;
use xfer::metadata::AgentMetadata;

fuzz_target!(|data: &[u8]| {
    if let Ok(md) = AgentMetadata::decode(data) {
        assert_eq!(AgentMetadata::decode(&md.encode()).as_ref(), Ok(&md));
    }
});
