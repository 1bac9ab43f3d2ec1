//! `decode_batch` without a value tree: one pass checks that the bytes are one msgpack value
//! within the depth limit (rmpv's own accounting, so the same inputs fail), a second reads the
//! batch from the checked bytes, allocating only what the batch keeps. Token ids, the bulk of a
//! `BlockStored`, go straight into their `Vec<u32>`.

use super::{shape, BlockHash, DecodeError, EventBatch, KvEvent, MAX_DEPTH, REMOVED, STORED};

/// For markers of values that hold nothing (integers, floats, nil, booleans, the reserved
/// marker), the bytes after the marker; `NOT_PLAIN` for the others.
const PLAIN: [u8; 256] = {
    let mut table = [NOT_PLAIN; 256];
    let mut m = 0;
    while m < 256 {
        table[m] = match m {
            0x00..=0x7f | 0xe0..=0xff | 0xc0..=0xc3 => 0,
            0xcc | 0xd0 => 1,
            0xcd | 0xd1 => 2,
            0xca | 0xce | 0xd2 => 4,
            0xcb | 0xcf | 0xd3 => 8,
            _ => NOT_PLAIN,
        };
        m += 1;
    }
    table
};
const NOT_PLAIN: u8 = 255;

/// An integer as rmpv keeps it: non-negative values are `Pos` whatever their marker.
#[derive(Clone, Copy, Debug)]
enum Int {
    Pos(u64),
    Neg(i64),
}

impl Int {
    fn signed(v: i64) -> Int {
        if v < 0 {
            Int::Neg(v)
        } else {
            Int::Pos(v as u64)
        }
    }
}

/// One value's head: scalars whole, containers as their length (the reader then stands on
/// their first element).
#[derive(Clone, Copy, Debug)]
enum Val<'a> {
    Nil,
    Bool,
    Int(Int),
    Float(f64),
    Str(&'a [u8]),
    Bin(&'a [u8]),
    Array(usize),
    Map(usize),
    Ext,
}

impl<'a> Val<'a> {
    fn kind(self) -> &'static str {
        match self {
            Val::Nil => "nil",
            Val::Bool => "a boolean",
            Val::Int(_) => "an integer",
            Val::Float(_) => "a float",
            Val::Str(_) => "a string",
            Val::Bin(_) => "binary",
            Val::Array(_) => "an array",
            Val::Map(_) => "a map",
            Val::Ext => "an extension",
        }
    }

    fn as_u64(self) -> Option<u64> {
        match self {
            Val::Int(Int::Pos(n)) => Some(n),
            _ => None,
        }
    }

    fn as_i64(self) -> Option<i64> {
        match self {
            Val::Int(Int::Pos(n)) => i64::try_from(n).ok(),
            Val::Int(Int::Neg(n)) => Some(n),
            _ => None,
        }
    }

    fn as_f64(self) -> Option<f64> {
        match self {
            Val::Int(Int::Pos(n)) => Some(n as f64),
            Val::Int(Int::Neg(n)) => Some(n as f64),
            Val::Float(f) => Some(f),
            _ => None,
        }
    }

    fn as_str(self) -> Option<&'a str> {
        match self {
            Val::Str(bytes) => std::str::from_utf8(bytes).ok(),
            _ => None,
        }
    }
}

/// Reading past what the check pass accepted: cannot happen, reported as malformed anyway.
fn malformed() -> DecodeError {
    DecodeError::Msgpack("malformed msgpack".into())
}

