//! Structure-aware: a batch built from the input is encoded, checked to round-trip, then
//! mutated byte by byte (flips, truncation, splices) and decoded again, which must not panic.
#![no_main]

use arbitrary::{Arbitrary, Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use pd_protocols::kv_events::{decode_batch, encode_batch, BlockHash, EventBatch, EventFormat, KvEvent};

fn hash(u: &mut Unstructured<'_>) -> Result<BlockHash> {
    Ok(match bool::arbitrary(u)? {
        true => BlockHash::Int(u64::arbitrary(u)?),
        false => BlockHash::Bytes(Vec::<u8>::arbitrary(u)?.into_iter().take(40).collect()),
    })
}

fn hashes(u: &mut Unstructured<'_>) -> Result<Vec<BlockHash>> {
    (0..u.int_in_range(0..=8)?).map(|_| hash(u)).collect()
}

fn small_string(u: &mut Unstructured<'_>) -> Result<Option<String>> {
    Ok(Option::<String>::arbitrary(u)?.map(|s| s.chars().take(16).collect()))
}

fn event(u: &mut Unstructured<'_>) -> Result<KvEvent> {
    Ok(match u.int_in_range(0..=3)? {
        0 => KvEvent::BlockStored {
            block_hashes: hashes(u)?,
            parent_block_hash: if bool::arbitrary(u)? { Some(hash(u)?) } else { None },
            token_ids: (0..u.int_in_range(0..=32)?).map(|_| u32::arbitrary(u)).collect::<Result<_>>()?,
            block_size: u32::arbitrary(u)?,
            lora_id: Option::<i64>::arbitrary(u)?,
            medium: small_string(u)?,
            lora_name: small_string(u)?,
            cache_salt: small_string(u)?,
        },
        1 => KvEvent::BlockRemoved { block_hashes: hashes(u)?, medium: small_string(u)? },
        2 => KvEvent::AllBlocksCleared,
        _ => KvEvent::Other { kind: format!("Unknown{}", u8::arbitrary(u)?) },
    })
}

fn batch(u: &mut Unstructured<'_>) -> Result<EventBatch> {
    let ts = f64::from(u32::arbitrary(u)?) / 1000.0;
    let events = (0..u.int_in_range(0..=6)?).map(|_| event(u)).collect::<Result<_>>()?;
    Ok(EventBatch { ts, events, dp_rank: Option::<i64>::arbitrary(u)? })
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let Ok(batch) = batch(&mut u) else { return };
    let format = if data.first().is_some_and(|b| b & 1 == 1) { EventFormat::LegacyArray } else { EventFormat::TaggedMap };
    let encoded = encode_batch(&batch, format);
    assert_eq!(decode_batch(&encoded).as_ref(), Ok(&batch));
    let mut mutated = encoded.clone();
    // At most 16 mutations, and none once the input is used up (`Unstructured` then keeps
    // answering with defaults).
    for _ in 0..16 {
        if u.is_empty() {
            break;
        }
        let Ok(step) = u.int_in_range(0..=2u8) else { break };
        let Ok(at) = u.choose_index(mutated.len().max(1)) else { break };
        match step {
            0 if !mutated.is_empty() => mutated[at] ^= u8::arbitrary(&mut u).unwrap_or(1).max(1),
            1 => mutated.truncate(at),
            _ => {
                let splice = encoded[at.min(encoded.len())..].to_vec();
                mutated.extend_from_slice(&splice);
            }
        }
        let _ = decode_batch(&mutated);
    }
});
