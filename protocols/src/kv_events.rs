//! vLLM's KV-cache event batches (msgpack), encoded in the current or legacy form and decoded
//! from every form seen in vLLM and SGLang (see `shared/PROTOCOLS.md` §2).
//!
//! Batch: `[ts, events, data_parallel_rank]` (older: `[ts, events]`; a map with those keys is
//! accepted too). Event: a map tagged by `"type"` (current) or an array whose first element is
//! the tag (before mid-2026). Unknown keys are ignored, missing optional keys are `None`, hashes
//! are unsigned, signed (SGLang) or raw digest bytes.

use rmpv::Value;

mod stream;

/// A block hash as an event carries it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum BlockHash {
    /// The integer form; SGLang's negative i64 values are kept bit for bit.
    Int(u64),
    /// The raw digest (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    Bytes(Vec<u8>),
}

impl BlockHash {
    /// The integer key: the value itself, or the digest's last 8 bytes big-endian (the same
    /// number vLLM would have sent in integer mode).
    #[inline]
    pub fn as_u64(&self) -> u64 {
        match self {
            BlockHash::Int(v) => *v,
            BlockHash::Bytes(bytes) => {
                let mut tail = [0u8; 8];
                let n = bytes.len().min(8);
                tail[8 - n..].copy_from_slice(&bytes[bytes.len() - n..]);
                u64::from_be_bytes(tail)
            }
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    BlockStored {
        block_hashes: Vec<BlockHash>,
        parent_block_hash: Option<BlockHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<i64>,
        medium: Option<String>,
        lora_name: Option<String>,
        /// SGLang's `cache_salt`: the salt its page chain starts from (absent elsewhere).
        cache_salt: Option<String>,
    },
    BlockRemoved {
        block_hashes: Vec<BlockHash>,
        medium: Option<String>,
    },
    AllBlocksCleared,
    /// An event type this version does not know; skipped by consumers, counted if they like.
    Other {
        kind: String,
    },
}

impl KvEvent {
    /// The blocks this event stores or removes (none for the other kinds).
    pub fn block_count(&self) -> usize {
        match self {
            KvEvent::BlockStored { block_hashes, .. } | KvEvent::BlockRemoved { block_hashes, .. } => {
                block_hashes.len()
            }
            KvEvent::AllBlocksCleared | KvEvent::Other { .. } => 0,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub dp_rank: Option<i64>,
}

impl EventBatch {
    /// Block events: the blocks its events store or remove.
    pub fn block_count(&self) -> usize {
        self.events.iter().map(KvEvent::block_count).sum()
    }
}

/// How events are laid out when encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum EventFormat {
    /// Maps tagged by `"type"` (vLLM 0.32).
    #[default]
    TaggedMap,
    /// Arrays whose first element is the tag (older vLLM).
    LegacyArray,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("not msgpack: {0}")]
    Msgpack(String),
    #[error("unexpected shape: {0}")]
    Shape(String),
}

/// Nesting deeper than this is not an event batch (and would only cost stack).
const MAX_DEPTH: usize = 16;

fn shape(what: impl Into<String>) -> DecodeError {
    DecodeError::Shape(what.into())
}

/// Decodes one PUB message's payload (every form above). Never panics on untrusted bytes.
pub fn decode_batch(bytes: &[u8]) -> Result<EventBatch, DecodeError> {
    stream::decode_batch(bytes)
}

/// Legacy event arrays: the fields after the tag, in order (`cache_salt` is only ever in maps,
/// SGLang's; it is last here so that the encoder's legacy form round-trips).
const STORED: &[&str] =
    &["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "cache_salt"];
const REMOVED: &[&str] = &["block_hashes", "medium"];

fn hash_value(hash: &BlockHash) -> Value {
    match hash {
        BlockHash::Int(v) => Value::from(*v),
        BlockHash::Bytes(b) => Value::Binary(b.clone()),
    }
}

fn opt<T: Into<Value>>(value: Option<T>) -> Value {
    value.map(Into::into).unwrap_or(Value::Nil)
}

fn event_value(event: &KvEvent, format: EventFormat) -> Value {
    let (tag, fields): (&str, Vec<(&str, Value)>) = match event {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            medium,
            lora_name,
            cache_salt,
        } => (
            "BlockStored",
            vec![
                ("block_hashes", Value::Array(block_hashes.iter().map(hash_value).collect())),
                ("parent_block_hash", parent_block_hash.as_ref().map(hash_value).unwrap_or(Value::Nil)),
                ("token_ids", Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect())),
                ("block_size", Value::from(*block_size)),
                ("lora_id", opt(*lora_id)),
                ("medium", opt(medium.clone())),
                ("lora_name", opt(lora_name.clone())),
                ("cache_salt", opt(cache_salt.clone())),
            ],
        ),
        KvEvent::BlockRemoved { block_hashes, medium } => (
            "BlockRemoved",
            vec![
                ("block_hashes", Value::Array(block_hashes.iter().map(hash_value).collect())),
                ("medium", opt(medium.clone())),
            ],
        ),
        KvEvent::AllBlocksCleared => ("AllBlocksCleared", vec![]),
        KvEvent::Other { kind } => (kind.as_str(), vec![]),
    };
    match format {
        EventFormat::TaggedMap => Value::Map(
            std::iter::once((Value::from("type"), Value::from(tag)))
                .chain(fields.into_iter().map(|(k, v)| (Value::from(k), v)))
                .collect(),
        ),
        EventFormat::LegacyArray => {
            Value::Array(std::iter::once(Value::from(tag)).chain(fields.into_iter().map(|(_, v)| v)).collect())
        }
    }
}

/// The msgpack payload of one PUB message.
pub fn encode_batch(batch: &EventBatch, format: EventFormat) -> Vec<u8> {
    let value = Value::Array(vec![
        Value::F64(batch.ts),
        Value::Array(batch.events.iter().map(|e| event_value(e, format)).collect()),
        opt(batch.dp_rank),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &value).expect("writing to a Vec cannot fail");
    out
}

/// The value-tree decoder `decode_batch` replaced, kept as the reference it is tested against.
#[cfg(test)]
mod reference {
    use super::*;

    pub fn decode_batch(bytes: &[u8]) -> Result<EventBatch, DecodeError> {
        let mut reader = bytes;
        let value = rmpv::decode::read_value_with_max_depth(&mut reader, MAX_DEPTH)
            .map_err(|e| DecodeError::Msgpack(e.to_string()))?;
        if !reader.is_empty() {
            return Err(shape(format!("{} trailing bytes after the batch", reader.len())));
        }
        let (ts, events, rank) = match &value {
            Value::Array(items) if (2..=3).contains(&items.len()) => (&items[0], &items[1], items.get(2)),
            Value::Map(_) => (
                field(&value, "ts").ok_or_else(|| shape("batch map without ts"))?,
                field(&value, "events").ok_or_else(|| shape("batch map without events"))?,
                field(&value, "data_parallel_rank"),
            ),
            other => return Err(shape(format!("batch is {}", kind_of(other)))),
        };
        let ts = ts.as_f64().or_else(|| ts.as_i64().map(|v| v as f64)).ok_or_else(|| shape("ts is not a number"))?;
        let events = events.as_array().ok_or_else(|| shape("events is not an array"))?;
        let dp_rank = match rank {
            None | Some(Value::Nil) => None,
            Some(v) => Some(v.as_i64().ok_or_else(|| shape("data_parallel_rank is not an integer"))?),
        };
        let events = events.iter().map(decode_event).collect::<Result<_, _>>()?;
        Ok(EventBatch { ts, events, dp_rank })
    }

    fn kind_of(value: &Value) -> &'static str {
        match value {
            Value::Nil => "nil",
            Value::Boolean(_) => "a boolean",
            Value::Integer(_) => "an integer",
            Value::F32(_) | Value::F64(_) => "a float",
            Value::String(_) => "a string",
            Value::Binary(_) => "binary",
            Value::Array(_) => "an array",
            Value::Map(_) => "a map",
            Value::Ext(..) => "an extension",
        }
    }

    fn field<'a>(map: &'a Value, key: &str) -> Option<&'a Value> {
        map.as_map()?.iter().find(|(k, _)| k.as_str() == Some(key)).map(|(_, v)| v)
    }

    /// Field accessor over either layout: by name in a map, by position in a legacy array.
    struct Fields<'a> {
        value: &'a Value,
        names: &'static [&'static str],
    }

    impl<'a> Fields<'a> {
        fn get(&self, name: &str) -> Option<&'a Value> {
            let found = match self.value {
                Value::Map(_) => field(self.value, name),
                Value::Array(items) => {
                    let index = self.names.iter().position(|n| *n == name)?;
                    items.get(index + 1)
                }
                _ => None,
            };
            found.filter(|v| !v.is_nil())
        }
    }

    fn decode_event(value: &Value) -> Result<KvEvent, DecodeError> {
        let tag = match value {
            Value::Map(_) => field(value, "type").and_then(Value::as_str),
            Value::Array(items) => items.first().and_then(Value::as_str),
            _ => None,
        }
        .ok_or_else(|| shape(format!("event is {} without a type tag", kind_of(value))))?;
        match tag {
            "BlockStored" => {
                let f = Fields { value, names: STORED };
                let token_ids = match f.get("token_ids") {
                    None => Vec::new(),
                    Some(v) => v
                        .as_array()
                        .ok_or_else(|| shape("token_ids is not an array"))?
                        .iter()
                        .map(|t| {
                            t.as_u64().and_then(|t| u32::try_from(t).ok()).ok_or_else(|| shape("token id out of range"))
                        })
                        .collect::<Result<_, _>>()?,
                };
                Ok(KvEvent::BlockStored {
                    block_hashes: hashes(f.get("block_hashes"))?,
                    parent_block_hash: f.get("parent_block_hash").map(hash).transpose()?,
                    token_ids,
                    block_size: f
                        .get("block_size")
                        .and_then(Value::as_u64)
                        .and_then(|v| u32::try_from(v).ok())
                        .ok_or_else(|| shape("block_size missing or invalid"))?,
                    lora_id: f
                        .get("lora_id")
                        .map(|v| v.as_i64().ok_or_else(|| shape("lora_id is not an integer")))
                        .transpose()?,
                    medium: f.get("medium").and_then(Value::as_str).map(str::to_owned),
                    lora_name: f
                        .get("lora_name")
                        .map(|v| v.as_str().map(str::to_owned).ok_or_else(|| shape("lora_name is not a string")))
                        .transpose()?,
                    cache_salt: f.get("cache_salt").and_then(Value::as_str).map(str::to_owned),
                })
            }
            "BlockRemoved" => {
                let f = Fields { value, names: REMOVED };
                Ok(KvEvent::BlockRemoved {
                    block_hashes: hashes(f.get("block_hashes"))?,
                    medium: f.get("medium").and_then(Value::as_str).map(str::to_owned),
                })
            }
            "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
            other => Ok(KvEvent::Other { kind: other.to_string() }),
        }
    }

    fn hashes(value: Option<&Value>) -> Result<Vec<BlockHash>, DecodeError> {
        match value {
            None => Ok(Vec::new()),
            Some(v) => v.as_array().ok_or_else(|| shape("block_hashes is not an array"))?.iter().map(hash).collect(),
        }
    }

    fn hash(value: &Value) -> Result<BlockHash, DecodeError> {
        match value {
            Value::Integer(i) => i
                .as_u64()
                .or_else(|| i.as_i64().map(|v| v as u64))
                .map(BlockHash::Int)
                .ok_or_else(|| shape("block hash out of range")),
            Value::Binary(bytes) => Ok(BlockHash::Bytes(bytes.clone())),
            other => Err(shape(format!("block hash is {}", kind_of(other)))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> KvEvent {
        KvEvent::BlockStored {
            block_hashes: vec![BlockHash::Int(2233398808101521225), BlockHash::Int(7)],
            parent_block_hash: None,
            token_ids: (0..32).collect(),
            block_size: 16,
            lora_id: None,
            medium: Some("GPU".into()),
            lora_name: None,
            cache_salt: None,
        }
    }

    fn batch() -> EventBatch {
        EventBatch {
            ts: 1764000000.25,
            events: vec![
                stored(),
                KvEvent::BlockRemoved { block_hashes: vec![BlockHash::Int(7)], medium: Some("GPU".into()) },
                KvEvent::AllBlocksCleared,
            ],
            dp_rank: Some(0),
        }
    }

    #[test]
    fn both_formats_round_trip() {
        for format in [EventFormat::TaggedMap, EventFormat::LegacyArray] {
            assert_eq!(decode_batch(&encode_batch(&batch(), format)).unwrap(), batch(), "{format:?}");
        }
    }

    fn pack(value: Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, &value).unwrap();
        out
    }

    #[test]
    fn decodes_other_engines_forms() {
        // Older two-element batch, SGLang-style signed hashes, digest bytes, unknown keys and
        // an event type from the future.
        let event = Value::Map(vec![
            (Value::from("type"), Value::from("BlockStored")),
            (Value::from("block_hashes"), Value::Array(vec![Value::from(-5i64), Value::Binary(vec![0xab; 32])])),
            (Value::from("token_ids"), Value::Array(vec![Value::from(1u32)])),
            (Value::from("block_size"), Value::from(1u32)),
            (Value::from("locality"), Value::from("local")),
        ]);
        let future = Value::Map(vec![(Value::from("type"), Value::from("BlockPinned"))]);
        let bytes = pack(Value::Array(vec![Value::from(12i64), Value::Array(vec![event, future])]));
        let batch = decode_batch(&bytes).unwrap();
        assert_eq!(batch.ts, 12.0);
        assert_eq!(batch.dp_rank, None);
        match &batch.events[0] {
            KvEvent::BlockStored { block_hashes, medium, .. } => {
                assert_eq!(block_hashes[0], BlockHash::Int(-5i64 as u64));
                assert_eq!(block_hashes[1].as_u64(), u64::from_be_bytes([0xab; 8]));
                assert_eq!(*medium, None);
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(batch.events[1], KvEvent::Other { kind: "BlockPinned".into() });
    }

    /// SGLang and vLLM send `lora_id` as an integer or nil (SGLang: always nil; its adapter ids
    /// are uuid strings kept inside the engine). Anything else is refused rather than read as
    /// "no adapter", which would file the adapter's blocks under the base model.
    #[test]
    fn an_adapter_field_of_the_wrong_type_is_a_typed_error() {
        let with = |field: &str, value: Value| {
            let event = Value::Map(vec![
                (Value::from("type"), Value::from("BlockStored")),
                (Value::from("block_hashes"), Value::Array(vec![Value::from(-5i64)])),
                (Value::from("parent_block_hash"), Value::Nil),
                (Value::from("token_ids"), Value::Array(vec![Value::from(7)])),
                (Value::from("block_size"), Value::from(1)),
                (Value::from(field), value),
            ]);
            decode_batch(&pack(Value::Array(vec![Value::F64(1.0), Value::Array(vec![event]), Value::Nil])))
        };
        let uuid = Value::from("36b09d3969115dbabfa4b66a8167fdb6");
        assert_eq!(with("lora_id", uuid.clone()), Err(DecodeError::Shape("lora_id is not an integer".into())));
        assert_eq!(with("lora_name", Value::from(3)), Err(DecodeError::Shape("lora_name is not a string".into())));
        let ok = with("lora_id", Value::Nil).unwrap();
        assert!(matches!(&ok.events[0], KvEvent::BlockStored { lora_id: None, lora_name: None, .. }));
        let named = with("lora_name", Value::from("sql-lora")).unwrap();
        assert!(matches!(&named.events[0], KvEvent::BlockStored { lora_name: Some(n), .. } if n == "sql-lora"));
    }

    #[test]
    fn rejects_garbage_without_panicking() {
        assert!(matches!(decode_batch(b""), Err(DecodeError::Msgpack(_))));
        assert!(matches!(decode_batch(&pack(Value::from("x"))), Err(DecodeError::Shape(_))));
        let no_tag = pack(Value::Array(vec![Value::F64(1.0), Value::Array(vec![Value::Array(vec![Value::from(3)])])]));
        assert!(matches!(decode_batch(&no_tag), Err(DecodeError::Shape(_))));
        let mut deep = vec![0x91u8; 10_000];
        deep.push(0xc0);
        assert!(decode_batch(&deep).is_err());
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let valid = encode_batch(&batch(), EventFormat::TaggedMap);
        for i in 0..5_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let mut bytes = valid.clone();
            let at = (state as usize) % bytes.len();
            bytes[at] = (state >> 32) as u8;
            bytes.truncate(bytes.len() - (i % 3));
            let _ = decode_batch(&bytes);
        }
    }

    /// Same answer as the value-tree decoder: equal batches, equal shape errors, msgpack errors
    /// for the same inputs.
    fn same_as_reference(bytes: &[u8]) {
        match (decode_batch(bytes), reference::decode_batch(bytes)) {
            (Ok(a), Ok(b)) => assert_eq!(a, b, "{bytes:02x?}"),
            (Err(DecodeError::Shape(a)), Err(DecodeError::Shape(b))) => assert_eq!(a, b, "{bytes:02x?}"),
            (Err(DecodeError::Msgpack(_)), Err(DecodeError::Msgpack(_))) => {}
            (a, b) => panic!("{a:?} but the reference says {b:?} for {bytes:02x?}"),
        }
    }

    struct Gen(u64);

    impl Gen {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }

        /// Any scalar or small container, `depth` levels deep at most.
        fn any(&mut self, depth: u32) -> Value {
            match self.below(if depth == 0 { 9 } else { 11 }) {
                0 => Value::Nil,
                1 => Value::Boolean(self.below(2) == 0),
                2 => Value::from(self.next() >> self.below(64)),
                3 => Value::from(-((self.next() >> (1 + self.below(63))) as i64)),
                4 => Value::F32(self.below(1000) as f32 / 3.0),
                5 => Value::F64(self.next() as f64),
                6 => Value::from(["GPU", "CPU", "BlockStored", "type", "x"][self.below(5) as usize]),
                7 => Value::Binary((0..self.below(40)).map(|i| i as u8).collect()),
                8 => Value::Ext(3, vec![1, 2, 3]),
                9 => Value::Array((0..self.below(4)).map(|_| self.any(depth - 1)).collect()),
                _ => Value::Map((0..self.below(3)).map(|_| (self.any(depth - 1), self.any(depth - 1))).collect()),
            }
        }

        /// A field value: usually the right type, sometimes anything.
        fn field(&mut self, name: &str) -> Value {
            if self.below(8) == 0 {
                return self.any(2);
            }
            match name {
                "type" => {
                    Value::from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"][self.below(4) as usize])
                }
                "block_hashes" => Value::Array((0..self.below(6)).map(|_| self.hash()).collect()),
                "parent_block_hash" => self.hash(),
                "token_ids" => Value::Array(
                    (0..self.below(40)).map(|_| Value::from(self.next() >> (24 + self.below(40)))).collect(),
                ),
                "block_size" => Value::from(self.next() >> (28 + self.below(36))),
                "medium" | "lora_name" | "cache_salt" => Value::from(["GPU", "cpu", "Disk"][self.below(3) as usize]),
                _ => Value::from(self.next() as i64 >> self.below(64)),
            }
        }

        fn hash(&mut self) -> Value {
            match self.below(3) {
                0 => Value::from(self.next()),
                1 => Value::from(-((self.next() >> 1) as i64)),
                _ => Value::Binary((0..self.below(33)).map(|i| i as u8).collect()),
            }
        }

        fn event(&mut self) -> Value {
            // The keys the decoder reads, and two it skips.
            const SKIPPED: [&str; 2] = ["locality", "group_idx"];
            if self.below(3) == 0 {
                // Legacy array: the tag, then fields in order, maybe cut short or nil.
                let tag = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "Unknown"][self.below(4) as usize];
                let names = if tag == "BlockRemoved" { REMOVED } else { STORED };
                let mut items = vec![if self.below(10) == 0 { self.any(1) } else { Value::from(tag) }];
                for name in names.iter().take(self.below(names.len() as u64 + 2) as usize) {
                    items.push(if self.below(6) == 0 { Value::Nil } else { self.field(name) });
                }
                return Value::Array(items);
            }
            let mut pairs = Vec::new();
            for _ in 0..self.below(12) {
                let pick = self.below((stream::NAMES.len() + SKIPPED.len()) as u64) as usize;
                let name = stream::NAMES.get(pick).copied().unwrap_or_else(|| SKIPPED[pick - stream::NAMES.len()]);
                let key = if self.below(20) == 0 { self.any(1) } else { Value::from(name) };
                let value = if self.below(8) == 0 { Value::Nil } else { self.field(name) };
                pairs.push((key, value));
            }
            if self.below(5) != 0 {
                let at = self.below(pairs.len() as u64 + 1) as usize;
                pairs.insert(at, (Value::from("type"), self.field("type")));
            }
            Value::Map(pairs)
        }

        fn batch(&mut self) -> Value {
            let events = Value::Array((0..self.below(5)).map(|_| self.event()).collect());
            let ts = if self.below(10) == 0 { self.any(1) } else { Value::F64(1.7e9) };
            let rank = if self.below(3) == 0 { self.any(1) } else { Value::from(self.below(4)) };
            match self.below(10) {
                0 => Value::Map(vec![
                    (Value::from("events"), events),
                    (Value::from("ts"), ts),
                    (Value::from("data_parallel_rank"), rank),
                    (Value::from("extra"), self.any(2)),
                ]),
                1 => Value::Array(vec![ts, events]),
                2 => self.any(3),
                _ => Value::Array(vec![ts, events, rank]),
            }
        }
    }

    #[test]
    fn decodes_exactly_like_the_value_tree_decoder() {
        let mut gen = Gen(0x9e37_79b9_7f4a_7c15);
        for _ in 0..20_000 {
            let bytes = pack(gen.batch());
            same_as_reference(&bytes);
            // And the same bytes damaged: a byte changed, cut short, or extended.
            let mut damaged = bytes.clone();
            let at = gen.below(damaged.len() as u64) as usize;
            damaged[at] = gen.next() as u8;
            same_as_reference(&damaged);
            same_as_reference(&bytes[..gen.below(bytes.len() as u64) as usize]);
            damaged.push(0xc0);
            same_as_reference(&damaged);
        }
        for form in [EventFormat::TaggedMap, EventFormat::LegacyArray] {
            same_as_reference(&encode_batch(&batch(), form));
        }
    }

    /// Nesting around the depth limit, in every kind of container and leaf, fails or passes as
    /// it did.
    #[test]
    fn depth_limit_as_before() {
        let leaves = [Value::Nil, Value::from(7), Value::from("s"), Value::Binary(vec![1]), Value::Ext(1, vec![2])];
        for leaf in leaves {
            for depth in 0..12 {
                for in_map in [false, true] {
                    let mut v = leaf.clone();
                    for _ in 0..depth {
                        v = if in_map { Value::Map(vec![(Value::from("k"), v)]) } else { Value::Array(vec![v]) };
                    }
                    let event =
                        Value::Map(vec![(Value::from("type"), Value::from("AllBlocksCleared")), (Value::from("x"), v)]);
                    same_as_reference(&pack(Value::Array(vec![Value::F64(1.0), Value::Array(vec![event])])));
                }
            }
        }
    }
}
