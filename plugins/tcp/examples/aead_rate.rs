//! One core's AEAD rate on TLS-sized records (16 KiB), ring against aws-lc: the ceiling of one
//! `tls=on` stream, since each stream seals (or opens) its records on its own thread. The record
//! layer (`src/records.rs`) seals with aws-lc out of place, from the payload's memory into the
//! send buffer; rustls's own records (and the QUIC backend's packets) use ring in place.
//!
//! `cargo run --release -p xfer-tcp --example aead_rate`

use std::time::Instant;

const RECORD: usize = 16 << 10;
const TOTAL: usize = 2 << 30;

fn nonce_bytes(i: usize) -> [u8; 12] {
    let mut nonce = [0u8; 12];
    nonce[4..].copy_from_slice(&(i as u64).to_be_bytes());
    nonce
}

/// Seals `TOTAL` bytes as records with `seal(record number, record buffer)` and prints the rate.
fn time_sealing(name: &str, how: &str, mut seal: impl FnMut(usize, &mut [u8])) {
    let mut record = vec![0x5au8; RECORD];
    let started = Instant::now();
    for i in 0..TOTAL / RECORD {
        seal(i, &mut record);
        std::hint::black_box(&record);
    }
    let secs = started.elapsed().as_secs_f64();
    println!("{name} {how}: {:.2} GB/s sealing {} KiB records on one core", TOTAL as f64 / secs / 1e9, RECORD >> 10);
}

fn ring_in_place(name: &str, alg: &'static ring::aead::Algorithm) {
    use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey};
    let key = LessSafeKey::new(UnboundKey::new(alg, &vec![7u8; alg.key_len()]).expect("key"));
    time_sealing(name, "ring, in place", |i, record| {
        let nonce = Nonce::assume_unique_for_key(nonce_bytes(i));
        let _ = std::hint::black_box(key.seal_in_place_separate_tag(nonce, Aad::empty(), record).expect("seal"));
    });
}

fn aws_lc(name: &str, alg: &'static aws_lc_rs::aead::Algorithm) {
    use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey};
    let key = LessSafeKey::new(UnboundKey::new(alg, &vec![7u8; alg.key_len()]).expect("key"));
    time_sealing(name, "aws-lc, in place", |i, record| {
        let nonce = Nonce::assume_unique_for_key(nonce_bytes(i));
        let _ = std::hint::black_box(key.seal_in_place_separate_tag(nonce, Aad::empty(), record).expect("seal"));
    });
    // Out of place from a payload much larger than the caches, as the record layer seals.
    let payload = vec![0x5au8; 64 << 20];
    let mut tag = [0u8; 17];
    time_sealing(name, "aws-lc, out of place from 64 MiB", |i, record| {
        let offset = (i * RECORD) % payload.len();
        let nonce = Nonce::assume_unique_for_key(nonce_bytes(i));
        let plaintext = &payload[offset..offset + RECORD];
        key.seal_out_of_place_scatter(nonce, Aad::empty(), plaintext, record, &[23], &mut tag).expect("seal");
    });
}

fn main() {
    ring_in_place("AES-128-GCM", &ring::aead::AES_128_GCM);
    aws_lc("AES-128-GCM", &aws_lc_rs::aead::AES_128_GCM);
    ring_in_place("AES-256-GCM", &ring::aead::AES_256_GCM);
    aws_lc("AES-256-GCM", &aws_lc_rs::aead::AES_256_GCM);
    ring_in_place("CHACHA20-POLY1305", &ring::aead::CHACHA20_POLY1305);
}
