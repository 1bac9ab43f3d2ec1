//! The TCP backend's only `unsafe`: registered memory seen as byte slices for vectored socket
//! I/O, so payload bytes move between the socket and the registration without a copy. The QUIC
//! backend uses the same two views.

#![allow(unsafe_code)]

use std::io::{IoSlice, IoSliceMut};

use xfer_core::{LocalMem, MemSlice};

/// Slices to send from: the host pieces of `pieces` (callers stage the others). The bytes are a
/// source of this exchange only.
pub fn send_from(pieces: &[LocalMem]) -> impl Iterator<Item = IoSlice<'_>> {
    pieces.iter().filter_map(|piece| match piece {
        LocalMem::Host(slice) => Some(send_slice(slice)),
        _ => None,
    })
}

pub fn send_slice(slice: &MemSlice) -> IoSlice<'_> {
    // SAFETY: `slice` is pinned registered host memory. Nothing in this process holds
    // references to registered memory (`HostMemory` types hand out copies; raw registrations
    // promise the same), and the application orders requests so that none writes these bytes
    // while this one reads them — the contract of memory registered for transfers, as with a NIC
    // reading it by DMA (see `MemSlice::as_slice`).
    IoSlice::new(unsafe { slice.as_slice() })
}

/// Most pieces whose slices are gathered on the stack (a frame of a few descriptors, the usual
/// small request, then allocates nothing for its I/O list).
const ON_STACK: usize = 8;

/// Calls `f` with `head` followed by the host pieces of `pieces` (see [`send_from`]), the
/// frame of one writev(2).
pub fn with_send_slices<R>(head: &[u8], pieces: &[LocalMem], f: impl FnOnce(&mut [IoSlice<'_>]) -> R) -> R {
    if pieces.len() < ON_STACK {
        let mut iov = [IoSlice::new(&[]); ON_STACK];
        iov[0] = IoSlice::new(head);
        let mut n = 1;
        for (slot, slice) in iov[1..].iter_mut().zip(send_from(pieces)) {
            *slot = slice;
            n += 1;
        }
        return f(&mut iov[..n]);
    }
    let mut iov = Vec::with_capacity(pieces.len() + 1);
    iov.push(IoSlice::new(head));
    iov.extend(send_from(pieces));
    f(&mut iov)
}

/// Calls `f` with `front` followed by the host pieces of `pieces`, the destination of one
/// readv(2): `front` takes what the stream carries before the payload (an answer's padding),
/// the pieces this exchange's bytes alone.
pub fn with_receive_slices<R>(
    front: &mut [u8],
    pieces: &mut [LocalMem],
    f: impl FnOnce(&mut [IoSliceMut<'_>]) -> R,
) -> R {
    let small = pieces.len() < ON_STACK;
    let host = pieces.iter_mut().filter_map(|piece| match piece {
        LocalMem::Host(slice) => Some(receive_slice(slice)),
        _ => None,
    });
    if small {
        let mut iov: [IoSliceMut<'_>; ON_STACK] = std::array::from_fn(|_| IoSliceMut::new(&mut []));
        iov[0] = IoSliceMut::new(front);
        let mut n = 1;
        for (slot, slice) in iov[1..].iter_mut().zip(host) {
            *slot = slice;
            n += 1;
        }
        return f(&mut iov[..n]);
    }
    f(&mut std::iter::once(IoSliceMut::new(front)).chain(host).collect::<Vec<_>>())
}

pub fn receive_slice(slice: &mut MemSlice) -> IoSliceMut<'_> {
    // SAFETY: as in `send_slice`; in addition no other transfer reads or writes these bytes
    // while this one fills them (the application's ordering of requests over the same memory,
    // `MemSlice::as_mut_slice`'s contract), and each slice of one exchange covers distinct bytes
    // (the request's descriptors, checked by the agent or the target's key table).
    IoSliceMut::new(unsafe { slice.as_mut_slice() })
}
