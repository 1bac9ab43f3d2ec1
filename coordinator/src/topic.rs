//! Collector mode's routing: which registered engine a KV-event topic belongs to. Engines that
//! connect to the coordinator's bound SUB socket (`--kv-events-listen`) are told apart only by
//! the topic they publish under (vLLM's `--kv-events-config` `topic`); llm-d's convention is
//! `kv@<pod-ip-or-host>@<model>`. Pure: no sockets, no clock.

use std::collections::HashSet;

use crate::membership::EngineSpec;

/// llm-d's topic convention.
pub const DEFAULT_PATTERN: &str = "kv@{engine}@{model}";
/// Longer topics are nobody's: no registration may name one (`pd_api::MAX_NAME`) and the
/// pattern's fields are names too.
pub const MAX_TOPIC: usize = pd_api::MAX_NAME;

#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Engine,
    Model,
}

/// A topic pattern: literal text with `{engine}` (required) and `{model}` (optional).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopicPattern {
    segments: Vec<Segment>,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PatternError {
    #[error("topic pattern {0:?} has no {{engine}}")]
    NoEngine(String),
    #[error("topic pattern {0:?} names a field twice")]
    Repeated(String),
    #[error("topic pattern {0:?}: two fields need literal text between them")]
    Adjacent(String),
    #[error("topic pattern {0:?}: unknown field or stray brace (fields: {{engine}}, {{model}})")]
    Field(String),
}

/// What a topic says under the pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TopicFields<'a> {
    pub engine: &'a str,
    pub model: Option<&'a str>,
}

impl TopicPattern {
    pub fn parse(pattern: &str) -> Result<TopicPattern, PatternError> {
        let fail = |make: fn(String) -> PatternError| Err(make(pattern.to_string()));
        let mut segments = Vec::new();
        let mut rest = pattern;
        while !rest.is_empty() {
            let literal_end = rest.find(['{', '}']).unwrap_or(rest.len());
            if literal_end > 0 {
                segments.push(Segment::Literal(rest[..literal_end].to_string()));
                rest = &rest[literal_end..];
                continue;
            }
            let field = if let Some(after) = rest.strip_prefix("{engine}") {
                rest = after;
                Segment::Engine
            } else if let Some(after) = rest.strip_prefix("{model}") {
                rest = after;
                Segment::Model
            } else {
                return fail(PatternError::Field);
            };
            if segments.contains(&field) {
                return fail(PatternError::Repeated);
            }
            if matches!(segments.last(), Some(Segment::Engine | Segment::Model)) {
                return fail(PatternError::Adjacent);
            }
            segments.push(field);
        }
        if !segments.contains(&Segment::Engine) {
            return fail(PatternError::NoEngine);
        }
        Ok(TopicPattern { segments })
    }

    /// Reads `topic`: literals must match exactly; a field runs to the first occurrence of the
    /// literal after it (so field values cannot contain it) or to the end, and is not empty.
    pub fn read<'a>(&self, topic: &'a str) -> Option<TopicFields<'a>> {
        let (mut engine, mut model) = (None, None);
        let mut rest = topic;
        for (i, segment) in self.segments.iter().enumerate() {
            let value = match segment {
                Segment::Literal(text) => {
                    rest = rest.strip_prefix(text.as_str())?;
                    continue;
                }
                Segment::Engine | Segment::Model => match self.segments.get(i + 1) {
                    Some(Segment::Literal(next)) => {
                        let end = rest.find(next.as_str())?;
                        let value = &rest[..end];
                        rest = &rest[end..];
                        value
                    }
                    _ => std::mem::take(&mut rest),
                },
            };
            if value.is_empty() {
                return None;
            }
            match segment {
                Segment::Engine => engine = Some(value),
                _ => model = Some(value),
            }
        }
        match rest.is_empty() {
            true => Some(TopicFields { engine: engine?, model }),
            false => None,
        }
    }
}

