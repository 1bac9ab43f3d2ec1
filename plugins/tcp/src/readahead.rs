//! A connection's read-ahead buffer. A request arrives as a header, a descriptor table and a
//! payload, and an answer as a header, padding and a payload; reading each part on its own costs
//! a read(2) per part, and on a busy machine each read costs more than the bytes of a small
//! transfer. So every read also offers the buffer's free space after the caller's destination
//! (one readv(2)): the kernel fills the destination first and puts what else has arrived in the
//! buffer, where the next reads find it without a syscall. A destination larger than the buffer
//! is still read straight into place; only the bytes beyond it land here.
//!
//! Pure: the connection passes its socket read as a function.

use std::io::{self, IoSliceMut};

/// Bytes kept per connection: a small request (header, table and a payload of up to about
/// 32 KiB) or an answer comes in one read.
pub const CAPACITY: usize = 32 << 10;

/// At most this many destination slices share a read with the buffer (a longer scatter list
/// is read as it is, into the destination alone).
const SHARED_READ_SLICES: usize = 8;

/// Whether a read from the socket also offers the buffer's free space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Offer {
    /// The bytes after the destination land in the buffer, to be copied out by later reads.
    Buffer,
    /// Only the destination: what follows stays in the socket, for a read straight into its
    /// own destination (an answer's header before a payload larger than the buffer, which
    /// would otherwise be copied out of the buffer for no saved syscall).
    Exact,
}

#[derive(Debug)]
pub struct ReadAhead {
    buf: Box<[u8]>,
    /// The unread bytes are `buf[start..end]`.
    start: usize,
    end: usize,
}

impl ReadAhead {
    pub fn new(capacity: usize) -> ReadAhead {
        ReadAhead { buf: vec![0; capacity].into_boxed_slice(), start: 0, end: 0 }
    }

    /// Bytes read from the socket that nobody has taken yet.
    pub fn buffered(&self) -> usize {
        self.end - self.start
    }

