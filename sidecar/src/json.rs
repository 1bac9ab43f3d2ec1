//! A JSON object as its top-level entries in order, each value kept as the exact text it had
//! (`serde_json::value::RawValue`), so that rewriting a request touches only the keys it must:
//! engine-owned values (`kv_transfer_params`) pass through byte for byte — key order, number
//! precision and all — without turning on serde_json features that would change every other
//! crate of the workspace.

use std::borrow::Cow;
use std::fmt;

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::value::RawValue;

/// The top-level entries of a JSON object, borrowed from the text they were parsed from.
#[derive(Debug, Default)]
pub struct Object<'a> {
    entries: Vec<(Cow<'a, str>, &'a RawValue)>,
}

/// A change applied by [`Object::rewrite`]; values are JSON text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Edit<'v> {
    /// Set the key (in place when present, appended otherwise).
    Set(&'v str),
    /// Set the key only when the object has it.
    Replace(&'v str),
    /// Drop every occurrence of the key.
    Remove,
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NotAnObject(String);

impl<'a> Object<'a> {
    /// Parses `text`, which must hold one JSON object.
    pub fn parse(text: &'a [u8]) -> Result<Object<'a>, NotAnObject> {
        let mut de = serde_json::Deserializer::from_slice(text);
        let object = Object::deserialize(&mut de).map_err(|e| NotAnObject(e.to_string()))?;
        de.end().map_err(|e| NotAnObject(e.to_string()))?;
        Ok(object)
    }

    /// The value of `key` as JSON text (the last occurrence, as most JSON readers do).
    pub fn get(&self, key: &str) -> Option<&'a RawValue> {
        self.entries.iter().rev().find(|(k, _)| k == key).map(|(_, v)| *v)
    }

    pub fn contains(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// `key` parsed as a value (for the few fields a proxy must read: flags, prompt sizes).
    pub fn parsed<T: Deserialize<'a>>(&self, key: &str) -> Option<T> {
        self.get(key).and_then(|raw| serde_json::from_str(raw.get()).ok())
    }

    /// `key` as a boolean; `null`, absent or of another type reads as `None`.
    pub fn bool(&self, key: &str) -> Option<bool> {
        self.parsed(key)
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|(k, _)| k.as_ref())
    }

    /// Writes the object with `edits` applied: entries keep their order and exact text, a set
    /// key takes the place of its first occurrence (later duplicates are dropped), new keys go
    /// at the end in the order given.
    pub fn rewrite(&self, edits: &[(&str, Edit<'_>)]) -> Vec<u8> {
        let extra: usize = edits.iter().map(|(k, e)| k.len() + 4 + edit_len(e)).sum();
        let mut out = Vec::with_capacity(
            self.entries.iter().map(|(k, v)| k.len() + v.get().len() + 4).sum::<usize>() + extra + 2,
        );
        out.push(b'{');
        let mut written: Vec<&str> = Vec::new();
        let mut first = true;
        for (key, value) in &self.entries {
            let key = key.as_ref();
            let edit = edits.iter().find(|(k, _)| *k == key).map(|(_, e)| *e);
            let text = match edit {
                Some(Edit::Remove) => continue,
                Some(Edit::Set(v) | Edit::Replace(v)) => {
                    if written.contains(&key) {
                        continue;
                    }
                    written.push(key);
                    v
                }
                None => value.get(),
            };
            push_entry(&mut out, &mut first, key, text);
        }
        for (key, edit) in edits {
            if let Edit::Set(v) = edit {
                if !written.contains(key) && !self.contains(key) {
                    push_entry(&mut out, &mut first, key, v);
                }
            }
        }
        out.push(b'}');
        out
    }
}

fn edit_len(e: &Edit<'_>) -> usize {
    match e {
        Edit::Set(v) | Edit::Replace(v) => v.len(),
        Edit::Remove => 0,
    }
}

fn push_entry(out: &mut Vec<u8>, first: &mut bool, key: &str, value: &str) {
    if !*first {
        out.push(b',');
    }
    *first = false;
    // Keys are re-escaped (an equivalent spelling); values are copied as they came.
    serde_json::to_writer(&mut *out, key).expect("writing to a Vec cannot fail");
    out.push(b':');
    out.extend_from_slice(value.as_bytes());
}

/// A string as JSON text.
pub fn string(s: &str) -> String {
    serde_json::to_string(s).expect("a string always serialises")
}

/// A key that borrows from the input when it has no escapes.
struct Key<'a>(Cow<'a, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string key")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Key<'de>, E> {
                Ok(Key(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

impl<'de> Deserialize<'de> for Object<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Object<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a JSON object")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Object<'de>, M::Error> {
                let mut entries = Vec::with_capacity(map.size_hint().unwrap_or(16));
                while let Some((Key(k), v)) = map.next_entry::<Key<'de>, &'de RawValue>()? {
                    entries.push((k, v));
                }
                Ok(Object { entries })
            }
        }
        d.deserialize_map(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(v: Vec<u8>) -> String {
        String::from_utf8(v).unwrap()
    }

    #[test]
    fn keeps_order_text_and_precision() {
        let body = br#"{ "z": 1, "a" : {"y": 1.000000000000000000001, "b": [1, 2]}, "big": 123456789012345678901234567890, "e\u0041": "x" }"#;
        let o = Object::parse(body).unwrap();
        assert_eq!(o.keys().collect::<Vec<_>>(), ["z", "a", "big", "eA"]);
        assert_eq!(o.get("a").unwrap().get(), r#"{"y": 1.000000000000000000001, "b": [1, 2]}"#);
        let out = text(o.rewrite(&[]));
        assert_eq!(
            out,
            r#"{"z":1,"a":{"y": 1.000000000000000000001, "b": [1, 2]},"big":123456789012345678901234567890,"eA":"x"}"#
        );
    }

    #[test]
    fn edits_in_place_remove_and_append() {
        let o = Object::parse(
            br#"{"stream": true, "n": 1, "stream_options": {"include_usage": true}, "stream": false, "k": 2}"#,
        )
        .unwrap();
        assert_eq!(o.bool("stream"), Some(false), "the last duplicate wins");
        let out = text(o.rewrite(&[
            ("stream", Edit::Set("false")),
            ("stream_options", Edit::Remove),
            ("max_tokens", Edit::Set("1")),
            ("max_completion_tokens", Edit::Replace("1")),
            ("k", Edit::Replace("3")),
        ]));
        assert_eq!(out, r#"{"stream":false,"n":1,"k":3,"max_tokens":1}"#);
        let empty = Object::parse(b"{}").unwrap();
        assert_eq!(text(empty.rewrite(&[("a", Edit::Set("null")), ("b", Edit::Remove)])), r#"{"a":null}"#);
    }

    #[test]
    fn rejects_what_is_not_one_object() {
        for bad in [&b"[1]"[..], b"{\"a\":1} x", b"{\"a\":", b"", b"nul", b"\"s\"", b"{1:2}"] {
            assert!(Object::parse(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        assert!(Object::parse(b" {\"a\": 1} \n").is_ok());
        assert_eq!(string("a\"b"), r#""a\"b""#);
    }
}
