//! Bounded adaptive busy-polling: how long a connection polls its socket before it sleeps in
//! the kernel. A sleeping thread is woken by the kernel when bytes arrive, which on a busy or
//! virtualised machine costs tens of microseconds per wake-up; polling for a short while
//! catches an answer that is about to arrive without that wake-up, at the price of the CPU it
//! burns. The budget adapts so that waits that spinning would not have caught (an idle
//! connection, a large transfer) stop costing CPU.
//!
//! Pure: the connection reports how long each wait took, [`SpinBudget::after_wait`] decides the
//! next budget.

use std::time::Duration;

/// Below this the budget is zero: a spin this short catches nothing.
const MIN_SPIN: Duration = Duration::from_micros(2);

/// The spin budget of one connection: at most `max`, halved after every wait that spinning
/// `max` would not have caught, back to `max` after one it would have.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpinBudget {
    max: Duration,
    current: Duration,
}

impl SpinBudget {
    /// A budget of at most `max` (zero turns spinning off).
    pub fn new(max: Duration) -> SpinBudget {
        SpinBudget { max, current: max }
    }

    /// How long the next wait may poll before it sleeps.
    pub fn current(&self) -> Duration {
        self.current
    }

    /// Adapts to a wait that took `waited` until the first bytes arrived (spinning and
    /// sleeping together).
    pub fn after_wait(&mut self, waited: Duration) {
        self.current = if waited <= self.max {
            self.max
        } else {
            let half = self.current / 2;
            if half < MIN_SPIN {
                Duration::ZERO
            } else {
                half
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAX: Duration = Duration::from_micros(64);

    #[test]
    fn long_waits_turn_spinning_off_and_a_short_one_restores_it() {
        let mut budget = SpinBudget::new(MAX);
        budget.after_wait(Duration::from_micros(10));
        assert_eq!(budget.current(), MAX, "a caught wait keeps the budget");
        let mut halvings = 0;
        while budget.current() > Duration::ZERO {
            budget.after_wait(Duration::from_secs(1));
            halvings += 1;
            assert!(halvings < 10, "the budget never reached zero: {budget:?}");
        }
        assert_eq!(halvings, 6, "64 → 32 → 16 → 8 → 4 → 2 → 0 µs");
        budget.after_wait(MAX);
        assert_eq!(budget.current(), MAX, "a wait spinning would have caught brings it back");
    }

    #[test]
    fn zero_never_spins() {
        let mut budget = SpinBudget::new(Duration::ZERO);
        assert_eq!(budget.current(), Duration::ZERO);
        budget.after_wait(Duration::ZERO);
        assert_eq!(budget.current(), Duration::ZERO);
        budget.after_wait(Duration::from_secs(1));
        assert_eq!(budget.current(), Duration::ZERO);
    }
}