#[derive(Clone, Copy)]
struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn at(buf: &'a [u8], pos: usize) -> Self {
        Reader { buf, pos }
    }

    #[inline]
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&end| end <= self.buf.len())?;
        let bytes = &self.buf[self.pos..end];
        self.pos = end;
        Some(bytes)
    }

    #[inline]
    fn byte(&mut self) -> Option<u8> {
        let b = *self.buf.get(self.pos)?;
        self.pos += 1;
        Some(b)
    }

    #[inline]
    fn be(&mut self, n: usize) -> Option<u64> {
        Some(self.take(n)?.iter().fold(0u64, |acc, &b| acc << 8 | u64::from(b)))
    }

    /// The length after a marker that has one (strings, binary, extensions, containers).
    #[inline]
    fn len_after(&mut self, m: u8) -> Option<usize> {
        Some(match m {
            0x80..=0x9f => usize::from(m & 0x0f),
            0xa0..=0xbf => usize::from(m & 0x1f),
            0xc4 | 0xc7 | 0xd9 => self.be(1)? as usize,
            0xc5 | 0xc8 | 0xda | 0xdc | 0xde => self.be(2)? as usize,
            0xc6 | 0xc9 | 0xdb | 0xdd | 0xdf => self.be(4)? as usize,
            0xd4 => 1,
            0xd5 => 2,
            0xd6 => 4,
            0xd7 => 8,
            0xd8 => 16,
            _ => 0,
        })
    }

    /// Checks one value, with rmpv's depth accounting: a value takes one level, an array's or
    /// map's elements one more, a string two more (string, then bytes), binary data one,
    /// extension data two.
    fn check(&mut self, depth: u16) -> Option<()> {
        let depth = depth.checked_sub(1)?;
        let m = self.byte()?;
        let plain = PLAIN[usize::from(m)];
        if plain != NOT_PLAIN {
            self.take(usize::from(plain))?;
            return Some(());
        }
        let len = self.len_after(m)?;
        match m {
            0xa0..=0xbf | 0xd9..=0xdb => {
                depth.checked_sub(2)?;
                self.take(len)?;
            }
            0xc4..=0xc6 => {
                depth.checked_sub(1)?;
                self.take(len)?;
            }
            0xc7..=0xc9 | 0xd4..=0xd8 => {
                depth.checked_sub(2)?;
                self.take(len + 1)?;
            }
            _ => {
                let inner = depth.checked_sub(1)?;
                let items = if matches!(m, 0x80..=0x8f | 0xde | 0xdf) { 2 * len } else { len };
                for _ in 0..items {
                    // Plain elements inline (the common case: token ids, hashes).
                    let m = *self.buf.get(self.pos)?;
                    let plain = PLAIN[usize::from(m)];
                    if plain != NOT_PLAIN && inner >= 1 {
                        self.take(1 + usize::from(plain))?;
                    } else {
                        self.check(inner)?;
                    }
                }
            }
        }
        Some(())
    }

    /// Skips a checked value.
    fn skip(&mut self) -> Option<()> {
        let mut pending = 1usize;
        while pending > 0 {
            pending -= 1;
            let m = self.byte()?;
            let plain = PLAIN[usize::from(m)];
            if plain != NOT_PLAIN {
                self.take(usize::from(plain))?;
                continue;
            }
            let len = self.len_after(m)?;
            match m {
                0x80..=0x8f | 0xde | 0xdf => pending = pending.checked_add(len.checked_mul(2)?)?,
                0x90..=0x9f | 0xdc | 0xdd => pending = pending.checked_add(len)?,
                0xc7..=0xc9 | 0xd4..=0xd8 => drop(self.take(len.checked_add(1)?)?),
                _ => drop(self.take(len)?),
            }
        }
        Some(())
    }

    /// Reads a checked value's head; scalars are consumed whole, containers leave the reader
    /// on their first element.
    fn read(&mut self) -> Option<Val<'a>> {
        let m = self.byte()?;
        Some(match m {
            0x00..=0x7f => Val::Int(Int::Pos(u64::from(m))),
            0xe0..=0xff => Val::Int(Int::Neg(i64::from(m as i8))),
            0xc0 | 0xc1 => Val::Nil, // 0xc1 is reserved; rmpv reads it as nil
            0xc2 | 0xc3 => Val::Bool,
            0xca => Val::Float(f64::from(f32::from_bits(self.be(4)? as u32))),
            0xcb => Val::Float(f64::from_bits(self.be(8)?)),
            0xcc => Val::Int(Int::Pos(self.be(1)?)),
            0xcd => Val::Int(Int::Pos(self.be(2)?)),
            0xce => Val::Int(Int::Pos(self.be(4)?)),
            0xcf => Val::Int(Int::Pos(self.be(8)?)),
            0xd0 => Val::Int(Int::signed(i64::from(self.be(1)? as u8 as i8))),
            0xd1 => Val::Int(Int::signed(i64::from(self.be(2)? as u16 as i16))),
            0xd2 => Val::Int(Int::signed(i64::from(self.be(4)? as u32 as i32))),
            0xd3 => Val::Int(Int::signed(self.be(8)? as i64)),
            _ => {
                let len = self.len_after(m)?;
                match m {
                    0x80..=0x8f | 0xde | 0xdf => Val::Map(len),
                    0x90..=0x9f | 0xdc | 0xdd => Val::Array(len),
                    0xa0..=0xbf | 0xd9..=0xdb => Val::Str(self.take(len)?),
                    0xc4..=0xc6 => Val::Bin(self.take(len)?),
                    _ => {
                        self.take(len.checked_add(1)?)?;
                        Val::Ext
                    }
                }
            }
        })
    }

    /// Reads a checked value whole: containers are skipped past.
    fn value(&mut self) -> Option<Val<'a>> {
        let v = self.read()?;
        match v {
            Val::Array(n) => (0..n).try_for_each(|_| self.skip())?,
            Val::Map(n) => (0..2 * n).try_for_each(|_| self.skip())?,
            _ => {}
        }
        Some(v)
    }

    /// A token id: a non-negative integer that fits `u32` (`None` for anything else, with the
    /// reader then somewhere inside that value).
    #[inline]
    fn token_id(&mut self) -> Option<u32> {
        let (buf, p) = (self.buf, self.pos);
        let m = *buf.get(p)?;
        let (v, len) = match m {
            0x00..=0x7f => (u64::from(m), 1),
            0xcc => (u64::from(*buf.get(p + 1)?), 2),
            0xcd => (u64::from(u16::from_be_bytes(buf.get(p + 1..p + 3)?.try_into().ok()?)), 3),
            0xce => (u64::from(u32::from_be_bytes(buf.get(p + 1..p + 5)?.try_into().ok()?)), 5),
            0xcf => (u64::from_be_bytes(buf.get(p + 1..p + 9)?.try_into().ok()?), 9),
            0xd0 => (i64::from(*buf.get(p + 1)? as i8) as u64, 2),
            0xd1 => (i64::from(i16::from_be_bytes(buf.get(p + 1..p + 3)?.try_into().ok()?)) as u64, 3),
            0xd2 => (i64::from(i32::from_be_bytes(buf.get(p + 1..p + 5)?.try_into().ok()?)) as u64, 5),
            0xd3 => (u64::from_be_bytes(buf.get(p + 1..p + 9)?.try_into().ok()?), 9),
            _ => return None,
        };
        self.pos = p + len;
        u32::try_from(v).ok()
    }

    /// Reads a `token_ids` value (left after it): `None` when nil.
    fn token_ids(&mut self) -> Result<Option<Vec<u32>>, DecodeError> {
        let start = self.pos;
        match self.read().ok_or_else(malformed)? {
            Val::Nil => Ok(None),
            Val::Array(n) => {
                let mut ids = Vec::with_capacity(n.min(self.buf.len()));
                for k in 0..n {
                    let at = self.pos;
                    match self.token_id() {
                        Some(id) => ids.push(id),
                        None => {
                            self.pos = at;
                            (k..n).try_for_each(|_| self.skip()).ok_or_else(malformed)?;
                            return Err(shape("token id out of range"));
                        }
                    }
                }
                Ok(Some(ids))
            }
            _ => {
                self.pos = start;
                self.skip().ok_or_else(malformed)?;
                Err(shape("token_ids is not an array"))
            }
        }
    }
}

