//! The active messages agents exchange: notifications, which carry the sender's agent name and
//! a sequence number, their acknowledgements, and the grant exchange (module `grants`): a
//! holder's `Hold` (acknowledged, or refused when the grant is gone) and the target's
//! `Revoke` (acknowledged once the holder is done with the grant).
//!
//! ```text
//! notification:    1 u8 | seq u64 | name length u8 | sender agent name (UTF-8) | message bytes
//! acknowledgement: 2 u8 | seq u64
//! hold:            3 u8 | seq u64 | name length u8 | holder agent name | grant id u64
//!                  | holder's connection info (the rest)
//! refused:         4 u8 | seq u64
//! revoke:          5 u8 | seq u64 | grant id u64
//! ```
//! (integers little-endian). Decoding is bounded and total: anything malformed is an error,
//! never a panic.

/// Largest notification message (they are sent eagerly, in one piece).
pub const MAX_NOTIF: usize = 1 << 20;
const KIND_NOTIF: u8 = 1;
const KIND_ACK: u8 = 2;
const KIND_HOLD: u8 = 3;
const KIND_REFUSED: u8 = 4;
const KIND_REVOKE: u8 = 5;

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
    #[error("{0} bytes after the end of a message")]
    Trailing(usize),
}

#[derive(Debug, PartialEq, Eq)]
pub enum Msg {
    Notif {
        seq: u64,
        sender: String,
        message: Vec<u8>,
    },
    Ack {
        seq: u64,
    },
    /// A holder announces itself for a grant (`conn_info`: where to send `Revoke`).
    Hold {
        seq: u64,
        holder: String,
        grant_id: u64,
        conn_info: Vec<u8>,
    },
    /// The answer to a `Hold` for a grant that is unknown, revoked, expired or not the holder's.
    Refused {
        seq: u64,
    },
    Revoke {
        seq: u64,
        grant_id: u64,
    },
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

fn with_seq(kind: u8, seq: u64) -> Vec<u8> {
    let mut out = vec![kind];
    out.extend_from_slice(&seq.to_le_bytes());
    out
}

pub fn encode_ack(seq: u64) -> Vec<u8> {
    with_seq(KIND_ACK, seq)
}

pub fn encode_refused(seq: u64) -> Vec<u8> {
    with_seq(KIND_REFUSED, seq)
}

pub fn encode_revoke(seq: u64, grant_id: u64) -> Vec<u8> {
    let mut out = with_seq(KIND_REVOKE, seq);
    out.extend_from_slice(&grant_id.to_le_bytes());
    out
}

pub fn encode_hold(seq: u64, holder: &str, grant_id: u64, conn_info: &[u8]) -> Result<Vec<u8>, MsgError> {
    let name = holder.as_bytes();
    let name_len = u8::try_from(name.len()).map_err(|_| MsgError::BadName)?;
    if conn_info.len() > MAX_NOTIF {
        return Err(MsgError::TooLarge(conn_info.len()));
    }
    let mut out = with_seq(KIND_HOLD, seq);
    out.push(name_len);
    out.extend_from_slice(name);
    out.extend_from_slice(&grant_id.to_le_bytes());
    out.extend_from_slice(conn_info);
    Ok(out)
}

fn word(bytes: &[u8]) -> Result<(u64, &[u8]), MsgError> {
    let head: [u8; 8] = bytes.get(..8).and_then(|b| b.try_into().ok()).ok_or(MsgError::Truncated)?;
    Ok((u64::from_le_bytes(head), &bytes[8..]))
}

/// A name (length u8, UTF-8) and what follows it.
fn name(bytes: &[u8]) -> Result<(String, &[u8]), MsgError> {
    let (&name_len, rest) = bytes.split_first().ok_or(MsgError::Truncated)?;
    let name = rest.get(..usize::from(name_len)).ok_or(MsgError::Truncated)?;
    let text = std::str::from_utf8(name).map_err(|_| MsgError::BadName)?.to_string();
    Ok((text, &rest[name.len()..]))
}

fn ends(rest: &[u8], msg: Msg) -> Result<Msg, MsgError> {
    if rest.is_empty() {
        Ok(msg)
    } else {
        Err(MsgError::Trailing(rest.len()))
    }
}

pub fn decode(bytes: &[u8]) -> Result<Msg, MsgError> {
    let (&kind, rest) = bytes.split_first().ok_or(MsgError::Truncated)?;
    if !(KIND_NOTIF..=KIND_REVOKE).contains(&kind) {
        return Err(MsgError::UnknownKind(kind));
    }
    let (seq, rest) = word(rest)?;
    match kind {
        KIND_ACK => ends(rest, Msg::Ack { seq }),
        KIND_REFUSED => ends(rest, Msg::Refused { seq }),
        KIND_REVOKE => {
            let (grant_id, rest) = word(rest)?;
            ends(rest, Msg::Revoke { seq, grant_id })
        }
        KIND_HOLD => {
            let (holder, rest) = name(rest)?;
            let (grant_id, conn_info) = word(rest)?;
            if conn_info.len() > MAX_NOTIF {
                return Err(MsgError::TooLarge(conn_info.len()));
            }
            Ok(Msg::Hold { seq, holder, grant_id, conn_info: conn_info.to_vec() })
        }
        _ => {
            let (sender, message) = name(rest)?;
            if message.len() > MAX_NOTIF {
                return Err(MsgError::TooLarge(message.len()));
            }
            Ok(Msg::Notif { seq, sender, message: message.to_vec() })
        }
    }
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
        let hold = encode_hold(4, "decode-1", 99, b"conn").unwrap();
        let want = Msg::Hold { seq: 4, holder: "decode-1".into(), grant_id: 99, conn_info: b"conn".to_vec() };
        assert_eq!(decode(&hold).unwrap(), want);
        for len in 0..hold.len() - 4 {
            assert!(decode(&hold[..len]).is_err(), "hold truncated to {len}");
        }
        assert_eq!(decode(&encode_refused(5)).unwrap(), Msg::Refused { seq: 5 });
        let revoke = encode_revoke(6, 42);
        assert_eq!(decode(&revoke).unwrap(), Msg::Revoke { seq: 6, grant_id: 42 });
        assert!(decode(&revoke[..revoke.len() - 1]).is_err());
        let mut long_revoke = revoke;
        long_revoke.push(1);
        assert_eq!(decode(&long_revoke), Err(MsgError::Trailing(1)));
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
                *first %= 6;
            }
            let _ = decode(&bytes);
        }
    }
}
