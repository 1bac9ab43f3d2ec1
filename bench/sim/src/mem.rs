//! The pool's memory: one heap buffer, or a shared-memory file, registered once with the
//! engine's xfer agent. Block `i` lives at `base + i × block_bytes`.

use std::path::Path;
use std::sync::Arc;

use xfer::{Agent, HostBuffer, Registration, SharedFile, XferError};

#[derive(Debug)]
enum Backing {
    Heap(Arc<HostBuffer>),
    Shm(Arc<SharedFile>),
}

/// Registered pool memory. Field order matters: the registration drops before the memory.
#[derive(Debug)]
pub struct PoolMemory {
    registration: Option<Registration>,
    backing: Backing,
    block_bytes: usize,
}

impl PoolMemory {
    pub fn heap(block_bytes: usize, num_blocks: usize) -> Self {
        let buf = Arc::new(HostBuffer::new(block_bytes * num_blocks));
        PoolMemory { registration: None, backing: Backing::Heap(buf), block_bytes }
    }

    pub fn shm(path: &Path, block_bytes: usize, num_blocks: usize) -> std::io::Result<Self> {
        let map = Arc::new(SharedFile::create(path, block_bytes * num_blocks)?);
        Ok(PoolMemory { registration: None, backing: Backing::Shm(map), block_bytes })
    }

    pub fn register(&mut self, agent: &Agent) -> Result<(), XferError> {
        let registration = match &self.backing {
            Backing::Heap(buf) => agent.register_buffer(buf)?,
            Backing::Shm(map) => agent.register_buffer(map)?,
        };
        self.registration = Some(registration);
        Ok(())
    }

    pub fn base(&self) -> u64 {
        match &self.backing {
            Backing::Heap(buf) => buf.addr(),
            Backing::Shm(map) => map.addr(),
        }
    }

    pub fn shm_path(&self) -> Option<&Path> {
        match &self.backing {
            Backing::Heap(_) => None,
            Backing::Shm(map) => Some(map.path()),
        }
    }

    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    pub fn block_desc(&self, id: u32) -> xfer::Desc {
        xfer::Desc::new(self.base() + u64::from(id) * self.block_bytes as u64, self.block_bytes as u64, 0)
    }

    pub fn write_block(&self, id: u32, src: &[u8]) {
        let offset = id as usize * self.block_bytes;
        match &self.backing {
            Backing::Heap(buf) => buf.write_at(offset, src),
            Backing::Shm(map) => map.write_at(offset, src),
        }
    }

    pub fn read_block(&self, id: u32, dst: &mut [u8]) {
        let offset = id as usize * self.block_bytes;
        match &self.backing {
            Backing::Heap(buf) => buf.read_at(offset, dst),
            Backing::Shm(map) => map.read_at(offset, dst),
        }
    }
}
