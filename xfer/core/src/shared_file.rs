//! A file mapped shared (normally under /dev/shm) so that co-located processes — an engine and
//! its sidecar — see and register the same bytes, e.g. a KV pool.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::host::{HostMemory, HostRegion};
use crate::mem::Desc;

/// A read-write `MAP_SHARED` mapping of a whole file. Like `HostBuffer` it hands out copies only.
#[derive(Debug)]
pub struct SharedFile {
    region: HostRegion,
    path: PathBuf,
    /// The creator removes the file when it is done; a process that only opened it does not.
    owner: bool,
}

impl SharedFile {
    /// Creates (or truncates) `path` to `len` zero bytes and maps it.
    pub fn create(path: &Path, len: usize) -> std::io::Result<SharedFile> {
        if len == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "empty mapping"));
        }
        let file = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path)?;
        file.set_len(len as u64)?;
        Self::map(&file, path, len, true)
    }

    /// Maps an existing file (another process created it); the file stays on drop.
    pub fn open(path: &Path) -> std::io::Result<SharedFile> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let len = usize::try_from(file.metadata()?.len()).map_err(std::io::Error::other)?;
        if len == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, "empty file"));
        }
        Self::map(&file, path, len, false)
    }

    fn map(file: &File, path: &Path, len: usize, owner: bool) -> std::io::Result<SharedFile> {
        // SAFETY: a fresh shared mapping of a file opened read-write and `len` bytes long; the
        // kernel picks the address, so no existing memory is affected.
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
        // SAFETY: the mapping is `len` bytes, read-write, and is unmapped only in `drop`.
        let region = unsafe { HostRegion::new(ptr.cast(), len) };
        Ok(SharedFile { region, path: path.to_path_buf(), owner })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl std::ops::Deref for SharedFile {
    type Target = HostRegion;
    fn deref(&self) -> &HostRegion {
        &self.region
    }
}

// SAFETY: the mapping lives until drop and is only accessed through copies.
unsafe impl HostMemory for SharedFile {
    fn desc(&self) -> Desc {
        self.region.desc()
    }
}

impl Drop for SharedFile {
    fn drop(&mut self) {
        // SAFETY: the mapping created in `map`, unmapped exactly once.
        unsafe {
            libc::munmap(self.region.ptr().cast(), self.region.len());
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
        let path = std::env::temp_dir().join(format!("xfer-shared-file-{}", std::process::id()));
        let a = SharedFile::create(&path, 8192).unwrap();
        a.write_at(4096, b"kv");
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!((&bytes[4096..4098], bytes.len()), (&b"kv"[..], 8192));
        let b = SharedFile::open(&path).unwrap();
        b.write_at(0, b"sidecar");
        let mut seen = [0u8; 7];
        a.read_at(0, &mut seen);
        assert_eq!(&seen, b"sidecar");
        assert_eq!(b.sub_desc(4096, 2).addr, b.addr() + 4096);
        drop(b);
        assert!(path.exists(), "only the creator removes the file");
        drop(a);
        assert!(!path.exists());
        assert!(SharedFile::open(&path).is_err());
        assert!(SharedFile::create(&path, 0).is_err());
    }
}
