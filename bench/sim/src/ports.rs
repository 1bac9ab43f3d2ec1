//! Free loopback ports for test and benchmark harnesses that start simulators (and the
//! daemons in front of them) as separate processes.

use std::net::TcpListener;

/// Where ports are drawn: below Linux's ephemeral range (32768 and up). A port the kernel hands
/// out for binding port 0 is soon reused as the local port of some outgoing connection, and a
/// child told to bind it then fails with "Address already in use" (seen under parallel tests).
const RANGE: std::ops::Range<u16> = 10_000..32_000;

/// A loopback port that was free a moment ago, for a child process to bind: drawn at random
/// below the ephemeral range, port 0's choice when 64 draws found none free.
pub fn free_loopback_port() -> std::io::Result<u16> {
    for _ in 0..64 {
        let mut b = [0u8; 2];
        getrandom::fill(&mut b).map_err(std::io::Error::other)?;
        let port = RANGE.start + u16::from_le_bytes(b) % (RANGE.end - RANGE.start);
        if let Ok(listener) = TcpListener::bind(("127.0.0.1", port)) {
            return listener.local_addr().map(|a| a.port());
        }
    }
    TcpListener::bind("127.0.0.1:0")?.local_addr().map(|a| a.port())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_free_and_below_the_ephemeral_range() {
        for _ in 0..20 {
            let port = free_loopback_port().unwrap();
            assert!(RANGE.contains(&port), "{port}");
            TcpListener::bind(("127.0.0.1", port)).expect("the port is free");
        }
    }
}
