//! The small messages peers exchange over FI_MSG: a notification, in one or more chunks that
//! fit the receiver's buffers, each carrying the sender's address (so the receiver can answer)
//! and agent name; and its acknowledgement.
//!
//! ```text
//! notification chunk: 1u8 | seq u64 | index u32 | count u32 | address len u16 | address
//!                     | name len u16 | name | payload piece
//! acknowledgement:    2u8 | seq u64
//! ```

const NOTIF: u8 = 1;
const ACK: u8 = 2;
/// Header bytes besides the address, name and payload.
pub const NOTIF_OVERHEAD: usize = 1 + 8 + 4 + 4 + 2 + 2;

#[derive(Debug, PartialEq, Eq)]
pub enum Msg<'a> {
    Notif { seq: u64, index: u32, count: u32, address: &'a [u8], name: String, payload: &'a [u8] },
    Ack { seq: u64 },
}

/// Why a received message was dropped.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum MsgError {
    #[error("message truncated")]
    Truncated,
    #[error("unknown message kind {0}")]
    UnknownKind(u8),
    #[error("chunk index beyond the count")]
    BadChunk,
    #[error("the sender's name is not UTF-8")]
    BadName,
}

/// The chunks of one notification, each at most `max_chunk` payload bytes (at least one
/// chunk, for an empty payload).
pub fn notif(seq: u64, address: &[u8], name: &str, payload: &[u8], max_chunk: usize) -> Vec<Vec<u8>> {
    let pieces: Vec<&[u8]> =
        if payload.is_empty() { vec![payload] } else { payload.chunks(max_chunk.max(1)).collect() };
    let count = pieces.len() as u32;
    pieces
        .into_iter()
        .enumerate()
        .map(|(index, piece)| {
            let mut out = Vec::with_capacity(NOTIF_OVERHEAD + address.len() + name.len() + piece.len());
            out.push(NOTIF);
            out.extend_from_slice(&seq.to_le_bytes());
            out.extend_from_slice(&(index as u32).to_le_bytes());
            out.extend_from_slice(&count.to_le_bytes());
            for field in [address, name.as_bytes()] {
                out.extend_from_slice(&(field.len() as u16).to_le_bytes());
                out.extend_from_slice(field);
            }
            out.extend_from_slice(piece);
            out
        })
        .collect()
}

pub fn ack(seq: u64) -> Vec<u8> {
    let mut out = vec![ACK];
    out.extend_from_slice(&seq.to_le_bytes());
    out
}

pub fn parse(bytes: &[u8]) -> Result<Msg<'_>, MsgError> {
    let (&kind, rest) = bytes.split_first().ok_or(MsgError::Truncated)?;
    let (seq, mut rest) = split(rest, 8)?;
    let seq = u64::from_le_bytes(seq.try_into().map_err(|_| MsgError::Truncated)?);
    match kind {
        ACK if rest.is_empty() => Ok(Msg::Ack { seq }),
        ACK => Err(MsgError::Truncated),
        NOTIF => {
            let (index, tail) = split(rest, 4)?;
            let (count, tail) = split(tail, 4)?;
            rest = tail;
            let index = u32::from_le_bytes([index[0], index[1], index[2], index[3]]);
            let count = u32::from_le_bytes([count[0], count[1], count[2], count[3]]);
            if index >= count {
                return Err(MsgError::BadChunk);
            }
            let address = field(&mut rest)?;
            let name = field(&mut rest)?;
            let name = String::from_utf8(name.to_vec()).map_err(|_| MsgError::BadName)?;
            Ok(Msg::Notif { seq, index, count, address, name, payload: rest })
        }
        other => Err(MsgError::UnknownKind(other)),
    }
}

fn split(bytes: &[u8], n: usize) -> Result<(&[u8], &[u8]), MsgError> {
    (bytes.len() >= n).then(|| bytes.split_at(n)).ok_or(MsgError::Truncated)
}

fn field<'a>(rest: &mut &'a [u8]) -> Result<&'a [u8], MsgError> {
    let (len, tail) = split(rest, 2)?;
    let len = u16::from_le_bytes([len[0], len[1]]) as usize;
    let (value, tail) = split(tail, len)?;
    *rest = tail;
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_garbage() {
        let chunks = notif(7, b"addr", "agent", b"hello", 3);
        assert_eq!(chunks.len(), 2);
        let at =
            |index, payload| Msg::Notif { seq: 7, index, count: 2, address: b"addr", name: "agent".into(), payload };
        assert_eq!(parse(&chunks[0]), Ok(at(0, b"hel")));
        assert_eq!(parse(&chunks[1]), Ok(at(1, b"lo")));
        assert_eq!(notif(1, b"a", "n", b"", 3).len(), 1);
        let bytes = chunks[0].clone();
        assert_eq!(parse(&ack(9)), Ok(Msg::Ack { seq: 9 }));
        for len in 0..NOTIF_OVERHEAD + 9 {
            assert!(parse(&bytes[..len]).is_err(), "truncated to {len} parsed");
        }
        assert_eq!(parse(&[3; 9]), Err(MsgError::UnknownKind(3)));
        assert!(parse(&[]).is_err());
        let mut long_ack = ack(1);
        long_ack.push(0);
        assert!(parse(&long_ack).is_err());
    }
}
