//! The active messages agents exchange: notifications, which carry the sender's agent name and
//! a sequence number, and their acknowledgements.
//!
//! ```text
//! notification:    1 u8 | seq u64 | name length u8 | sender agent name (UTF-8) | message bytes
//! acknowledgement: 2 u8 | seq u64
//! ```
//! (integers little-endian). Decoding is bounded and total: anything malformed is an error,
//! never a panic.

/// Largest notification message (they are sent eagerly, in one piece).
pub const MAX_NOTIF: usize = 1 << 20;
const KIND_NOTIF: u8 = 1;
const KIND_ACK: u8 = 2;

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum MsgError {
    #[error("empty or truncated message")]
    Truncated,
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    #[error("sender name is not UTF-8 or longer than 255 bytes")]
    BadName,
    #[error("notification of {0} bytes is over the limit")]
    TooLarge(usize),
    #[error("{0} bytes after an acknowledgement")]
    Trailing(usize),
}

#[derive(Debug, PartialEq, Eq)]
pub enum Msg {
    Notif { seq: u64, sender: String, message: Vec<u8> },
    Ack { seq: u64 },
}

pub fn encode_notif(seq: u64, sender: &str, message: &[u8]) -> Result<Vec<u8>, MsgError> {
    if message.len() > MAX_NOTIF {
        return Err(MsgError::TooLarge(message.len()));
    }
    let name = sender.as_bytes();
    let name_len = u8::try_from(name.len()).map_err(|_| MsgError::BadName)?;
    let mut out = Vec::with_capacity(10 + name.len() + message.len());
    out.push(KIND_NOTIF);
    out.extend_from_slice(&seq.to_le_bytes());
    out.push(name_len);
    out.extend_from_slice(name);
    out.extend_from_slice(message);
    Ok(out)
}

pub fn encode_ack(seq: u64) -> Vec<u8> {
    let mut out = vec![KIND_ACK];
    out.extend_from_slice(&seq.to_le_bytes());
    out
}

pub fn decode(bytes: &[u8]) -> Result<Msg, MsgError> {
    let (&kind, rest) = bytes.split_first().ok_or(MsgError::Truncated)?;
    if kind != KIND_NOTIF && kind != KIND_ACK {
        return Err(MsgError::UnknownKind(kind));
    }
    let seq_bytes: [u8; 8] = rest.get(..8).and_then(|b| b.try_into().ok()).ok_or(MsgError::Truncated)?;
    let seq = u64::from_le_bytes(seq_bytes);
    let rest = &rest[8..];
    if kind == KIND_ACK {
        return if rest.is_empty() { Ok(Msg::Ack { seq }) } else { Err(MsgError::Trailing(rest.len())) };
    }
    let (&name_len, rest) = rest.split_first().ok_or(MsgError::Truncated)?;
    let name = rest.get(..usize::from(name_len)).ok_or(MsgError::Truncated)?;
    let message = &rest[name.len()..];
    if message.len() > MAX_NOTIF {
        return Err(MsgError::TooLarge(message.len()));
    }
    let sender = std::str::from_utf8(name).map_err(|_| MsgError::BadName)?.to_string();
    Ok(Msg::Notif { seq, sender, message: message.to_vec() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_every_truncation() {
        let bytes = encode_notif(9, "decode-0", b"req-1:1").unwrap();
        let want = Msg::Notif { seq: 9, sender: "decode-0".into(), message: b"req-1:1".to_vec() };
        assert_eq!(decode(&bytes).unwrap(), want);
        for len in 0..10 + "decode-0".len() {
            assert!(decode(&bytes[..len]).is_err(), "truncated to {len}");
        }
        assert_eq!(decode(&encode_ack(u64::MAX)).unwrap(), Msg::Ack { seq: u64::MAX });
        let mut long_ack = encode_ack(1);
        long_ack.push(0);
        assert_eq!(decode(&long_ack), Err(MsgError::Trailing(1)));
        assert_eq!(decode(&[9, 0]), Err(MsgError::UnknownKind(9)));
        let mut bad_name = encode_notif(1, "ab", b"").unwrap();
        bad_name[10] = 0xff;
        assert_eq!(decode(&bad_name), Err(MsgError::BadName));
        assert!(encode_notif(1, &"n".repeat(256), b"").is_err());
        assert!(encode_notif(1, "a", &vec![0; MAX_NOTIF + 1]).is_err());
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for _ in 0..5000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = (state % 40) as usize;
            let mut bytes: Vec<u8> = (0..len).map(|i| (state >> (i % 8 * 8)) as u8).collect();
            if let Some(first) = bytes.first_mut() {
                *first %= 3;
            }
            let _ = decode(&bytes);
        }
    }
}