/// Map keys an event's fields can have (`type` first).
pub(super) const NAMES: [&str; 9] = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "cache_salt",
];
const TYPE: usize = 0;
const BLOCK_HASHES: usize = 1;
const PARENT: usize = 2;
const TOKEN_IDS: usize = 3;
const BLOCK_SIZE: usize = 4;
const LORA_ID: usize = 5;
const MEDIUM: usize = 6;
const LORA_NAME: usize = 7;
const CACHE_SALT: usize = 8;

/// Where an event's fields are (first occurrence), by their position in `NAMES`.
struct Fields<'a> {
    buf: &'a [u8],
    at: [Option<usize>; NAMES.len()],
    /// `token_ids`, decoded while the fields are found (its error kept for `BlockStored`).
    tokens: Result<Option<Vec<u32>>, DecodeError>,
}

impl<'a> Fields<'a> {
    /// A present, non-nil field, and a reader after its head.
    fn get(&self, field: usize) -> Result<Option<(Val<'a>, Reader<'a>)>, DecodeError> {
        let Some(pos) = self.at[field] else { return Ok(None) };
        let mut r = Reader::at(self.buf, pos);
        let v = r.read().ok_or_else(malformed)?;
        Ok(if matches!(v, Val::Nil) { None } else { Some((v, r)) })
    }

