//! The metadata side channel's request header and the metadata blob behind it: errors, never
//! panics; a header that decodes names a body the size limit allows.
#![no_main]

use libfuzzer_sys::fuzz_target;
use xfer::metadata::{AgentMetadata, MAX_BLOB_LEN};
use xfer::side_channel::decode_request_header;

fuzz_target!(|data: &[u8]| {
    let Some(header) = data.get(..9).and_then(|h| <&[u8; 9]>::try_from(h).ok()) else { return };
    if let Ok((_, len)) = decode_request_header(header) {
        assert!(len <= MAX_BLOB_LEN);
        let _ = AgentMetadata::decode(&data[9..]);
    }
});
