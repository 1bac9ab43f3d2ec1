//! Buffers whose pages are resident and written before anything is measured.
//!
//! Fresh anonymous memory reads as the kernel's shared zero page until it is written, so a
//! source buffer that was never written would be sent from one cache-hot page and inflate the
//! figures; and first writes to a destination would pay page faults inside the measurement.

use std::sync::Arc;

use xfer::HostBuffer;

/// What untouched bench memory holds (any non-zero byte).
pub const FILL: u8 = 0xa5;

const CHUNK: usize = 1 << 20;
const PAGE: usize = 4096;

/// A host buffer with every page written.
pub fn host_buffer(len: usize) -> Arc<HostBuffer> {
    let buffer = Arc::new(HostBuffer::new(len.max(1)));
    let chunk = vec![FILL; CHUNK.min(buffer.len())];
    for start in (0..buffer.len()).step_by(CHUNK) {
        buffer.write_at(start, &chunk[..CHUNK.min(buffer.len() - start)]);
    }
    buffer
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