    fn str(&self, field: usize) -> Result<Option<String>, DecodeError> {
        Ok(self.get(field)?.and_then(|(v, _)| v.as_str()).map(str::to_owned))
    }
}

pub(super) fn decode_batch(bytes: &[u8]) -> Result<EventBatch, DecodeError> {
    let mut check = Reader::at(bytes, 0);
    if check.check(MAX_DEPTH as u16).is_none() {
        return Err(DecodeError::Msgpack(format!(
            "not one msgpack value within depth {MAX_DEPTH} (stopped at byte {} of {})",
            check.pos,
            bytes.len()
        )));
    }
    if check.pos != bytes.len() {
        return Err(shape(format!("{} trailing bytes after the batch", bytes.len() - check.pos)));
    }
    let mut r = Reader::at(bytes, 0);
    let top = r.read().ok_or_else(malformed)?;
    // Where ts and events are; the rank is found after the events (array) or here (map).
    let (ts, events, rank) = match top {
        Val::Array(n) if (2..=3).contains(&n) => {
            let ts = r.value().ok_or_else(malformed)?;
            (ts, r.pos, if n == 3 { Rank::AfterEvents } else { Rank::Absent })
        }
        Val::Map(n) => {
            let mut found = [None; 3];
            for _ in 0..n {
                let key = r.value().ok_or_else(malformed)?;
                if let Some(i) =
                    key.as_str().and_then(|k| ["ts", "events", "data_parallel_rank"].iter().position(|n| *n == k))
                {
                    found[i].get_or_insert(r.pos);
                }
                r.skip().ok_or_else(malformed)?;
            }
            let ts = found[0].ok_or_else(|| shape("batch map without ts"))?;
            let events = found[1].ok_or_else(|| shape("batch map without events"))?;
            let ts = Reader::at(bytes, ts).read().ok_or_else(malformed)?;
            (ts, events, found[2].map_or(Rank::Absent, Rank::At))
        }
        other => return Err(shape(format!("batch is {}", other.kind()))),
    };
    let ts = ts.as_f64().ok_or_else(|| shape("ts is not a number"))?;
    let mut er = Reader::at(bytes, events);
    let Some(Val::Array(count)) = er.read() else { return Err(shape("events is not an array")) };
    // Events decode in place; the first failure is reported after the rank is checked (as
    // the value-tree decoder did), so the rank is found by skipping what is left.
    let mut out = Vec::with_capacity(count.min(bytes.len()));
    let mut failed = None;
    for k in 0..count {
        match decode_event(bytes, &mut er) {
            Ok(event) => out.push(event),
            Err(e) => {
                failed = Some(e);
                (k + 1..count).try_for_each(|_| er.skip()).ok_or_else(malformed)?;
                break;
            }
        }
    }
    let rank = match rank {
        Rank::Absent => None,
        Rank::AfterEvents => Some(er.read().ok_or_else(malformed)?),
        Rank::At(pos) => Some(Reader::at(bytes, pos).read().ok_or_else(malformed)?),
    };
    let dp_rank = match rank {
        None | Some(Val::Nil) => None,
        Some(v) => Some(v.as_i64().ok_or_else(|| shape("data_parallel_rank is not an integer"))?),
    };
    if let Some(e) = failed {
        return Err(e);
    }
    Ok(EventBatch { ts, events: out, dp_rank })
}

enum Rank {
    Absent,
    AfterEvents,
    At(usize),
}

