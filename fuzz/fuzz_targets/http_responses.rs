//! The sidecar's upstream client reading an engine's answer: the response head, then its body in
//! whatever framing the head gave (length, chunked, until close). Errors, never panics; the body
//! and the outcome are the same whether the bytes arrive at once or in small pieces, and a body
//! never holds more than its length or more than arrived.
#![no_main]

use bytes::BytesMut;
use http::Method;
use libfuzzer_sys::fuzz_target;
use pd_http::client::framing::{take_head, Framing, FramingError, Step};

/// The body `framing` cuts from `wire` fed `piece` bytes at a time, and how it ended.
fn decode(mut framing: Framing, wire: &[u8], piece: usize) -> (Vec<u8>, Result<bool, FramingError>) {
    let (mut buf, mut body, mut fed) = (BytesMut::new(), Vec::new(), 0);
    loop {
        match framing.step(&mut buf) {
            Err(e) => return (body, Err(e)),
            Ok(Step::Data(d)) => {
                assert!(!d.is_empty(), "an empty data step");
                body.extend_from_slice(&d);
            }
            Ok(Step::End) => {
                assert!(framing.is_done());
                return (body, Ok(true));
            }
            Ok(Step::More) if fed == wire.len() => return (body, framing.at_close().map(|()| false)),
            Ok(Step::More) => {
                let next = fed.saturating_add(piece).min(wire.len());
                buf.extend_from_slice(&wire[fed..next]);
                fed = next;
            }
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&split, wire)) = data.split_first() else { return };
    for method in [Method::GET, Method::HEAD] {
        let mut buf = BytesMut::from(wire);
        let Ok(Some(head)) = take_head(&mut buf, &method) else { continue };
        let rest = &wire[wire.len() - buf.len()..];
        assert_eq!(&buf[..], rest, "the head is taken from the front");
        let length = head.framing.remaining();
        let (whole, ended) = decode(head.framing, rest, usize::MAX);
        let mut again = BytesMut::from(wire);
        let Ok(Some(again)) = take_head(&mut again, &method) else { panic!("a head taken once and not twice") };
        let (pieces, ended_in_pieces) = decode(again.framing, rest, usize::from(split % 7) + 1);
        assert_eq!((&whole, &ended), (&pieces, &ended_in_pieces));
        assert!(whole.len() <= rest.len());
        if let Some(n) = length {
            assert!(whole.len() as u64 <= n);
            if ended == Ok(true) {
                assert_eq!(whole.len() as u64, n);
            }
        }
    }
});
