//! Which rails to a peer a request may use, and where a failed share goes: pure bookkeeping,
//! the time passed in. A rail whose share failed (its CQ reported an error for the peer, or it
//! completed nothing for the peer within the stall bound) is down: new requests leave it out
//! and failed shares move to a rail that is up. Once its backoff has passed, the next request
//! uses it again as a probe; a probe that fails doubles the backoff (up to [`MAX_BACKOFF`]),
//! one that succeeds brings the rail back up.

use std::time::{Duration, Instant};

use xfer_core::BackendError;

/// The longest a down rail waits before it is tried again.
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RailState {
    Up,
    Down { retry_at: Instant, backoff: Duration },
}

/// The state of every rail to one peer.
#[derive(Debug)]
pub struct RailHealth {
    rails: Vec<RailState>,
    first_backoff: Duration,
}

/// What marking a rail down changed.
#[derive(Debug, PartialEq, Eq)]
pub enum Marked {
    /// The rail was up: it goes down now (worth one log line).
    WentDown { retry_in: Duration },
    /// The rail was already down (a failed probe, or a second share of the same outage).
    StillDown { retry_in: Duration },
}

impl RailHealth {
    pub fn new(rails: usize, first_backoff: Duration) -> RailHealth {
        RailHealth { rails: vec![RailState::Up; rails], first_backoff: first_backoff.min(MAX_BACKOFF) }
    }

    /// Rails a new request may use at `now`: those up and those down whose retry time has
    /// come (probes). Empty only when every rail is down and waiting.
    pub fn usable(&self, now: Instant) -> Vec<usize> {
        (0..self.rails.len())
            .filter(|&rail| match self.rails[rail] {
                RailState::Up => true,
                RailState::Down { retry_at, .. } => now >= retry_at,
            })
            .collect()
    }

    pub fn is_up(&self, rail: usize) -> bool {
        self.rails.get(rail) == Some(&RailState::Up)
    }

    /// A share on `rail` failed at `now`. A rail already down (a failed probe, or another
    /// share caught in the same outage) keeps its retry time unless it was due, then doubles
    /// its backoff.
    pub fn failed(&mut self, rail: usize, now: Instant) -> Marked {
        let first = self.first_backoff;
        let Some(state) = self.rails.get_mut(rail) else { return Marked::StillDown { retry_in: first } };
        match *state {
            RailState::Up => {
                *state = RailState::Down { retry_at: now + first, backoff: first };
                Marked::WentDown { retry_in: first }
            }
            RailState::Down { retry_at, .. } if now < retry_at => Marked::StillDown { retry_in: retry_at - now },
            RailState::Down { backoff, .. } => {
                let backoff = (backoff * 2).min(MAX_BACKOFF);
                *state = RailState::Down { retry_at: now + backoff, backoff };
                Marked::StillDown { retry_in: backoff }
            }
        }
    }

    /// A share on `rail` completed: the rail is up. Whether it was down before.
    pub fn succeeded(&mut self, rail: usize) -> bool {
        match self.rails.get_mut(rail) {
            Some(state) => std::mem::replace(state, RailState::Up) != RailState::Up,
            None => false,
        }
    }

    /// The rail a share that failed on `failed` moves to: the first other rail that is up.
    /// Probing rails are not used for this, so a share is not handed from one doubtful rail
    /// to another.
    pub fn reroute(&self, failed: usize) -> Option<usize> {
        (0..self.rails.len()).find(|&rail| rail != failed && self.is_up(rail))
    }

    /// The rail a notification goes on at `now`: the first that is up, else the first usable.
    pub fn notify_rail(&self, now: Instant) -> usize {
        (0..self.rails.len()).find(|&rail| self.is_up(rail)).or_else(|| self.usable(now).first().copied()).unwrap_or(0)
    }
}

