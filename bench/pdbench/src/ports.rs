//! Free loopback ports for harnesses that start servers as separate processes (pdbench's
//! cluster, and the tests of the simulator, the sidecar and the coordinator).

use std::fs::File;
use std::net::TcpListener;
use std::sync::{Mutex, PoisonError};

use rand::Rng;

/// Where ports are drawn: below Linux's ephemeral range (32768 and up). A port the kernel hands
/// out for binding port 0 is soon reused as the local port of some outgoing connection, and a
/// child told to bind it then fails with "Address already in use" (seen under parallel tests).
const RANGE: std::ops::Range<u16> = 10_000..32_000;

/// A loopback port for a child process to bind: free a moment ago, drawn at random below the
/// ephemeral range, and claimed by a lock on the file `$TMPDIR/pdbench-ports/PORT` held until
/// this process exits. Between the check and the child's bind another harness (tests run side by
/// side, in threads and in processes) could otherwise draw the same port: its child then failed
/// to start, or answered the other's health check. Port 0's choice when 64 draws found none.
pub fn free_loopback_port() -> std::io::Result<u16> {
    let mut rng = rand::rng();
    for _ in 0..64 {
        let port = rng.random_range(RANGE);
        if TcpListener::bind(("127.0.0.1", port)).is_ok() && claim(port) {
            return Ok(port);
        }
    }
    TcpListener::bind("127.0.0.1:0")?.local_addr().map(|a| a.port())
}

/// Locks `port`'s file for the rest of this process; `false` when another holder has it (a lock
/// is per open file, so this also holds between threads of one process), or when the file cannot
/// be had (the port is then left to others too). The files stay: removing one while another
/// process opens it would let two hold "the" lock.
fn claim(port: u16) -> bool {
    static HELD: Mutex<Vec<File>> = Mutex::new(Vec::new());
    let dir = std::env::temp_dir().join("pdbench-ports");
    let file = std::fs::create_dir_all(&dir).and_then(|()| {
        std::fs::OpenOptions::new().create(true).truncate(false).write(true).open(dir.join(port.to_string()))
    });
    let Ok(file) = file else { return false };
    if file.try_lock().is_err() {
        return false;
    }
    HELD.lock().unwrap_or_else(PoisonError::into_inner).push(file);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_free_below_the_ephemeral_range_and_never_handed_out_twice() {
        let ports: Vec<u16> = (0..50).map(|_| free_loopback_port().unwrap()).collect();
        for &port in &ports {
            assert!(RANGE.contains(&port), "{port}");
            TcpListener::bind(("127.0.0.1", port)).expect("the port is free");
        }
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), ports.len(), "a port was handed out twice: {ports:?}");
        // A port this process holds is refused to a second claim.
        assert!(!claim(ports[0]));
    }
}
