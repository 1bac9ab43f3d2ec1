//! Bounded adaptive busy-polling: how long a connection polls its socket before it sleeps in
//! the kernel. A sleeping thread is woken by the kernel when bytes arrive, which on a busy or
//! virtualised machine costs tens of microseconds per wake-up; polling for a short while
//! catches an answer that is about to arrive without that wake-up, at the price of the CPU it
//! burns. Spinning pays only while it catches answers: when CPUs are short, a spinning thread
//! takes the CPU the peer needs to send the answer it waits for, and is itself descheduled
//! instead of woken. So the budget is judged by what spins achieve:
//! - a spin that caught its bytes keeps spinning on;
//! - a spin that ran out of budget, or lost its CPU meanwhile, stops spinning for the next
//!   waits, twice as many each time it happens again (up to [`MAX_PAUSE`]); then one wait
//!   spins again to probe. An idle connection or a large transfer thus costs almost nothing.
//!
//! Pure: the connection reports how each wait went, [`SpinBudget::after_wait`] decides.

use std::time::Duration;

/// Most waits without spinning between two probes.
const MAX_PAUSE: u32 = 1024;

/// How one wait went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spun {
    /// No spin (off, or pausing).
    No,
    /// The spin caught the first bytes.
    Caught,
    /// The spin ran out of budget, or lost its CPU, before any byte came.
    Missed,
}

/// The spin budget of one connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpinBudget {
    max: Duration,
    /// Waits left that do not spin.
    pause: u32,
    /// The pause the next miss starts.
    next_pause: u32,
}

impl SpinBudget {
    /// A budget of `max` (zero turns spinning off).
    pub fn new(max: Duration) -> SpinBudget {
        SpinBudget { max, pause: 0, next_pause: 1 }
    }

    /// How long the next wait may poll before it sleeps.
    pub fn current(&self) -> Duration {
        if self.pause > 0 {
            Duration::ZERO
        } else {
            self.max
        }
    }

    /// Adapts to how a wait went.
    pub fn after_wait(&mut self, spun: Spun) {
        match spun {
            Spun::No => self.pause = self.pause.saturating_sub(1),
            Spun::Caught => self.next_pause = 1,
            Spun::Missed => {
                self.pause = self.next_pause;
                self.next_pause = (self.next_pause * 2).min(MAX_PAUSE);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_micros(64);

    /// Waits until the budget spins again; how many did not.
    fn pause_length(budget: &mut SpinBudget) -> u32 {
        let mut waits = 0;
        while budget.current() == Duration::ZERO {
            budget.after_wait(Spun::No);
            waits += 1;
            assert!(waits <= MAX_PAUSE, "never spins again: {budget:?}");
        }
        waits
    }

    #[test]
    fn catches_keep_spinning() {
        let mut budget = SpinBudget::new(MAX);
        for _ in 0..100 {
            assert_eq!(budget.current(), MAX);
            budget.after_wait(Spun::Caught);
        }
    }

    #[test]
    fn misses_pause_spinning_longer_each_time_and_a_catch_resets() {
        let mut budget = SpinBudget::new(MAX);
        let mut pauses = Vec::new();
        for _ in 0..12 {
            budget.after_wait(Spun::Missed);
            pauses.push(pause_length(&mut budget));
        }
        assert_eq!(pauses, [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 1024]);
        assert_eq!(budget.current(), MAX, "a probe after the pause");
        budget.after_wait(Spun::Caught);
        budget.after_wait(Spun::Missed);
        assert_eq!(pause_length(&mut budget), 1, "a catch forgets earlier misses");
    }

    #[test]
    fn zero_never_spins() {
        let mut budget = SpinBudget::new(Duration::ZERO);
        for spun in [Spun::No, Spun::Caught, Spun::Missed, Spun::No] {
            budget.after_wait(spun);
            assert_eq!(budget.current(), Duration::ZERO);
        }
    }
}
