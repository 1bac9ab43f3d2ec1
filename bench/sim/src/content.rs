//! What a KV block holds: bytes that are a pure function of the block's digest, so any receiver
//! that computed the same digest for the same tokens can check a block it pulled, byte by byte.

/// The digest a block's content is derived from (a full block's prefix-cache hash, or the
/// pseudo-digest of a prompt's partial last block).
pub type Digest = [u8; 32];

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn seed(digest: &Digest) -> u64 {
    digest.chunks_exact(8).fold(0u64, |acc, c| {
        let mut w = [0u8; 8];
        w.copy_from_slice(c);
        acc.rotate_left(17) ^ u64::from_le_bytes(w)
    })
}

/// Fills `out` with the content of the block with this digest. `out.len()` should be a multiple
/// of 8 (the configuration enforces it); a tail shorter than 8 bytes is filled too.
pub fn fill(digest: &Digest, out: &mut [u8]) {
    let mut state = seed(digest);
    let mut words = out.chunks_exact_mut(8);
    for word in &mut words {
        word.copy_from_slice(&splitmix(&mut state).to_le_bytes());
    }
    let tail = words.into_remainder();
    let last = splitmix(&mut state).to_le_bytes();
    let n = tail.len();
    tail.copy_from_slice(&last[..n]);
}

/// Whether `bytes` are the content of the block with this digest.
pub fn verify(digest: &Digest, bytes: &[u8]) -> bool {
    let mut state = seed(digest);
    let mut words = bytes.chunks_exact(8);
    for word in &mut words {
        if word != splitmix(&mut state).to_le_bytes() {
            return false;
        }
    }
    let tail = words.remainder();
    tail == &splitmix(&mut state).to_le_bytes()[..tail.len()]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_then_verify_and_detect_changes() {
        let d = [7u8; 32];
        let mut block = vec![0u8; 4100];
        fill(&d, &mut block);
        assert!(verify(&d, &block));
        let mut other = [7u8; 32];
        other[31] = 8;
        assert!(!verify(&other, &block));
        block[4099] ^= 1;
        assert!(!verify(&d, &block));
        let mut again = vec![0u8; 4100];
        fill(&d, &mut again);
        block[4099] ^= 1;
        assert_eq!(block, again, "deterministic");
    }
}
