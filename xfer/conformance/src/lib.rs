//! One conformance suite for every `xfer` backend, written once and run per backend.
//!
//! The target is a separate process, [`xfer-peer`](peer), so bytes cross a real process
//! boundary and the target can be killed mid-transfer. The initiator is an `xfer::Agent` in the
//! test process that reaches the peer knowing only its side-channel address. Every byte moved
//! is checked against a [seekable pseudo-random pattern](pattern) both processes generate, and
//! every wait is bounded.
//!
//! A backend's test file (an integration test of this crate, where Cargo defines
//! `CARGO_BIN_EXE_xfer-peer`) calls each [scenario](scenarios) with its name and parameters:
//!
//! ```text
//! xfer_conformance::set_peer_exe(env!("CARGO_BIN_EXE_xfer-peer"));
//! xfer_conformance::scenarios::transfer_matrix("tcp", "listen=127.0.0.1:0");
//! ```
//!
//! ## The peer's line protocol
//!
//! `xfer-peer --name N --backend B --params k=v,... --size BYTES --side-channel ADDR
//! [--alloc host|backend]` prints
//! `READY <side-channel-addr> <buffer-addr> <buffer-len>`, then answers each stdin line with one
//! stdout line, `OK [...]` or `ERR <message>`:
//!
//! | command | effect | answer |
//! |---|---|---|
//! | `fill SEED OFF LEN` | writes pattern bytes `0..LEN` of `SEED` at `OFF` | `OK` |
//! | `hash OFF LEN` | hashes `OFF..OFF+LEN` ([`pattern::hash`]) | `OK <16 hex digits>` |
//! | `notifs` | drains the notifications recorded so far | `OK <comma-separated list>` |
//! | `dereg` | drops the registration | `OK` |
//! | `free` | drops the registration and the buffer (`--alloc backend`: releases the allocation) | `OK` |
//! | `quit` (or EOF) | exits 0 | — |
//!
//! A notification `check:SEQ:OFF:LEN:HASH` is hashed the moment it arrives and recorded as
//! `SEQ=ok` or `SEQ=bad`; any other is recorded [escaped](pattern::escape).

#![forbid(unsafe_code)]

pub mod layout;
pub mod pattern;
pub mod peer;
pub mod scenarios;
pub mod test_ca;

pub use peer::{peer_exe, set_peer_exe, Peer, PeerConfig, PeerError};
pub use test_ca::TestCa;

/// One `#[test]` per listed scenario, each running `scenarios::NAME(backend, params)` against
/// the calling test crate's `xfer-peer` binary: a backend's test file is one call per transport.
#[macro_export]
macro_rules! conformance_tests {
    ($backend:expr, $params:expr, [$($scenario:ident),* $(,)?]) => {
        $(
            #[test]
            fn $scenario() {
                $crate::set_peer_exe(env!("CARGO_BIN_EXE_xfer-peer"));
                $crate::scenarios::$scenario($backend, $params);
            }
        )*
    };
}
