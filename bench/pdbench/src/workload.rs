//! The workload generator: length distributions, shared system prompts and multi-turn
//! conversations, turned into OpenAI request bodies. Pure and seeded, so a run can be repeated
//! exactly (same prompts, same order) against several targets.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::{json, Value};

use crate::trace::Replay;

/// Errors parsing a workload flag.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum WorkloadError {
    #[error("bad distribution {0:?}: expected N, uniform:LO:HI or normal:MEAN:STD")]
    BadDist(String),
    #[error("bad prefix popularity {0:?}: expected cyclic, uniform or zipf[:S] with S >= 0")]
    BadPopularity(String),
}

/// A distribution of lengths (tokens; with the simulator's word tokenizer, words).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Dist {
    Fixed { value: u64 },
    Uniform { lo: u64, hi: u64 },
    Normal { mean: f64, std: f64 },
}

impl Dist {
    /// One sample, at least 1.
    pub fn sample(&self, rng: &mut impl Rng) -> u64 {
        let v = match *self {
            Dist::Fixed { value } => value,
            Dist::Uniform { lo, hi } => rng.random_range(lo..=hi),
            Dist::Normal { mean, std } => {
                // Box–Muller.
                let u1: f64 = rng.random_range(f64::EPSILON..1.0);
                let u2: f64 = rng.random();
                let z = (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos();
                (mean + std * z).round().max(1.0) as u64
            }
        };
        v.max(1)
    }
}

impl Dist {
    /// The largest value it gives in practice (normal: mean + 3 std).
    pub fn upper(&self) -> u64 {
        match *self {
            Dist::Fixed { value } => value.max(1),
            Dist::Uniform { hi, .. } => hi.max(1),
            Dist::Normal { mean, std } => (mean + 3.0 * std).ceil().max(1.0) as u64,
        }
    }
}

impl FromStr for Dist {
    type Err = WorkloadError;

    /// `128`, `fixed:128`, `uniform:64:256`, `normal:128:32`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || WorkloadError::BadDist(s.to_string());
        let parts: Vec<&str> = s.split(':').collect();
        match parts.as_slice() {
            [v] | ["fixed", v] => Ok(Dist::Fixed { value: v.parse().map_err(|_| bad())? }),
            ["uniform", lo, hi] => {
                let (lo, hi): (u64, u64) = (lo.parse().map_err(|_| bad())?, hi.parse().map_err(|_| bad())?);
                if lo > hi {
                    return Err(bad());
                }
                Ok(Dist::Uniform { lo, hi })
            }
            ["normal", m, sd] => {
                let (mean, std): (f64, f64) = (m.parse().map_err(|_| bad())?, sd.parse().map_err(|_| bad())?);
                if !(mean.is_finite() && std.is_finite() && std >= 0.0) {
                    return Err(bad());
                }
                Ok(Dist::Normal { mean, std })
            }
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for Dist {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dist::Fixed { value } => write!(f, "{value}"),
            Dist::Uniform { lo, hi } => write!(f, "uniform:{lo}:{hi}"),
            Dist::Normal { mean, std } => write!(f, "normal:{mean}:{std}"),
        }
    }
}

/// Which shared system prompt each conversation uses.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum Popularity {
    /// Conversation `i` uses prompt `i mod N` (every prompt equally often, in a fixed cycle).
    Cyclic,
    /// Drawn uniformly at random per conversation (seeded).
    Uniform,
    /// Drawn with probability proportional to `1 / rank^s` (prompt 0 the most popular).
    Zipf { s: f64 },
}

impl FromStr for Popularity {
    type Err = WorkloadError;

    /// `cyclic`, `uniform`, `zipf` (s = 1) or `zipf:S`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || WorkloadError::BadPopularity(s.to_string());
        match s.split(':').collect::<Vec<_>>().as_slice() {
            ["cyclic"] => Ok(Popularity::Cyclic),
            ["uniform"] => Ok(Popularity::Uniform),
            ["zipf"] => Ok(Popularity::Zipf { s: 1.0 }),
            ["zipf", e] => match e.parse::<f64>() {
                Ok(s) if s.is_finite() && s >= 0.0 => Ok(Popularity::Zipf { s }),
                _ => Err(bad()),
            },
            _ => Err(bad()),
        }
    }
}

