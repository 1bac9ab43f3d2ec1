//! Every way of waiting ends a request with its bytes in place: a long `wait`, short `wait`s
//! that time out until it is done, `poll` in a loop, `wait_async`, and nobody waiting at all
//! (a WRITE whose notification must still arrive after its data). A backend that lets the
//! waiting thread finish small requests itself (TCP's inline path) must still finish them
//! when that thread only polls, waits briefly, awaits, or never looks.

use std::future::Future;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use xfer::{Op, RequestOptions, XferError, XferRequest};

use super::{spawn_peer, Initiator, WAIT};
use crate::pattern::{check_message, check_pattern, pattern_hash, write_pattern};

/// Small (one frame), and large enough to be cut over several streams.
const SIZES: [u64; 3] = [4096, 64 << 10, 1 << 20];
const SLOT: u64 = 1 << 20;
const STYLES: [Style; 4] = [Style::Wait, Style::ShortWaits, Style::Poll, Style::Async];

#[derive(Clone, Copy, Debug)]
enum Style {
    Wait,
    ShortWaits,
    Poll,
    Async,
}

pub fn completion_styles(backend: &str, params: &str) {
    let slots = (SIZES.len() * STYLES.len() * 2 + SIZES.len()) as u64;
    let init = Initiator::new("waits-init", backend, params, SLOT * slots);
    let mut peer = spawn_peer("waits-peer", backend, params, SLOT * slots);
    let name = init.connect(&peer);
    let mut slot = 0u64;
    for size in SIZES {
        for style in STYLES {
            for op in [Op::Write, Op::Read] {
                let (off, seed) = (slot * SLOT, 1000 + slot);
                slot += 1;
                let label = format!("{op:?} of {size} bytes, {style:?}");
                match op {
                    Op::Write => write_pattern(&init.buf, off, seed, 0, size),
                    Op::Read => peer.fill(seed, off, size).unwrap_or_else(|e| panic!("{label}: fill the peer: {e}")),
                }
                let req = init
                    .agent
                    .create_request(
                        op,
                        &[init.desc(off, size)],
                        &name,
                        &[peer.desc(off, size)],
                        RequestOptions::default(),
                    )
                    .unwrap_or_else(|e| panic!("{label}: create: {e}"));
                req.post().unwrap_or_else(|e| panic!("{label}: post: {e}"));
                let started = Instant::now();
                finish(&req, style).unwrap_or_else(|e| panic!("{label}: {e} after {:?}", started.elapsed()));
                match op {
                    Op::Write => assert_eq!(
                        peer.hash(off, size).expect("hash"),
                        pattern_hash(seed, 0, size),
                        "{label}: the peer's bytes"
                    ),
                    Op::Read => check_pattern(&init.buf, off, seed, 0, size)
                        .unwrap_or_else(|at| panic!("{label}: local byte {at} differs")),
                }
            }
        }
    }
    // Nobody waits: each WRITE's notification (checked against the data on arrival) must come.
    let mut unwatched = Vec::new();
    for (i, size) in SIZES.into_iter().enumerate() {
        let (off, seed) = (slot * SLOT, 1000 + slot);
        slot += 1;
        write_pattern(&init.buf, off, seed, 0, size);
        let message = check_message(&format!("unwatched-{i}"), off, size, pattern_hash(seed, 0, size));
        let req = init
            .agent
            .create_request(
                Op::Write,
                &[init.desc(off, size)],
                &name,
                &[peer.desc(off, size)],
                RequestOptions::notify(message),
            )
            .expect("create");
        req.post().expect("post");
        // Kept, not dropped: dropping a request cancels it.
        unwatched.push(req);
    }
    let mut got = peer.collect_notifs(SIZES.len(), WAIT).expect("notifs");
    got.sort();
    let want: Vec<String> = (0..SIZES.len()).map(|i| format!("unwatched-{i}=ok")).collect();
    assert_eq!(got, want, "notifications of requests nobody waited for (each checks its data on arrival)");
    for req in &unwatched {
        assert!(matches!(req.poll(), Ok(true)), "an unwatched request whose notification came is not done");
    }
}

/// Ends `req` the given way, within [`WAIT`].
fn finish(req: &XferRequest, style: Style) -> Result<(), XferError> {
    let deadline = Instant::now() + WAIT;
    match style {
        Style::Wait => req.wait(WAIT),
        Style::ShortWaits => loop {
            match req.wait(Duration::from_millis(1)) {
                Err(XferError::TimedOut(_)) if Instant::now() < deadline => {}
                other => return other,
            }
        },
        Style::Poll => loop {
            if req.poll()? {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(XferError::TimedOut(WAIT));
            }
            std::thread::sleep(Duration::from_micros(50));
        },
        Style::Async => {
            let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
            let mut cx = Context::from_waker(&waker);
            let mut future = std::pin::pin!(req.wait_async());
            loop {
                if let Poll::Ready(result) = future.as_mut().poll(&mut cx) {
                    return result;
                }
                if Instant::now() >= deadline {
                    return Err(XferError::TimedOut(WAIT));
                }
                std::thread::park_timeout(Duration::from_millis(100));
            }
        }
    }
}

/// Wakes the test thread parked on a pending future.
struct Unpark(std::thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}
