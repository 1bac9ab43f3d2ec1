//! vLLM's KV-cache event batches (msgpack), encoded in the current or legacy form and decoded
//! from every form seen in vLLM and SGLang (see `shared/PROTOCOLS.md` §2).
//!
//! Batch: `[ts, events, data_parallel_rank]` (older: `[ts, events]`; a map with those keys is
//! accepted too). Event: a map tagged by `"type"` (current) or an array whose first element is
//! the tag (before mid-2026). Unknown keys are ignored, missing optional keys are `None`, hashes
//! are unsigned, signed (SGLang) or raw digest bytes.

use rmpv::Value;

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

#[derive(Clone, Debug, PartialEq)]
pub struct EventBatch {
    pub ts: f64,
    pub events: Vec<KvEvent>,
    pub dp_rank: Option<i64>,
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

const STORED: &[&str] =
    &["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"];
const REMOVED: &[&str] = &["block_hashes", "medium"];

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
                lora_id: f.get("lora_id").and_then(Value::as_i64),
                medium: f.get("medium").and_then(Value::as_str).map(str::to_owned),
                lora_name: f.get("lora_name").and_then(Value::as_str).map(str::to_owned),
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
        KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name } => {
            (
                "BlockStored",
                vec![
                    ("block_hashes", Value::Array(block_hashes.iter().map(hash_value).collect())),
                    ("parent_block_hash", parent_block_hash.as_ref().map(hash_value).unwrap_or(Value::Nil)),
                    ("token_ids", Value::Array(token_ids.iter().map(|&t| Value::from(t)).collect())),
                    ("block_size", Value::from(*block_size)),
                    ("lora_id", opt(*lora_id)),
                    ("medium", opt(medium.clone())),
                    ("lora_name", opt(lora_name.clone())),
                ],
            )
        }
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
}
