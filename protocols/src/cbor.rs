//! The sliver of canonical CBOR (RFC 8949 §4.2) that vLLM's `sha256_cbor` hashes: unsigned and
//! negative integers, byte and text strings, arrays and null, each head in its shortest form.

/// A CBOR data item of the kinds the block hash needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Item<'a> {
    Uint(u64),
    Int(i64),
    Bytes(&'a [u8]),
    Text(&'a str),
    Array(Vec<Item<'a>>),
    Null,
}

/// Appends the shortest head for major type `major` with argument `value`.
pub fn write_head(major: u8, value: u64, out: &mut Vec<u8>) {
    let m = major << 5;
    match value {
        0..=23 => out.push(m | value as u8),
        24..=0xff => out.extend_from_slice(&[m | 24, value as u8]),
        0x100..=0xffff => {
            out.push(m | 25);
            out.extend_from_slice(&(value as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(m | 26);
            out.extend_from_slice(&(value as u32).to_be_bytes());
        }
        _ => {
            out.push(m | 27);
            out.extend_from_slice(&value.to_be_bytes());
        }
    }
}

/// Appends the canonical encoding of `item`.
pub fn encode(item: &Item<'_>, out: &mut Vec<u8>) {
    match item {
        Item::Uint(v) => write_head(0, *v, out),
        Item::Int(v) if *v >= 0 => write_head(0, *v as u64, out),
        Item::Int(v) => write_head(1, (-1 - *v) as u64, out),
        Item::Bytes(b) => {
            write_head(2, b.len() as u64, out);
            out.extend_from_slice(b);
        }
        Item::Text(t) => {
            write_head(3, t.len() as u64, out);
            out.extend_from_slice(t.as_bytes());
        }
        Item::Array(items) => {
            write_head(4, items.len() as u64, out);
            for item in items {
                encode(item, out);
            }
        }
        Item::Null => out.push(0xf6),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc(item: Item<'_>) -> Vec<u8> {
        let mut out = Vec::new();
        encode(&item, &mut out);
        out
    }

    #[test]
    fn rfc_8949_examples() {
        assert_eq!(enc(Item::Uint(0)), [0x00]);
        assert_eq!(enc(Item::Uint(23)), [0x17]);
        assert_eq!(enc(Item::Uint(24)), [0x18, 0x18]);
        assert_eq!(enc(Item::Uint(1000)), [0x19, 0x03, 0xe8]);
        assert_eq!(enc(Item::Uint(1_000_000)), [0x1a, 0x00, 0x0f, 0x42, 0x40]);
        assert_eq!(enc(Item::Uint(1_000_000_000_000)), [0x1b, 0, 0, 0, 0xe8, 0xd4, 0xa5, 0x10, 0x00]);
        assert_eq!(enc(Item::Int(-1)), [0x20]);
        assert_eq!(enc(Item::Int(-1000)), [0x39, 0x03, 0xe7]);
        assert_eq!(enc(Item::Text("IETF")), [0x64, 0x49, 0x45, 0x54, 0x46]);
        assert_eq!(enc(Item::Bytes(&[1, 2, 3, 4])), [0x44, 1, 2, 3, 4]);
        assert_eq!(enc(Item::Array(vec![Item::Uint(1), Item::Uint(2), Item::Uint(3)])), [0x83, 1, 2, 3]);
        assert_eq!(enc(Item::Null), [0xf6]);
    }
}