impl fmt::Display for Popularity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Popularity::Cyclic => write!(f, "cyclic"),
            Popularity::Uniform => write!(f, "uniform"),
            Popularity::Zipf { s } => write!(f, "zipf:{s}"),
        }
    }
}

/// Which OpenAI endpoint the requests go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Api {
    /// `/v1/completions` with a `prompt`
    Completions,
    /// `/v1/chat/completions` with `messages`
    Chat,
}

impl Api {
    pub fn path(self) -> &'static str {
        match self {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
        }
    }
}

/// What to generate.
#[derive(Debug, Clone, Serialize)]
pub struct WorkloadSpec {
    /// Conversations (each of `turns` requests).
    pub conversations: usize,
    /// Requests per conversation; each resends the history (earlier turns and their answers).
    pub turns: usize,
    /// Length of each new user message.
    pub prompt_len: Dist,
    /// `max_tokens` of each request.
    pub output_len: Dist,
    /// Distinct shared system prompts (0: none).
    pub prefixes: usize,
    /// Length of each shared system prompt.
    pub prefix_len: usize,
    /// How conversations pick their system prompt.
    pub popularity: Popularity,
    pub api: Api,
    pub model: Option<String>,
    pub seed: u64,
}

impl WorkloadSpec {
    pub fn total_requests(&self) -> usize {
        self.conversations * self.turns
    }
}

/// Common English words, so prompts look like text to a real tokenizer too (the simulator's
/// word tokenizer counts one token per word).
pub const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "was", "with", "be", "by", "on", "not", "he",
    "this", "are", "or", "his", "from", "at", "which", "but", "have", "an", "had", "they", "you", "were", "their",
    "one", "all", "we", "can", "her", "has", "there", "been", "if", "more", "when", "will", "would", "who", "so", "no",
    "time", "about", "many", "then", "them", "some", "very", "like", "just", "over", "such", "our", "into", "most",
    "other", "only",
];

/// `n` random words.
pub fn random_words(rng: &mut impl Rng, n: usize) -> String {
    let mut s = String::with_capacity(n * 5);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
    }
    s
}

/// A Hugging Face tokenizer.json (word level, whitespace split) knowing [`WORDS`]; anything
/// else is `[UNK]`. Engines and a coordinator given this file agree on the token ids (and so on
/// block hashes) of every prompt this generator writes.
pub fn word_level_tokenizer() -> Value {
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), json!(0));
    for (i, w) in WORDS.iter().enumerate() {
        vocab.insert((*w).to_string(), json!(i + 1));
    }
    json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    })
}

/// One chat message.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Message {
    pub role: &'static str,
    pub content: String,
}

/// One planned conversation: its system prompt (if any) and the user message of each turn.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    pub id: usize,
    pub prefix_id: Option<usize>,
    pub system: Option<Arc<str>>,
    pub user_turns: Vec<String>,
    pub max_tokens: Vec<u64>,
}

/// A conversation in progress: the history sent so far.
#[derive(Debug, Clone)]
pub struct ChatState<'a> {
    conv: &'a Conversation,
    history: Vec<Message>,
    pub turn: usize,
}

/// One request, ready to send.
#[derive(Debug, Clone)]
pub struct Request {
    pub conversation: usize,
    pub turn: usize,
    pub prefix_id: Option<usize>,
    pub api: Api,
    /// Approximate prompt length in words (the simulator's tokens).
    pub prompt_words: usize,
    pub max_tokens: u64,
    pub messages: Vec<Message>,
    pub model: Option<String>,
}

impl Request {
    /// The prompt as one string (completions API): messages joined by blank lines.
    pub fn prompt_text(&self) -> String {
        self.messages.iter().map(|m| m.content.as_str()).collect::<Vec<_>>().join("\n\n")
    }

    /// The OpenAI request body.
    pub fn body(&self, stream: bool) -> Value {
        let mut body = match self.api {
            Api::Completions => json!({"prompt": self.prompt_text(), "max_tokens": self.max_tokens}),
            Api::Chat => json!({"messages": self.messages, "max_tokens": self.max_tokens}),
        };
        // Benchmarks want the full output length.
        body["ignore_eos"] = json!(true);
        body["stream"] = json!(stream);
        if stream {
            body["stream_options"] = json!({"include_usage": true});
        }
        if let Some(m) = &self.model {
            body["model"] = json!(m);
        }
        body
    }
}

