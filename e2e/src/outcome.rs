//! How the requests of a kill-an-engine run ended, and the checks every such run makes.

use std::time::Duration;

use serde_json::Value;

/// How one request through the sidecar ended.
#[derive(Debug)]
pub struct Outcome {
    pub index: usize,
    /// Since the run's start.
    pub started: Duration,
    pub took: Duration,
    /// `(status, text)`, status 0 for a 200 whose body could not be read; `Err` when no answer
    /// came.
    pub result: Result<(u16, String), crate::E2eError>,
}

/// What [`tally_after_kill`] counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KillTally {
    pub ok: usize,
    /// Successes among the requests started after the kill.
    pub ok_after_kill: usize,
    pub clear_errors: usize,
    pub slowest: Duration,
}

/// Checks that every request ended within `bound` with text or a clear error (a 5xx with an
/// OpenAI-style error object), never without an answer, and counts them against `killed_at`
/// (since the run's start). Panics, naming the request, on the first that did not.
pub fn tally_after_kill(outcomes: &[Outcome], killed_at: Duration, bound: Duration) -> KillTally {
    let mut tally = KillTally { ok: 0, ok_after_kill: 0, clear_errors: 0, slowest: Duration::ZERO };
    for o in outcomes {
        assert!(o.took <= bound, "request {} took {:?} (bound {bound:?}): {o:?}", o.index, o.took);
        tally.slowest = tally.slowest.max(o.took);
        match &o.result {
            Ok((200, text)) => {
                assert!(!text.is_empty(), "request {}: 200 with no text", o.index);
                tally.ok += 1;
                if o.started > killed_at {
                    tally.ok_after_kill += 1;
                }
            }
            Ok((status, text)) => {
                let v: Value = serde_json::from_str(text).unwrap_or(Value::Null);
                assert!(
                    *status >= 500 && v["error"]["message"].is_string(),
                    "request {}: unclear failure {status}: {text}",
                    o.index
                );
                tally.clear_errors += 1;
            }
            Err(e) => panic!("request {}: transport failure (no answer): {e}", o.index),
        }
    }
    tally
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(index: usize, started_ms: u64, result: Result<(u16, String), crate::E2eError>) -> Outcome {
        Outcome {
            index,
            started: Duration::from_millis(started_ms),
            took: Duration::from_millis(100 + index as u64),
            result,
        }
    }

    #[test]
    fn counts_successes_after_the_kill_and_clear_errors() {
        let error = r#"{"error":{"message":"prefill failed"}}"#.to_owned();
        let outcomes = [
            outcome(0, 10, Ok((200, "a".into()))),
            outcome(1, 20, Ok((502, error))),
            outcome(2, 30, Ok((200, "b".into()))),
        ];
        let tally = tally_after_kill(&outcomes, Duration::from_millis(15), Duration::from_secs(1));
        assert_eq!(tally, KillTally { ok: 2, ok_after_kill: 1, clear_errors: 1, slowest: Duration::from_millis(102) });
    }

    #[test]
    #[should_panic(expected = "unclear failure 500")]
    fn an_error_without_an_error_object_fails() {
        tally_after_kill(&[outcome(0, 0, Ok((500, "oops".into())))], Duration::ZERO, Duration::from_secs(1));
    }

    #[test]
    #[should_panic(expected = "bound")]
    fn a_request_past_the_bound_fails() {
        tally_after_kill(&[outcome(0, 0, Ok((200, "a".into())))], Duration::ZERO, Duration::from_millis(50));
    }
}
