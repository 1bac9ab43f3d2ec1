//! `--check`: before a case the source holds the pattern and the destination holds something
//! else; after the last request every destination byte must be the pattern. The pattern is a
//! function of the byte's offset in the *destination*, so each side can produce or verify it.

use anyhow::{bail, Result};
use xfer::Op;

use crate::layout::Layout;
use crate::memory::BenchBuffer;
use crate::pattern;
use crate::raw::{RawConn, RawWorker};
use crate::wire::{encode_ranges, Cmd, Header, Reply};

/// The seed of what the destination holds before a case (anything but the pattern).
fn stale(seed: u64) -> u64 {
    seed ^ 0x5a5a_5a5a_5a5a_5a5a
}

fn control(conn: &mut RawConn, cmd: Cmd, len: u64, seed: u64, payload: &[u8], what: &str) -> Result<()> {
    match conn.call(Header { cmd, len, seed }, payload)? {
        Reply::Ok => Ok(()),
        Reply::Mismatch(offset) => bail!("CHECK FAILED: {what}: target byte at offset {offset} is not the pattern"),
        Reply::Refused(why) => bail!("{what}: the target refused ({why:?})"),
    }
}

/// Raw baseline, before: the source buffer holds the pattern, the destination does not.
pub fn raw_prepare(worker: &mut RawWorker, seed: u64) -> Result<()> {
    let len = worker.buf.len() as u64;
    match worker.op {
        Op::Read => {
            control(&mut worker.conn, Cmd::Fill, len, seed, &[], "filling the target buffer")?;
            worker.buf.fill(0);
        }
        Op::Write => {
            pattern::fill(&mut worker.buf, 0, seed);
            control(&mut worker.conn, Cmd::Fill, len, stale(seed), &[], "clearing the target buffer")?;
        }
    }
    Ok(())
}

/// Raw baseline, after: the destination holds the pattern.
pub fn raw_verify(worker: &mut RawWorker, seed: u64) -> Result<()> {
    match worker.op {
        Op::Read => match pattern::first_mismatch(&worker.buf, 0, seed) {
            None => Ok(()),
            Some(at) => bail!("CHECK FAILED: read data differs from the target's at byte {at}"),
        },
        Op::Write => {
            control(&mut worker.conn, Cmd::Verify, worker.buf.len() as u64, seed, &[], "verifying written data")
        }
    }
}

/// xfer, before: for READ the target's pool holds the pattern and ours is zero; for WRITE each
/// local block holds the pattern of the remote slot it goes to and the target's pool is stale.
pub fn xfer_prepare(op: Op, layout: &Layout, local: &BenchBuffer, conn: &mut RawConn, seed: u64) -> Result<()> {
    let pool = layout.pool_bytes();
    match op {
        Op::Read => {
            control(conn, Cmd::RegionFill, pool, seed, &[], "filling the target region")?;
            let zeros = vec![0u8; layout.block as usize];
            for slot in 0..layout.slots {
                local.write_at(layout.offset(slot) as usize, &zeros)?;
            }
        }
        Op::Write => {
            control(conn, Cmd::RegionFill, pool, stale(seed), &[], "clearing the target region")?;
            let mut block = vec![0u8; layout.block as usize];
            for (l, r) in layout.pairs() {
                pattern::fill(&mut block, layout.offset(r), seed);
                local.write_at(layout.offset(l) as usize, &block)?;
            }
        }
    }
    Ok(())
}

/// xfer, after: every destination block holds the pattern of its remote slot.
pub fn xfer_verify(op: Op, layout: &Layout, local: &BenchBuffer, conn: &mut RawConn, seed: u64) -> Result<()> {
    match op {
        Op::Read => {
            let mut block = vec![0u8; layout.block as usize];
            for (l, r) in layout.pairs() {
                local.read_at(layout.offset(l) as usize, &mut block)?;
                if let Some(at) = pattern::first_mismatch(&block, layout.offset(r), seed) {
                    bail!("CHECK FAILED: local slot {l} (read from remote slot {r}) differs at byte {at} of the block");
                }
            }
            Ok(())
        }
        Op::Write => {
            let ranges: Vec<(u64, u64)> = layout.pairs().map(|(_, r)| (layout.offset(r), layout.block)).collect();
            let payload = encode_ranges(&ranges);
            control(conn, Cmd::RegionVerify, ranges.len() as u64, seed, &payload, "verifying written blocks")
        }
    }
}