/// Whether a share's error says its rail failed (so the share may move), rather than the
/// request (refused, cancelled) or the backend (shut down).
pub fn is_rail_failure(err: &BackendError) -> bool {
    matches!(err, BackendError::PeerDisconnected { .. } | BackendError::TimedOut(_))
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: Duration = Duration::from_secs(1);

    fn disconnected() -> BackendError {
        BackendError::PeerDisconnected { peer: "p".into(), reason: "link down".into() }
    }

    #[test]
    fn a_failed_rail_is_left_out_until_its_backoff_passes() {
        let t0 = Instant::now();
        let mut health = RailHealth::new(2, SEC);
        assert_eq!(health.usable(t0), [0, 1]);
        assert_eq!(health.failed(1, t0), Marked::WentDown { retry_in: SEC });
        assert_eq!(health.usable(t0), [0]);
        assert_eq!(health.usable(t0 + SEC / 2), [0], "not used again at once");
        assert_eq!(health.reroute(1), Some(0));
        // A second share of the same outage does not push the retry out, nor log again.
        assert_eq!(health.failed(1, t0 + SEC / 2), Marked::StillDown { retry_in: SEC / 2 });
        assert_eq!(health.usable(t0 + SEC), [0, 1], "probed once the backoff has passed");
        assert!(!health.is_up(1), "a probe is not up yet");
        assert!(health.succeeded(1), "the probe brings it back");
        assert!(health.is_up(1));
        assert!(!health.succeeded(1), "already up");
    }

    #[test]
    fn failed_probes_double_the_backoff_up_to_the_cap() {
        let t0 = Instant::now();
        let mut health = RailHealth::new(2, SEC);
        health.failed(0, t0);
        let mut now = t0;
        let mut expected = SEC;
        for _ in 0..8 {
            now += expected;
            assert_eq!(health.usable(now), [0, 1]);
            expected = (expected * 2).min(MAX_BACKOFF);
            assert_eq!(health.failed(0, now), Marked::StillDown { retry_in: expected });
            assert_eq!(health.usable(now), [1]);
        }
        assert_eq!(expected, MAX_BACKOFF);
        // Back up: the next outage starts from the first backoff again.
        health.succeeded(0);
        assert_eq!(health.failed(0, now), Marked::WentDown { retry_in: SEC });
    }

    #[test]
    fn no_reroute_when_every_other_rail_is_down() {
        let t0 = Instant::now();
        let mut health = RailHealth::new(3, SEC);
        health.failed(0, t0);
        assert_eq!(health.reroute(0), Some(1));
        health.failed(1, t0);
        assert_eq!(health.reroute(0), Some(2));
        assert_eq!(health.reroute(1), Some(2));
        assert_eq!(health.notify_rail(t0), 2);
        health.failed(2, t0);
        assert_eq!(health.reroute(2), None, "every rail is down");
        assert!(health.usable(t0).is_empty());
        // Probing rails take notifications but not rerouted shares.
        assert_eq!(health.notify_rail(t0 + SEC), 0);
        assert_eq!(health.reroute(2), None);
        assert_eq!(RailHealth::new(1, SEC).reroute(0), None, "a single rail has nowhere to go");
    }

    #[test]
    fn out_of_range_rails_change_nothing() {
        let t0 = Instant::now();
        let mut health = RailHealth::new(1, SEC);
        assert_eq!(health.failed(5, t0), Marked::StillDown { retry_in: SEC });
        assert!(!health.succeeded(5));
        assert_eq!(health.usable(t0), [0]);
    }

    #[test]
    fn only_link_errors_move_shares() {
        assert!(is_rail_failure(&disconnected()));
        assert!(is_rail_failure(&BackendError::TimedOut(SEC)));
        assert!(!is_rail_failure(&BackendError::Cancelled));
        assert!(!is_rail_failure(&BackendError::Refused {
            code: xfer_core::RefusalCode::UnknownKey,
            message: "bad key".into()
        }));
        assert!(!is_rail_failure(&BackendError::Unsupported("shut down".into())));
    }
}
