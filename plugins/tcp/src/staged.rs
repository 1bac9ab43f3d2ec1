//! GPU memory and files over TCP: pieces the socket cannot address are staged through a copy
//! lane (`xfer_core::staging`), one per stream worker or served connection, created on first
//! need and kept while the device stays the same.

use xfer_core::staging::{self, CopyLane, Flow, Staging, Wire};
use xfer_core::{BackendError, LocalMem, MemSlice};

use crate::conn::{Conn, ConnError};
use crate::memio;

/// Staging settings of the backend.
#[derive(Clone, Copy, Debug)]
pub struct StagingConfig {
    pub slots: usize,
    pub slot_bytes: usize,
}

/// The lane of one worker or connection.
#[derive(Debug, Default)]
pub struct Lanes {
    lane: Option<(Option<u64>, Box<dyn CopyLane>)>,
}

impl Lanes {
    fn get(
        &mut self,
        staging: &dyn Staging,
        config: StagingConfig,
        device: Option<u64>,
    ) -> Result<&mut dyn CopyLane, BackendError> {
        // A file-only lane serves files; GPU memory needs its own device's lane.
        let fits = matches!(&self.lane, Some((have, _)) if *have == device || device.is_none());
        if !fits {
            self.lane = None;
            self.lane = Some((device, staging.lane(device, config.slots, config.slot_bytes)?));
        }
        Ok(self.lane.as_mut().map(|(_, lane)| lane.as_mut()).expect("set above"))
    }

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
        let device = pieces.iter().find_map(LocalMem::device);
        let lane = self.get(staging, config, device)?;
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