/// Decodes the event at `r`, leaving `r` after it (when it succeeds).
fn decode_event<'a>(bytes: &'a [u8], r: &mut Reader<'a>) -> Result<KvEvent, DecodeError> {
    let head = r.read().ok_or_else(malformed)?;
    let mut fields = Fields { buf: bytes, at: [None; NAMES.len()], tokens: Ok(None) };
    let tag = match head {
        Val::Map(n) => {
            for _ in 0..n {
                let key = r.value().ok_or_else(malformed)?;
                match key.as_str().and_then(|k| NAMES.iter().position(|n| *n == k)) {
                    Some(TOKEN_IDS) if fields.at[TOKEN_IDS].is_none() => {
                        fields.at[TOKEN_IDS] = Some(r.pos);
                        fields.tokens = r.token_ids();
                    }
                    Some(i) => {
                        fields.at[i].get_or_insert(r.pos);
                        r.skip().ok_or_else(malformed)?;
                    }
                    None => r.skip().ok_or_else(malformed)?,
                }
            }
            fields.get(TYPE)?.and_then(|(v, _)| v.as_str())
        }
        Val::Array(n) if n > 0 => {
            let tag = r.value().ok_or_else(malformed)?.as_str();
            // Legacy arrays: fields by position, in the tag's field order.
            let names: &[&str] = match tag {
                Some("BlockStored") => STORED,
                Some("BlockRemoved") => REMOVED,
                _ => &[],
            };
            for k in 0..n - 1 {
                let field = names.get(k).map(|name| NAMES.iter().position(|n| n == name).expect("a known field"));
                if let Some(i) = field {
                    fields.at[i] = Some(r.pos);
                }
                if field == Some(TOKEN_IDS) {
                    fields.tokens = r.token_ids();
                } else {
                    r.skip().ok_or_else(malformed)?;
                }
            }
            tag
        }
        other => {
            if let Val::Array(n) | Val::Map(n) = other {
                // An empty array: nothing to skip; keep the reader consistent anyway.
                (0..n).try_for_each(|_| r.skip()).ok_or_else(malformed)?;
            }
            None
        }
    }
    .ok_or_else(|| shape(format!("event is {} without a type tag", head.kind())))?;
    match tag {
        "BlockStored" => {
            let token_ids = std::mem::replace(&mut fields.tokens, Ok(None))?.unwrap_or_default();
            let block_hashes = hashes(fields.get(BLOCK_HASHES)?)?;
            let parent_block_hash = fields.get(PARENT)?.map(|(v, _)| hash(v)).transpose()?;
            let block_size = fields
                .get(BLOCK_SIZE)?
                .and_then(|(v, _)| v.as_u64())
                .and_then(|v| u32::try_from(v).ok())
                .ok_or_else(|| shape("block_size missing or invalid"))?;
            // SGLang and vLLM send an integer or nothing; anything else must not read as "no
            // adapter", which would mix the adapter's blocks with the base model's.
            let lora_id = match fields.get(LORA_ID)? {
                None => None,
                Some((v, _)) => Some(v.as_i64().ok_or_else(|| shape("lora_id is not an integer"))?),
            };
            let lora_name = match fields.get(LORA_NAME)? {
                None => None,
                Some((v, _)) => Some(v.as_str().ok_or_else(|| shape("lora_name is not a string"))?.to_owned()),
            };
            Ok(KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                lora_id,
                medium: fields.str(MEDIUM)?,
                lora_name,
                cache_salt: fields.str(CACHE_SALT)?,
            })
        }
        "BlockRemoved" => {
            Ok(KvEvent::BlockRemoved { block_hashes: hashes(fields.get(BLOCK_HASHES)?)?, medium: fields.str(MEDIUM)? })
        }
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        other => Ok(KvEvent::Other { kind: other.to_string() }),
    }
}

fn hashes(value: Option<(Val<'_>, Reader<'_>)>) -> Result<Vec<BlockHash>, DecodeError> {
    match value {
        None => Ok(Vec::new()),
        Some((Val::Array(n), mut items)) => {
            let mut out = Vec::with_capacity(n.min(items.buf.len()));
            for _ in 0..n {
                // A container fails `hash`, so heads are whole values here.
                out.push(hash(items.read().ok_or_else(malformed)?)?);
            }
            Ok(out)
        }
        Some(_) => Err(shape("block_hashes is not an array")),
    }
}

fn hash(value: Val<'_>) -> Result<BlockHash, DecodeError> {
    match value {
        Val::Int(Int::Pos(n)) => Ok(BlockHash::Int(n)),
        Val::Int(Int::Neg(n)) => Ok(BlockHash::Int(n as u64)),
        Val::Bin(bytes) => Ok(BlockHash::Bytes(bytes.to_vec())),
        other => Err(shape(format!("block hash is {}", other.kind()))),
    }
}
