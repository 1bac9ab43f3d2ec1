//! Every decoder of the TCP backend's wire format, on arbitrary bytes: errors, never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use xfer_tcp::frame;

fuzz_target!(|data: &[u8]| {
    if let Ok(Some((header, descs, used))) = frame::decode_request_frame(data) {
        assert!(used <= data.len());
        assert_eq!(descs.len(), header.n_desc as usize);
    }
    let _ = frame::decode_response(data);
    let _ = frame::decode_hello(data);
    let _ = frame::decode_hello_reply(data);
});
