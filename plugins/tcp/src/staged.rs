//! GPU memory and files over TCP: pieces the socket cannot address are staged through a copy
//! lane (`xfer_core::staging`), one per stream worker or served connection, created on first
//! need and kept while the device stays the same.

use xfer_core::staging::{self, Flow, LaneCache, Staging, StagingConfig, Wire};
use xfer_core::{BackendError, LocalMem, MemSlice};

use crate::conn::{Conn, ConnError};
use crate::memio;

/// The lane of one worker or connection.
#[derive(Debug, Default)]
pub struct Lanes(LaneCache);

impl Lanes {
    /// Moves `pieces` over `conn`, staging what is not host memory.
    pub fn run(
        &mut self,
        staging: &dyn Staging,
        config: StagingConfig,
        flow: Flow,
        pieces: &mut [LocalMem],
        conn: &mut Conn,
        io: &dyn Fn(ConnError) -> BackendError,
    ) -> Result<(), BackendError> {
        let lane = self.0.get(staging, config, pieces)?;
        staging::run(flow, pieces, lane, &mut ConnWire { conn, io })
    }
}

struct ConnWire<'a> {
    conn: &'a mut Conn,
    io: &'a dyn Fn(ConnError) -> BackendError,
}

impl Wire for ConnWire<'_> {
    fn send(&mut self, bytes: &[u8]) -> Result<(), BackendError> {
        self.conn.write_all(bytes).map_err(self.io)
    }

    fn send_host(&mut self, slice: &MemSlice) -> Result<(), BackendError> {
        self.conn.write_all_vectored(&mut [memio::send_slice(slice)]).map_err(self.io)
    }

    fn receive(&mut self, bytes: &mut [u8]) -> Result<(), BackendError> {
        self.conn.read_exact(bytes).map_err(self.io)
    }

    fn receive_host(&mut self, slice: &mut MemSlice) -> Result<(), BackendError> {
        self.conn.read_exact_vectored(&mut [memio::receive_slice(slice)]).map_err(self.io)
    }
}