impl<'a> ChatState<'a> {
    pub fn new(conv: &'a Conversation) -> Self {
        let history = conv.system.iter().map(|s| Message { role: "system", content: s.to_string() }).collect();
        ChatState { conv, history, turn: 0 }
    }

    /// The next turn's request, or None when the conversation is over.
    pub fn next_request(&mut self, spec: &WorkloadSpec) -> Option<Request> {
        let user = self.conv.user_turns.get(self.turn)?;
        self.history.push(Message { role: "user", content: user.clone() });
        let prompt_words = self.history.iter().map(|m| m.content.split_whitespace().count()).sum();
        Some(Request {
            conversation: self.conv.id,
            turn: self.turn,
            prefix_id: self.conv.prefix_id,
            api: spec.api,
            prompt_words,
            max_tokens: self.conv.max_tokens[self.turn],
            messages: self.history.clone(),
            model: spec.model.clone(),
        })
    }

    /// Records the answer to the current turn (resent with the following turns).
    pub fn answered(&mut self, text: &str) {
        self.history.push(Message { role: "assistant", content: text.to_string() });
        self.turn += 1;
    }
}

/// The planned workload: conversations generated on demand from the seed (a run of millions of
/// requests never holds them all), each a function of `(seed, id)` only.
#[derive(Debug, Clone)]
pub struct Workload {
    spec: WorkloadSpec,
    systems: Vec<Arc<str>>,
    /// Cumulative probability of each prefix id (random popularities only).
    prefix_cdf: Vec<f64>,
    /// A trace replayed instead of generated conversations (`spec` then gives only the API and
    /// the model).
    replay: Option<Replay>,
}

impl Workload {
    pub fn new(spec: &WorkloadSpec) -> Self {
        // System prompts: distinct per prefix id, independent of everything else.
        let systems = (0..spec.prefixes)
            .map(|p| {
                let mut prng = StdRng::seed_from_u64(spec.seed ^ (0x5eed_0000 + p as u64));
                Arc::from(format!("system{p} {}", random_words(&mut prng, spec.prefix_len.saturating_sub(1))))
            })
            .collect();
        let weights: Vec<f64> = match spec.popularity {
            Popularity::Cyclic => Vec::new(),
            Popularity::Uniform => vec![1.0; spec.prefixes],
            Popularity::Zipf { s } => (1..=spec.prefixes).map(|rank| (rank as f64).powf(-s)).collect(),
        };
        let total: f64 = weights.iter().sum();
        let prefix_cdf = weights
            .iter()
            .scan(0.0, |acc, w| {
                *acc += w / total;
                Some(*acc)
            })
            .collect();
        Workload { spec: spec.clone(), systems, prefix_cdf, replay: None }
    }

    /// A trace's requests, each a conversation of one turn, sent at the trace's times.
    pub fn replay(spec: &WorkloadSpec, replay: Replay) -> Self {
        let spec = WorkloadSpec { conversations: replay.len(), turns: 1, prefixes: 0, ..spec.clone() };
        Workload { spec, systems: Vec::new(), prefix_cdf: Vec::new(), replay: Some(replay) }
    }

    /// When each conversation starts, when the workload fixes it (a trace); None: the run's
    /// arrival process decides.
    pub fn arrivals(&self) -> Option<Vec<std::time::Duration>> {
        self.replay.as_ref().map(Replay::offsets)
    }

    /// The prefix id of conversation `id`; a random choice has its own stream, so the user
    /// messages do not depend on the popularity.
    fn prefix_of(&self, id: usize) -> Option<usize> {
        let n = self.spec.prefixes;
        if n == 0 {
            return None;
        }
        if self.prefix_cdf.is_empty() {
            return Some(id % n);
        }
        let mut rng = StdRng::seed_from_u64(self.spec.seed ^ 0x0070_6f70_0000_0000 ^ id as u64);
        let u: f64 = rng.random();
        Some(self.prefix_cdf.partition_point(|&c| c <= u).min(n - 1))
    }

