//! UCX connection info from a peer's metadata (worker address, process, TCP segments), checked
//! before the address reaches UCX: errors, never panics; what decodes re-encodes to the same
//! bytes, and the segment check and process match take any values.
#![no_main]

use libfuzzer_sys::fuzz_target;
use xfer_ucx::{decode_conn_info, encode_conn_info, segments_fit, ProcessId, TcpSegments};

fuzz_target!(|data: &[u8]| {
    let Ok(info) = decode_conn_info(data) else { return };
    assert!(!info.address.is_empty());
    assert_eq!(encode_conn_info(&info.address, info.process, info.segments), data);
    for ours in [TcpSegments::default(), TcpSegments { tx: 262_144, rx: 262_144 }, TcpSegments { tx: 8192, rx: 65_536 }]
    {
        let _ = segments_fit(ours, info.segments);
    }
    let here = ProcessId { host: info.process.host, pid: info.process.pid.wrapping_add(1) };
    assert_eq!(info.process.local_pid(&here), (info.process.host != 0).then_some(info.process.pid));
});
