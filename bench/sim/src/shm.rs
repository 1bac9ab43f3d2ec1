//! A file mapped shared into this process (normally under /dev/shm), so a co-located process
//! (the sidecar) can map and register the same KV pool. The only `unsafe` of the crate.

use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

#[derive(Debug)]
pub struct ShmMap {
    ptr: *mut u8,
    len: usize,
    path: PathBuf,
    /// The creator removes the file when it is done; a process that only opened it does not.
    owner: bool,
}

// SAFETY: the mapping is plain shared memory owned by this value; all access goes through raw
// copies whose ordering the engine guarantees (a block is written before anyone learns its id),
// as with `xfer::HostBuffer`.
unsafe impl Send for ShmMap {}
// SAFETY: as above.
unsafe impl Sync for ShmMap {}

impl ShmMap {
    /// Creates (or truncates) `path` to `len` bytes and maps it read-write, shared.
    pub fn create(path: &Path, len: usize) -> std::io::Result<ShmMap> {
        if len == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "empty mapping"));
        }
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path)?;
        file.set_len(len as u64)?;
        Self::map(&file, path, len, true)
    }

    /// Maps an existing pool file (the co-located sidecar's side); the file stays on drop.
    pub fn open(path: &Path) -> std::io::Result<ShmMap> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let len = usize::try_from(file.metadata()?.len()).map_err(std::io::Error::other)?;
        if len == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "empty pool file"));
        }
        Self::map(&file, path, len, false)
    }

    fn map(file: &std::fs::File, path: &Path, len: usize, owner: bool) -> std::io::Result<ShmMap> {
        // SAFETY: a fresh shared mapping of a file opened read-write and at least `len` long;
        // the kernel picks the address, so no existing memory is affected.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(ShmMap { ptr: ptr.cast(), len, path: path.to_path_buf(), owner })
    }

    pub fn addr(&self) -> u64 {
        self.ptr as usize as u64
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(offset.checked_add(len).is_some_and(|end| end <= self.len), "range outside mapping");
    }

    pub fn read_at(&self, offset: usize, dst: &mut [u8]) {
        self.check(offset, dst.len());
        // SAFETY: the range lies inside the live mapping (checked) and `dst` is a distinct Rust
        // buffer, so the regions do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), dst.as_mut_ptr(), dst.len()) }
    }

    pub fn write_at(&self, offset: usize, src: &[u8]) {
        self.check(offset, src.len());
        // SAFETY: as in `read_at`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(offset), src.len()) }
    }

    /// Registers the mapping with an xfer agent.
    ///
    /// The caller must drop the returned registration before this mapping (the engine keeps
    /// both in one struct, registration first).
    pub fn register(&self, agent: &xfer::Agent) -> Result<xfer::Registration, xfer::XferError> {
        let desc = xfer::Desc::new(self.addr(), self.len as u64, 0);
        // SAFETY: the descriptor is exactly this process's read-write mapping, which stays
        // mapped until `self` drops; the caller drops the registration first (see above).
        unsafe { agent.register_memory(xfer::MemType::Dram, &[desc]) }
    }
}

impl Drop for ShmMap {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are the mapping created in `create`, unmapped exactly once.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
        if self.owner {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_mappings_of_one_file_share_bytes() {
        let path = std::env::temp_dir().join(format!("pd-sim-shm-{}", std::process::id()));
        let a = ShmMap::create(&path, 8192).unwrap();
        a.write_at(4096, b"kv");
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!((&bytes[4096..4098], bytes.len()), (&b"kv"[..], 8192));
        let b = ShmMap::open(&path).unwrap();
        b.write_at(0, b"sidecar");
        let mut seen = [0u8; 7];
        a.read_at(0, &mut seen);
        assert_eq!(&seen, b"sidecar");
        drop(b);
        assert!(path.exists(), "only the creator removes the file");
        drop(a);
        assert!(!path.exists());
    }
}