    /// Fills the front of `bufs`: from buffered bytes when there are some (no read), otherwise
    /// with one call of `read`, whose bytes beyond `bufs` stay buffered (`Offer::Buffer`) or
    /// stay in the socket (`Offer::Exact`). Returns how many bytes went into `bufs`; 0 means
    /// `read` returned 0 (the end of the stream) or `bufs` is empty.
    pub fn read_into(
        &mut self,
        bufs: &mut [IoSliceMut<'_>],
        offer: Offer,
        read: impl FnOnce(&mut [IoSliceMut<'_>]) -> io::Result<usize>,
    ) -> io::Result<usize> {
        let wanted: usize = bufs.iter().map(|b| b.len()).sum();
        if wanted == 0 {
            return Ok(0);
        }
        if self.buffered() > 0 {
            return Ok(self.take(bufs));
        }
        self.start = 0;
        self.end = 0;
        if offer == Offer::Exact || bufs.len() > SHARED_READ_SLICES {
            return read(bufs);
        }
        let n = bufs.len();
        let mut iov: [IoSliceMut<'_>; SHARED_READ_SLICES + 1] = std::array::from_fn(|_| IoSliceMut::new(&mut []));
        for (slot, buf) in iov.iter_mut().zip(bufs.iter_mut()) {
            *slot = IoSliceMut::new(buf);
        }
        iov[n] = IoSliceMut::new(&mut self.buf);
        let got = read(&mut iov[..=n])?;
        let into_bufs = got.min(wanted);
        self.end = got - into_bufs;
        Ok(into_bufs)
    }

    /// Copies buffered bytes to the front of `bufs`; how many.
    fn take(&mut self, bufs: &mut [IoSliceMut<'_>]) -> usize {
        let mut copied = 0;
        for buf in bufs.iter_mut() {
            let n = buf.len().min(self.buffered());
            buf[..n].copy_from_slice(&self.buf[self.start..self.start + n]);
            self.start += n;
            copied += n;
            if self.buffered() == 0 {
                break;
            }
        }
        copied
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket that hands out `stream` in reads of at most the given sizes, as the kernel
    /// would (filling the offered slices in order), and counts its reads.
    struct Socket {
        stream: Vec<u8>,
        pos: usize,
        reads: Vec<usize>,
        calls: usize,
    }

    impl Socket {
        fn new(len: usize, reads: &[usize]) -> Socket {
            let stream = (0..len).map(|i| (i * 7 + i / 251) as u8).collect();
            Socket { stream, pos: 0, reads: reads.to_vec(), calls: 0 }
        }

        fn read(&mut self, bufs: &mut [IoSliceMut<'_>]) -> io::Result<usize> {
            let mut budget = self.reads.get(self.calls).copied().unwrap_or(usize::MAX);
            self.calls += 1;
            let mut got = 0;
            for buf in bufs {
                let n = buf.len().min(budget).min(self.stream.len() - self.pos);
                buf[..n].copy_from_slice(&self.stream[self.pos..self.pos + n]);
                self.pos += n;
                budget -= n;
                got += n;
            }
            Ok(got)
        }
    }

    /// Reads exactly `len` bytes in a loop, as the connection does.
    fn read_exact(ahead: &mut ReadAhead, socket: &mut Socket, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        let mut filled = 0;
        while filled < len {
            let n = ahead
                .read_into(&mut [IoSliceMut::new(&mut out[filled..])], Offer::Buffer, |iov| socket.read(iov))
                .unwrap();
            assert!(n > 0, "unexpected end of stream");
            filled += n;
        }
        out
    }

    #[test]
    fn a_small_frame_comes_in_one_read() {
        // Header, table, payload: three reads of the caller, one of the socket.
        let mut socket = Socket::new(24 + 104 + 4096, &[]);
        let mut ahead = ReadAhead::new(CAPACITY);
        let header = read_exact(&mut ahead, &mut socket, 24);
        let table = read_exact(&mut ahead, &mut socket, 104);
        let payload = read_exact(&mut ahead, &mut socket, 4096);
        assert_eq!(socket.calls, 1);
        assert_eq!([header, table, payload].concat(), socket.stream);
        assert_eq!(ahead.buffered(), 0);
    }

    #[test]
    fn partial_reads_are_filled_in_order() {
        let mut socket = Socket::new(5000, &[10, 3, 1000, 7, 3980]);
        let mut ahead = ReadAhead::new(CAPACITY);
        let mut got = Vec::new();
        for len in [24, 100, 4000, 876] {
            got.extend(read_exact(&mut ahead, &mut socket, len));
        }
        assert_eq!(got, socket.stream);
        assert_eq!(ahead.buffered(), 0);
    }

    #[test]
    fn a_frame_split_across_reads_joins_buffered_and_fresh_bytes() {
        // The first read brings a whole frame and half of the next; the second frame's header
        // comes partly from the buffer, partly from the next read.
        let mut socket = Socket::new(48 + 48, &[60, 36]);
        let mut ahead = ReadAhead::new(CAPACITY);
        let first = read_exact(&mut ahead, &mut socket, 48);
        assert_eq!(ahead.buffered(), 12);
        let second = read_exact(&mut ahead, &mut socket, 48);
        assert_eq!(socket.calls, 2);
        assert_eq!([first, second].concat(), socket.stream);
    }

    #[test]
    fn a_payload_larger_than_the_buffer_is_read_straight_into_place() {
        let capacity = 64;
        let len = 10 * capacity;
        let mut socket = Socket::new(len + 16, &[]);
        let mut ahead = ReadAhead::new(capacity);
        let mut payload = vec![0u8; len];
        let n = ahead.read_into(&mut [IoSliceMut::new(&mut payload)], Offer::Buffer, |iov| socket.read(iov)).unwrap();
        assert_eq!(n, len, "one read fills the whole destination");
        assert_eq!(ahead.buffered(), 16, "only the bytes beyond it are buffered");
        assert_eq!(payload, socket.stream[..len]);
        assert_eq!(read_exact(&mut ahead, &mut socket, 16), socket.stream[len..]);
        assert_eq!(socket.calls, 1);
    }

    #[test]
    fn an_exact_read_leaves_what_follows_in_the_socket() {
        // An answer's header and padding, then a payload larger than the buffer: the payload
        // must not be read into the buffer (a copy) but straight into its destination.
        let (head_len, payload_len) = (128, 4 * CAPACITY);
        let mut socket = Socket::new(head_len + payload_len, &[]);
        let mut ahead = ReadAhead::new(CAPACITY);
        let mut head = vec![0u8; head_len];
        let n = ahead.read_into(&mut [IoSliceMut::new(&mut head)], Offer::Exact, |iov| socket.read(iov)).unwrap();
        assert_eq!((n, ahead.buffered()), (head_len, 0));
        let mut payload = vec![0u8; payload_len];
        let n = ahead.read_into(&mut [IoSliceMut::new(&mut payload)], Offer::Buffer, |iov| socket.read(iov)).unwrap();
        assert_eq!((n, ahead.buffered(), socket.calls), (payload_len, 0, 2));
        assert_eq!([head, payload].concat(), socket.stream);
    }

    #[test]
    fn scatter_lists_and_the_end_of_the_stream() {
        // A few slices share the read with the buffer; a long list is read on its own.
        let mut socket = Socket::new(4 * 100 + 20 * 10, &[]);
        let mut ahead = ReadAhead::new(CAPACITY);
        let mut pieces = [[0u8; 100]; 4];
        let mut iov: Vec<IoSliceMut<'_>> = pieces.iter_mut().map(|p| IoSliceMut::new(p)).collect();
        assert_eq!(ahead.read_into(&mut iov, Offer::Buffer, |iov| socket.read(iov)).unwrap(), 400);
        assert_eq!(ahead.buffered(), 200);
        let mut many = [[0u8; 10]; 20];
        let mut iov: Vec<IoSliceMut<'_>> = many.iter_mut().map(|p| IoSliceMut::new(p)).collect();
        assert_eq!(ahead.read_into(&mut iov, Offer::Buffer, |iov| socket.read(iov)).unwrap(), 200, "from the buffer");
        assert_eq!(socket.calls, 1);
        assert_eq!([pieces.concat(), many.concat()].concat(), socket.stream);
        let mut more = [0u8; 8];
        let mut iov: Vec<IoSliceMut<'_>> = (0..20).map(|_| IoSliceMut::new(&mut [])).collect();
        iov[19] = IoSliceMut::new(&mut more);
        assert_eq!(ahead.read_into(&mut iov, Offer::Buffer, |iov| socket.read(iov)).unwrap(), 0, "end of stream");
        assert_eq!(ahead.read_into(&mut [], Offer::Buffer, |iov| socket.read(iov)).unwrap(), 0, "nothing wanted");
    }
}