/// The engine `topic` belongs to among `engines` (alive collector-mode engines: those without
/// a `kv_events` endpoint of their own). An engine whose registration names the topic wins;
/// otherwise the pattern's `{engine}` is an engine id, or else the host of exactly one engine's
/// URL, and `{model}`, when the pattern has it, must be that engine's model.
pub fn resolve<'a>(
    topic: &[u8],
    pattern: &TopicPattern,
    engines: impl Iterator<Item = (usize, &'a EngineSpec)> + Clone,
) -> Option<usize> {
    if topic.len() > MAX_TOPIC {
        return None;
    }
    let topic = std::str::from_utf8(topic).ok()?;
    if let Some((engine, _)) = engines.clone().find(|(_, spec)| spec.kv_events_topic.as_deref() == Some(topic)) {
        return Some(engine);
    }
    let fields = pattern.read(topic)?;
    let by_pattern = engines
        .filter(|(_, spec)| spec.kv_events_topic.is_none() && fields.model.is_none_or(|model| model == spec.model));
    if let Some((engine, _)) = by_pattern.clone().find(|(_, spec)| spec.id == fields.engine) {
        return Some(engine);
    }
    let mut by_host = by_pattern.filter(|(_, spec)| url_host(&spec.engine_url) == Some(fields.engine));
    match (by_host.next(), by_host.next()) {
        (Some((engine, _)), None) => Some(engine),
        // Several engines behind one host: the topic cannot say which.
        _ => None,
    }
}

/// The host of `scheme://host[:port][/path]`, IPv6 brackets removed.
fn url_host(url: &str) -> Option<&str> {
    let authority = url.split_once("://")?.1.split('/').next()?;
    let authority = authority.rsplit_once('@').map_or(authority, |(_, a)| a);
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split_once(']').map(|(host, _)| host);
    }
    Some(authority.split_once(':').map_or(authority, |(host, _)| host))
}

/// Topics already reported as unknown, so each is logged once; bounded, after which new
/// ones are only counted.
#[derive(Debug, Default)]
pub struct UnknownTopics {
    seen: HashSet<Vec<u8>>,
    full_reported: bool,
}

/// What to log about an unknown topic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FirstSight {
    /// Not seen before: log it.
    New,
    /// Seen before, or one too many to remember: stay quiet.
    Known,
    /// The set just became full: say that later ones go unlogged.
    Full,
}

impl UnknownTopics {
    pub const CAPACITY: usize = 1024;

    pub fn sight(&mut self, topic: &[u8]) -> FirstSight {
        let topic = &topic[..topic.len().min(MAX_TOPIC)];
        if self.seen.contains(topic) {
            return FirstSight::Known;
        }
        if self.seen.len() >= Self::CAPACITY {
            return match std::mem::replace(&mut self.full_reported, true) {
                false => FirstSight::Full,
                true => FirstSight::Known,
            };
        }
        self.seen.insert(topic.to_vec());
        FirstSight::New
    }
}

