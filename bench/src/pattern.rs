//! The consistency-check pattern: every byte is a function of its offset in the destination
//! region and a seed, so either side can produce or verify any range independently.

/// The pattern's bytes `offset .. offset + buf.len()` for `seed`.
pub fn fill(buf: &mut [u8], offset: u64, seed: u64) {
    let total = buf.len();
    let head = ((8 - offset % 8) % 8).min(buf.len() as u64) as usize;
    let (first, rest) = buf.split_at_mut(head);
    for (i, byte) in first.iter_mut().enumerate() {
        *byte = byte_at(offset + i as u64, seed);
    }
    let aligned = offset + head as u64;
    let mut words = rest.chunks_exact_mut(8);
    for (i, chunk) in (&mut words).enumerate() {
        chunk.copy_from_slice(&word(aligned / 8 + i as u64, seed).to_le_bytes());
    }
    let tail = words.into_remainder();
    let tail_offset = offset + (total - tail.len()) as u64;
    for (i, byte) in tail.iter_mut().enumerate() {
        *byte = byte_at(tail_offset + i as u64, seed);
    }
}

/// The index in `buf` of the first byte that differs from the pattern, if any.
pub fn first_mismatch(buf: &[u8], offset: u64, seed: u64) -> Option<usize> {
    const CHUNK: usize = 4096;
    let mut expected = [0u8; CHUNK];
    for (n, chunk) in buf.chunks(CHUNK).enumerate() {
        let start = n * CHUNK;
        let want = &mut expected[..chunk.len()];
        fill(want, offset + start as u64, seed);
        if chunk != want {
            let at = chunk.iter().zip(want.iter()).position(|(a, b)| a != b).expect("slices differ");
            return Some(start + at);
        }
    }
    None
}

/// The expected byte at `offset`.
pub fn byte_at(offset: u64, seed: u64) -> u8 {
    word(offset / 8, seed).to_le_bytes()[(offset % 8) as usize]
}

fn word(index: u64, seed: u64) -> u64 {
    // splitmix64 of the word index, keyed by the seed.
    let mut z = index.wrapping_add(seed.rotate_left(29)).wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_matches_byte_at_for_any_alignment() {
        for offset in [0u64, 1, 7, 8, 13, 4096] {
            for len in [0usize, 1, 5, 8, 9, 100] {
                let mut buf = vec![0u8; len];
                fill(&mut buf, offset, 42);
                let want: Vec<u8> = (0..len as u64).map(|i| byte_at(offset + i, 42)).collect();
                assert_eq!(buf, want, "offset {offset} len {len}");
            }
        }
    }

    #[test]
    fn a_range_is_the_same_whether_filled_whole_or_in_pieces() {
        let mut whole = vec![0u8; 10_000];
        fill(&mut whole, 3, 9);
        let mut pieces = vec![0u8; 10_000];
        let (a, b) = pieces.split_at_mut(4321);
        fill(a, 3, 9);
        fill(b, 3 + 4321, 9);
        assert_eq!(whole, pieces);
    }

    #[test]
    fn finds_the_first_mismatch() {
        let mut buf = vec![0u8; 20_000];
        fill(&mut buf, 64, 5);
        assert_eq!(first_mismatch(&buf, 64, 5), None);
        assert_eq!(first_mismatch(&buf, 64, 6), Some(0), "another seed differs at once");
        buf[12_345] ^= 1;
        assert_eq!(first_mismatch(&buf, 64, 5), Some(12_345));
    }
}
