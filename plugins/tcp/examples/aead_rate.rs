//! One core's AES-GCM rate with ring, on TLS-sized records (16 KiB): the ceiling of one
//! `tls=on` stream, since each stream seals (or opens) its records on its own thread.
//!
//! `cargo run --release -p xfer-tcp --example aead_rate`

use std::time::Instant;

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM, AES_256_GCM, CHACHA20_POLY1305};

const RECORD: usize = 16 << 10;
const TOTAL: usize = 2 << 30;

fn main() {
    for (name, alg) in
        [("AES-128-GCM", &AES_128_GCM), ("AES-256-GCM", &AES_256_GCM), ("CHACHA20-POLY1305", &CHACHA20_POLY1305)]
    {
        let key = LessSafeKey::new(UnboundKey::new(alg, &vec![7u8; alg.key_len()]).expect("key"));
        let mut record = vec![0x5au8; RECORD];
        let started = Instant::now();
        for i in 0..TOTAL / RECORD {
            let mut nonce = [0u8; 12];
            nonce[4..].copy_from_slice(&(i as u64).to_be_bytes());
            let tag = key
                .seal_in_place_separate_tag(Nonce::assume_unique_for_key(nonce), Aad::empty(), &mut record)
                .expect("seal");
            let _ = std::hint::black_box(tag);
        }
        let secs = started.elapsed().as_secs_f64();
        println!("{name}: {:.2} GB/s sealing {} KiB records on one core", TOTAL as f64 / secs / 1e9, RECORD >> 10);
    }
}