    pub fn spec(&self) -> &WorkloadSpec {
        &self.spec
    }

    pub fn len(&self) -> usize {
        self.spec.conversations
    }

    pub fn is_empty(&self) -> bool {
        self.spec.conversations == 0
    }

    /// Conversation `id`.
    pub fn conversation(&self, id: usize) -> Conversation {
        if let Some(r) = &self.replay {
            return r.conversation(id);
        }
        let spec = &self.spec;
        let mut rng =
            StdRng::seed_from_u64(spec.seed.rotate_left(17) ^ (id as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let prefix_id = self.prefix_of(id);
        let user_turns = (0..spec.turns)
            .map(|t| {
                let n = spec.prompt_len.sample(&mut rng) as usize;
                // A unique leading word so distinct conversations never share the user part.
                format!("c{id}t{t} {}", random_words(&mut rng, n.saturating_sub(1)))
            })
            .collect();
        let max_tokens = (0..spec.turns).map(|_| spec.output_len.sample(&mut rng)).collect();
        Conversation { id, prefix_id, system: prefix_id.map(|p| Arc::clone(&self.systems[p])), user_turns, max_tokens }
    }
}

/// Every conversation at once (small workloads, tests).
pub fn generate(spec: &WorkloadSpec) -> Vec<Conversation> {
    let w = Workload::new(spec);
    (0..w.len()).map(|i| w.conversation(i)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> WorkloadSpec {
        WorkloadSpec {
            conversations: 12,
            turns: 3,
            prompt_len: Dist::Fixed { value: 20 },
            output_len: Dist::Uniform { lo: 4, hi: 8 },
            prefixes: 3,
            prefix_len: 50,
            popularity: Popularity::Cyclic,
            api: Api::Chat,
            model: None,
            seed: 7,
        }
    }

    #[test]
    fn parses_distributions() {
        assert_eq!("128".parse::<Dist>(), Ok(Dist::Fixed { value: 128 }));
        assert_eq!("fixed:5".parse::<Dist>(), Ok(Dist::Fixed { value: 5 }));
        assert_eq!("uniform:1:9".parse::<Dist>(), Ok(Dist::Uniform { lo: 1, hi: 9 }));
        assert_eq!("normal:100:10".parse::<Dist>(), Ok(Dist::Normal { mean: 100.0, std: 10.0 }));
        for bad in ["", "x", "uniform:9:1", "uniform:1", "normal:1:-1", "gamma:1:2"] {
            assert!(bad.parse::<Dist>().is_err(), "{bad}");
        }
        assert_eq!("uniform:1:9".parse::<Dist>().unwrap().to_string(), "uniform:1:9");
    }

    #[test]
    fn samples_stay_in_range_and_follow_the_distribution() {
        let mut rng = StdRng::seed_from_u64(1);
        let u = Dist::Uniform { lo: 10, hi: 20 };
        let xs: Vec<u64> = (0..10_000).map(|_| u.sample(&mut rng)).collect();
        assert!(xs.iter().all(|&x| (10..=20).contains(&x)));
        assert!(xs.contains(&10) && xs.contains(&20));
        let n = Dist::Normal { mean: 200.0, std: 20.0 };
        let xs: Vec<f64> = (0..20_000).map(|_| n.sample(&mut rng) as f64).collect();
        let mean = xs.iter().sum::<f64>() / xs.len() as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / xs.len() as f64;
        assert!((mean - 200.0).abs() < 1.0, "mean {mean}");
        assert!((var.sqrt() - 20.0).abs() < 1.0, "std {}", var.sqrt());
        // Never below 1 even when the normal goes negative.
        let low = Dist::Normal { mean: 0.0, std: 5.0 };
        assert!((0..1000).all(|_| low.sample(&mut rng) >= 1));
    }

    #[test]
    fn same_seed_same_workload_and_shared_prefixes() {
        let s = spec();
        let a = generate(&s);
        assert_eq!(a, generate(&s));
        assert_ne!(a, generate(&WorkloadSpec { seed: 8, ..s.clone() }));
        assert_eq!(a.len(), 12);
        for c in &a {
            let p = c.prefix_id.unwrap();
            assert_eq!(p, c.id % 3);
            assert_eq!(c.system.as_ref(), a[p].system.as_ref(), "same prefix id, same system prompt");
            assert_eq!(c.system.as_ref().unwrap().split_whitespace().count(), 50);
            assert!(c.user_turns.iter().all(|u| u.split_whitespace().count() == 20));
            assert!(c.max_tokens.iter().all(|m| (4..=8).contains(m)));
        }
        assert_ne!(a[0].system, a[1].system);
        assert_ne!(a[0].user_turns[0], a[3].user_turns[0]);
    }

    #[test]
    fn random_popularities_pick_prefixes_by_weight() {
        assert_eq!("cyclic".parse::<Popularity>(), Ok(Popularity::Cyclic));
        assert_eq!("zipf".parse::<Popularity>(), Ok(Popularity::Zipf { s: 1.0 }));
        assert_eq!("zipf:0.8".parse::<Popularity>(), Ok(Popularity::Zipf { s: 0.8 }));
        for bad in ["", "zipf:-1", "zipf:x", "normal"] {
            assert!(bad.parse::<Popularity>().is_err(), "{bad}");
        }
        let count = |popularity| {
            let s = WorkloadSpec { conversations: 6000, prefixes: 6, popularity, ..spec() };
            let mut n = [0usize; 6];
            for c in generate(&s) {
                n[c.prefix_id.unwrap()] += 1;
            }
            n
        };
        // Uniform: every prefix about 1000 times, and not in a cycle.
        let u = count(Popularity::Uniform);
        assert!(u.iter().all(|&k| (850..1150).contains(&k)), "{u:?}");
        let s = WorkloadSpec { popularity: Popularity::Uniform, ..spec() };
        let ids: Vec<usize> = generate(&s).iter().map(|c| c.prefix_id.unwrap()).collect();
        assert!(ids.iter().enumerate().any(|(i, &p)| p != i % 3), "{ids:?}");
        // Zipf s = 1 over 6: weights 1, 1/2, ... 1/6 (sum 2.45): prefix 0 about 41%, 5 about 7%.
        let z = count(Popularity::Zipf { s: 1.0 });
        assert!((2250..2650).contains(&z[0]) && (300..520).contains(&z[5]), "{z:?}");
        assert!(z.windows(2).all(|w| w[0] > w[1]), "{z:?}");
        // The user messages do not depend on the popularity.
        assert_eq!(generate(&s)[4].user_turns, generate(&spec())[4].user_turns);
    }

    #[test]
    fn multi_turn_resends_history() {
        let s = spec();
        let convs = generate(&s);
        let mut st = ChatState::new(&convs[1]);
        let r0 = st.next_request(&s).unwrap();
        assert_eq!(r0.messages.len(), 2);
        assert_eq!(r0.prompt_words, 70);
        st.answered("an answer of five words");
        let r1 = st.next_request(&s).unwrap();
        assert_eq!(r1.turn, 1);
        assert_eq!(r1.messages.len(), 4);
        assert_eq!(&r1.messages[..2], &r0.messages[..]);
        assert_eq!(r1.messages[2], Message { role: "assistant", content: "an answer of five words".into() });
        assert_eq!(r1.prompt_words, 70 + 5 + 20);
        st.answered("x");
        assert!(st.next_request(&s).is_some());
        st.answered("y");
        assert!(st.next_request(&s).is_none());
    }

    #[test]
    fn bodies_match_the_api() {
        let s = WorkloadSpec { model: Some("m".into()), ..spec() };
        let convs = generate(&s);
        let r = ChatState::new(&convs[0]).next_request(&s).unwrap();
        let b = r.body(true);
        assert_eq!(b["messages"][0]["role"], "system");
        assert_eq!(b["stream"], true);
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert_eq!(b["model"], "m");
        let c = Request { api: Api::Completions, ..r };
        let b = c.body(false);
        assert!(b["prompt"].as_str().unwrap().starts_with("system0 "));
        // Lazily generated conversations equal the eager ones.
        let w = Workload::new(&s);
        assert_eq!(w.conversation(5), convs[5]);
        assert_eq!(b["stream"], false);
        assert!(b.get("stream_options").is_none());
        assert_eq!(Api::Chat.path(), "/v1/chat/completions");
    }
}
