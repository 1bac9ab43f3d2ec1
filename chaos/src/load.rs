//! A steady closed-loop load through the decode nodes' sidecars, sent with pdbench's client:
//! `workers` requests in flight, each worker pausing between its requests. Every request is
//! recorded with when it started and ended and how it failed, so that the scenarios can ask
//! about any time window. An entry can be taken out of rotation, as a load balancer's health
//! check would take out a node whose engine died.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdbench::client::{ErrorKind, Target, Timeouts};
use pdbench::workload::{Api, Message, Request};
use rand::Rng;

use crate::cluster::MODEL;

/// One request as the client saw it; times are since the load started.
#[derive(Debug, Clone)]
pub struct Record {
    pub start: Duration,
    pub end: Duration,
    pub error: Option<ErrorKind>,
}

/// How much load.
#[derive(Debug, Clone, Copy)]
pub struct LoadShape {
    pub workers: usize,
    pub pause: Duration,
    pub prompt_words: (usize, usize),
    pub max_tokens: u64,
    /// Client-side limit of a request: a request that hits it is a hang.
    pub timeout: Duration,
}

impl Default for LoadShape {
    fn default() -> Self {
        LoadShape {
            workers: 4,
            pause: Duration::from_millis(20),
            prompt_words: (48, 160),
            max_tokens: 12,
            timeout: Duration::from_secs(30),
        }
    }
}

/// A running load; [`Load::stop`] ends it and returns the records.
#[derive(Debug)]
pub struct Load {
    pub started: Instant,
    stop: Arc<AtomicBool>,
    entries: Arc<Vec<(String, Arc<EntryFlag>)>>,
    records: Arc<Mutex<Vec<Record>>>,
    workers: Vec<tokio::task::JoinHandle<()>>,
}

/// Whether an entry is in rotation.
#[derive(Debug, Default)]
struct EntryFlag(AtomicBool);

/// A prompt of `words` words: a quarter from the worker's own prefix, the rest random. Mostly
/// new prompts keep the requests disaggregated: with a prompt mostly cached on the decode, the
/// coordinator would have the decode prefill it locally.
fn prompt(rng: &mut impl Rng, worker: usize, words: usize) -> String {
    let shared = words / 4;
    let mut out: Vec<String> = (0..shared).map(|i| format!("w{worker}p{i}")).collect();
    out.extend((shared..words).map(|_| format!("t{}", rng.random_range(0..1_000_000u32))));
    out.join(" ")
}

impl Load {
    /// Starts the load against `entry_urls` (sidecar base URLs), on the current runtime.
    pub fn start(http: reqwest::Client, entry_urls: &[String], shape: LoadShape) -> Load {
        let entries: Vec<(String, Arc<EntryFlag>)> =
            entry_urls.iter().map(|u| (u.clone(), Arc::new(EntryFlag(AtomicBool::new(true))))).collect();
        let entries = Arc::new(entries);
        let targets: Arc<Vec<Target>> =
            Arc::new(entries.iter().map(|(u, _)| Target::round_robin(vec![u.clone()])).collect());
        let started = Instant::now();
        let stop = Arc::new(AtomicBool::new(false));
        let records = Arc::new(Mutex::new(Vec::new()));
        let next = Arc::new(AtomicUsize::new(0));
        let timeouts = Timeouts { request: shape.timeout, idle: shape.timeout };
        let workers = (0..shape.workers)
            .map(|w| {
                let (http, stop, records, next) = (http.clone(), stop.clone(), records.clone(), next.clone());
                let (entries, targets) = (entries.clone(), targets.clone());
                tokio::spawn(async move {
                    let mut n = 0usize;
                    while !stop.load(Ordering::Relaxed) {
                        let Some(i) = pick(&entries, &next) else {
                            tokio::time::sleep(shape.pause).await;
                            continue;
                        };
                        let words = rand::rng().random_range(shape.prompt_words.0..=shape.prompt_words.1);
                        let content = prompt(&mut rand::rng(), w, words);
                        let req = Request {
                            conversation: w * 1_000_000 + n,
                            turn: 0,
                            prefix_id: None,
                            api: Api::Completions,
                            prompt_words: words,
                            max_tokens: shape.max_tokens,
                            messages: vec![Message { role: "user", content }],
                            model: Some(MODEL.to_string()),
                        };
                        n += 1;
                        let start = started.elapsed();
                        let outcome = targets[i].send(&http, &req, false, timeouts).await;
                        let record = Record { start, end: started.elapsed(), error: outcome.error };
                        records.lock().unwrap_or_else(|p| p.into_inner()).push(record);
                        tokio::time::sleep(shape.pause).await;
                    }
                })
            })
            .collect();
        Load { started, stop, entries, records, workers }
    }

    /// Takes the entry with this URL out of rotation (requests in flight finish).
    pub fn disable(&self, url: &str) {
        for (u, flag) in self.entries.iter() {
            if u == url {
                flag.0.store(false, Ordering::Relaxed);
            }
        }
    }

    /// Time since the load started.
    pub fn now(&self) -> Duration {
        self.started.elapsed()
    }

    /// Stops starting requests; those in flight go on.
    pub fn halt(&self) {
        self.stop.store(true, Ordering::Relaxed);
    }

    /// Stops starting requests, waits for those in flight (bounded by their timeout), returns
    /// every record.
    pub async fn stop(self) -> Vec<Record> {
        self.stop.store(true, Ordering::Relaxed);
        for w in self.workers {
            let _ = w.await;
        }
        let mut records = std::mem::take(&mut *self.records.lock().unwrap_or_else(|p| p.into_inner()));
        records.sort_by_key(|r| r.start);
        records
    }
}

fn pick(entries: &[(String, Arc<EntryFlag>)], next: &AtomicUsize) -> Option<usize> {
    for _ in 0..entries.len() {
        let i = next.fetch_add(1, Ordering::Relaxed) % entries.len();
        if entries[i].1 .0.load(Ordering::Relaxed) {
            return Some(i);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_share_a_prefix_per_worker_and_have_the_asked_length() {
        let mut rng = rand::rng();
        let a = prompt(&mut rng, 1, 40);
        let b = prompt(&mut rng, 1, 40);
        assert_eq!(a.split(' ').count(), 40);
        assert_eq!(a.split(' ').take(10).collect::<Vec<_>>(), b.split(' ').take(10).collect::<Vec<_>>());
        assert_ne!(a, b);
        assert!(prompt(&mut rng, 2, 40).starts_with("w2p0 "));
    }

    #[test]
    fn disabled_entries_are_skipped() {
        let entries: Vec<(String, Arc<EntryFlag>)> =
            ["a", "b"].iter().map(|u| (u.to_string(), Arc::new(EntryFlag(AtomicBool::new(true))))).collect();
        entries[0].1 .0.store(false, Ordering::Relaxed);
        let next = AtomicUsize::new(0);
        assert_eq!((pick(&entries, &next), pick(&entries, &next)), (Some(1), Some(1)));
        entries[1].1 .0.store(false, Ordering::Relaxed);
        assert_eq!(pick(&entries, &next), None);
    }
}