/// A topic as a log shows it: lossy UTF-8, cut at 128 bytes.
pub fn printable(topic: &[u8]) -> String {
    let cut = &topic[..topic.len().min(128)];
    let mut text = String::from_utf8_lossy(cut).into_owned();
    if topic.len() > cut.len() {
        text.push_str(&format!("…({} bytes)", topic.len()));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::membership::Role;

    fn spec(id: &str, url: &str, model: &str, topic: Option<&str>) -> EngineSpec {
        EngineSpec {
            id: id.into(),
            role: Role::Both,
            node: "n".into(),
            model: model.into(),
            engine_url: url.into(),
            sidecar_url: None,
            kv_events: None,
            kv_events_topic: topic.map(String::from),
            replay: None,
            xfer_side_channel: None,
            block_size: 16,
            capacity_blocks: None,
            data_parallel_size: None,
        }
    }

    #[test]
    fn patterns_parse_and_read() {
        let llmd = TopicPattern::parse(DEFAULT_PATTERN).unwrap();
        assert_eq!(
            llmd.read("kv@10.0.0.1@Qwen/Qwen3-32B"),
            Some(TopicFields { engine: "10.0.0.1", model: Some("Qwen/Qwen3-32B") })
        );
        for bad in ["kv@10.0.0.1", "kv@@m", "kv@e@", "xv@e@m", "", "kv@e"] {
            assert_eq!(llmd.read(bad), None, "{bad:?}");
        }
        let plain = TopicPattern::parse("{engine}").unwrap();
        assert_eq!(plain.read("p0"), Some(TopicFields { engine: "p0", model: None }));
        let suffix = TopicPattern::parse("events/{engine}/kv").unwrap();
        assert_eq!(suffix.read("events/d1/kv").map(|f| f.engine), Some("d1"));
        assert_eq!(suffix.read("events/d1/kvx"), None);

        for (bad, err) in [
            ("kv@{model}", PatternError::NoEngine("kv@{model}".into())),
            ("{engine}{model}", PatternError::Adjacent("{engine}{model}".into())),
            ("{engine}@{engine}", PatternError::Repeated("{engine}@{engine}".into())),
            ("{pod}@{engine}", PatternError::Field("{pod}@{engine}".into())),
            ("{engine}}", PatternError::Field("{engine}}".into())),
        ] {
            assert_eq!(TopicPattern::parse(bad), Err(err));
        }
    }

    #[test]
    fn topics_resolve_to_engines() {
        let pattern = TopicPattern::parse(DEFAULT_PATTERN).unwrap();
        let specs = [
            spec("p0", "http://10.0.0.1:8000", "m", None),
            spec("p1", "http://10.0.0.2:8000", "m", None),
            spec("p2", "http://10.0.0.2:8001", "m", None),
            spec("d0", "http://[fd00::3]:8000", "m", None),
            spec("x", "http://10.0.0.9:8000", "m", Some("custom-topic")),
        ];
        let engines = || specs.iter().enumerate();
        let find = |topic: &str| resolve(topic.as_bytes(), &pattern, engines());
        assert_eq!(find("kv@p1@m"), Some(1), "by id");
        assert_eq!(find("kv@10.0.0.1@m"), Some(0), "by the only engine on a host");
        assert_eq!(find("kv@fd00::3@m"), Some(3), "IPv6 host");
        assert_eq!(find("kv@10.0.0.2@m"), None, "two engines on that host");
        assert_eq!(find("kv@p0@other"), None, "another model");
        assert_eq!(find("custom-topic"), Some(4), "named in the registration");
        assert_eq!(find("kv@x@m"), None, "an engine naming its topic is found only by it");
        assert_eq!(find("kv@ghost@m"), None);
        assert_eq!(resolve(b"kv@p0@\xff", &pattern, engines()), None, "not UTF-8");
        let huge = format!("kv@p0@{}", "m".repeat(MAX_TOPIC));
        assert_eq!(find(&huge), None);
    }

    #[test]
    fn unknown_topics_are_reported_once_and_bounded() {
        let mut unknown = UnknownTopics::default();
        assert_eq!(unknown.sight(b"a"), FirstSight::New);
        assert_eq!(unknown.sight(b"a"), FirstSight::Known);
        for i in 1..UnknownTopics::CAPACITY {
            assert_eq!(unknown.sight(format!("t{i}").as_bytes()), FirstSight::New);
        }
        assert_eq!(unknown.sight(b"one more"), FirstSight::Full);
        assert_eq!(unknown.sight(b"and another"), FirstSight::Known);
        assert_eq!(unknown.seen.len(), UnknownTopics::CAPACITY);
        assert_eq!(printable(&[b'x'; 200]).len(), 128 + "…(200 bytes)".len());
    }
}
