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

/// Slices to receive into: the host pieces of `pieces`. The bytes are this exchange's
/// destination alone.
pub fn receive_into(pieces: &mut [LocalMem]) -> Vec<IoSliceMut<'_>> {
    pieces
        .iter_mut()
        .filter_map(|piece| match piece {
            LocalMem::Host(slice) => Some(receive_slice(slice)),
            _ => None,
        })
        .collect()
}

pub fn receive_slice(slice: &mut MemSlice) -> IoSliceMut<'_> {
    // SAFETY: as in `send_slice`; in addition no other transfer reads or writes these bytes
    // while this one fills them (the application's ordering of requests over the same memory,
    // `MemSlice::as_mut_slice`'s contract), and each slice of one exchange covers distinct bytes
    // (the request's descriptors, checked by the agent or the target's key table).
    IoSliceMut::new(unsafe { slice.as_mut_slice() })
}
