//! Buffers whose pages are resident and written before anything is measured.
//!
//! Fresh anonymous memory reads as the kernel's shared zero page until it is written, so a
//! source buffer that was never written would be sent from one cache-hot page and inflate the
//! figures; and first writes to a destination would pay page faults inside the measurement.

use std::sync::Arc;

use anyhow::{Context, Result};
use xfer::{Agent, BackendBuffer, HostBuffer, HostRegion, Registration};

use crate::cli::Alloc;
use crate::units::format_total;

/// What untouched bench memory holds (any non-zero byte).
pub const FILL: u8 = 0xa5;

const CHUNK: usize = 1 << 20;
const PAGE: usize = 4096;

/// A host buffer with every page written.
pub fn host_buffer(len: usize) -> Arc<HostBuffer> {
    let buffer = Arc::new(HostBuffer::new(len.max(1)));
    fill(&buffer);
    buffer
}

/// Writes [`FILL`] over the whole region, so every page is resident.
fn fill(region: &HostRegion) {
    let chunk = vec![FILL; CHUNK.min(region.len())];
    for start in (0..region.len()).step_by(CHUNK) {
        region.write_at(start, &chunk[..CHUNK.min(region.len() - start)]);
    }
}

/// A side's registered memory: from the global allocator (`--alloc host`) or allocated by the
/// backend (`--alloc backend`, `Agent::allocate`; UCX puts it in shared memory that a peer on
/// the host maps).
#[derive(Clone, Debug)]
pub enum BenchBuffer {
    Host(Arc<HostBuffer>),
    Backend(Arc<BackendBuffer>),
}

impl BenchBuffer {
    /// `len` bytes as `alloc` says, every page written, registered with `agent`'s backends.
    pub fn register(agent: &Agent, alloc: Alloc, len: usize) -> Result<(BenchBuffer, Registration)> {
        let len = len.max(1);
        let (buffer, registration) = match alloc {
            Alloc::Host => {
                let buffer = host_buffer(len);
                let registration = agent
                    .register_buffer(&buffer)
                    .with_context(|| format!("registering {}", format_total(len as u64)))?;
                (BenchBuffer::Host(buffer), registration)
            }
            Alloc::Backend => {
                let allocation = agent.allocate(len).with_context(|| {
                    format!("allocating {} through the backend (--alloc backend)", format_total(len as u64))
                })?;
                (BenchBuffer::Backend(allocation.buffer), allocation.registration)
            }
        };
        fill(&buffer);
        Ok((buffer, registration))
    }
}

/// Both kinds are a [`HostRegion`]: its accessors (`len`, `sub_desc`, `read_at`, ...) serve.
impl std::ops::Deref for BenchBuffer {
    type Target = HostRegion;
    fn deref(&self) -> &HostRegion {
        match self {
            BenchBuffer::Host(b) => b,
            BenchBuffer::Backend(b) => b,
        }
    }
}

/// A plain buffer that starts on a page boundary, as registered memory does, with every page
/// written. (Where a buffer starts within its page changes loopback copy rates severalfold on
/// some machines, so the baseline's buffers are aligned like the xfer engine's.)
#[derive(Debug, Default)]
pub struct PageBuf {
    storage: Vec<u8>,
    start: usize,
    len: usize,
}

impl PageBuf {
    pub fn new(len: usize) -> PageBuf {
        let storage = vec![FILL; len + PAGE];
        let start = storage.as_ptr().align_offset(PAGE);
        PageBuf { storage, start, len }
    }

    /// Makes the buffer at least `len` bytes long (a new allocation when it grows).
    pub fn grow(&mut self, len: usize) {
        if self.len < len {
            *self = PageBuf::new(len);
        }
    }
}

impl std::ops::Deref for PageBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.storage[self.start..self.start + self.len]
    }
}

impl std::ops::DerefMut for PageBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        &mut self.storage[self.start..self.start + self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_hold_the_fill_byte() {
        let buffer = host_buffer(3 * CHUNK + 5);
        assert!(buffer.to_vec().iter().all(|&b| b == FILL));
        let agent = Agent::new("memory-test").unwrap();
        agent.add_backend("tcp", xfer::BackendParams::parse("listen=127.0.0.1:0").unwrap()).unwrap();
        let (bench, _registration) = BenchBuffer::register(&agent, Alloc::Host, CHUNK + 7).unwrap();
        let mut all = vec![0u8; CHUNK + 7];
        bench.read_at(0, &mut all);
        assert!(all.iter().all(|&b| b == FILL));
        // TCP allocates nothing: --alloc backend is an error there, not a silent host buffer.
        let err = BenchBuffer::register(&agent, Alloc::Backend, 4096).unwrap_err();
        assert!(format!("{err:#}").contains("does not allocate"), "{err:#}");
        let mut plain = PageBuf::new(10);
        assert_eq!(plain.as_ptr() as usize % PAGE, 0);
        assert_eq!(*plain, [FILL; 10]);
        plain.grow(20);
        assert_eq!(plain.as_ptr() as usize % PAGE, 0);
        assert_eq!(*plain, [FILL; 20]);
        plain[3] = 0;
        plain.grow(5);
        assert_eq!((plain.len(), plain[3]), (20, 0), "never shrinks");
    }
}
