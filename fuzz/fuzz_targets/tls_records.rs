//! The TCP backend's TLS record layer on what a peer could send: a record header (the first 5
//! bytes, read before anything is decrypted) and an opened record's plaintext (the rest: content,
//! content type, padding, and the handshake messages after the handshake). Errors, never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;
use xfer_tcp::records::{self, Content, HEADER};

fuzz_target!(|data: &[u8]| {
    let Some((header, plaintext)) = data.split_first_chunk::<HEADER>() else { return };
    if let Ok(len) = records::body_len(header) {
        assert!(len <= records::MAX_BODY);
    }
    match records::decode_plaintext(plaintext) {
        Ok(Content::Data(len)) => assert!(len < plaintext.len()),
        Ok(Content::Messages(messages)) => messages.for_each(drop),
        Ok(Content::Closed) | Err(_) => {}
    }
});
