//! `Authorization: Bearer <token>`: the header a daemon demands, or sends to another.

use std::fmt;

use http::{header, HeaderMap, HeaderValue};

#[derive(Debug, thiserror::Error)]
pub enum BearerError {
    #[error("the bearer token is empty")]
    Empty,
    #[error("the bearer token has characters an HTTP header cannot carry")]
    NotAHeader,
}

/// A bearer token as its header value (marked sensitive, so it is never logged).
#[derive(Clone, PartialEq, Eq)]
pub struct Bearer(HeaderValue);

impl fmt::Debug for Bearer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Bearer(..)")
    }
}

impl Bearer {
    pub fn new(token: &str) -> Result<Bearer, BearerError> {
        let token = token.trim();
        if token.is_empty() {
            return Err(BearerError::Empty);
        }
        let mut value = HeaderValue::from_str(&format!("Bearer {token}")).map_err(|_| BearerError::NotAHeader)?;
        value.set_sensitive(true);
        Ok(Bearer(value))
    }

    /// The `Authorization` value to send.
    pub fn header(&self) -> &HeaderValue {
        &self.0
    }

    /// Whether `headers` carry this token. The comparison takes the same time wherever the
    /// inputs differ, so a prober learns nothing from timing.
    pub fn admits(&self, headers: &HeaderMap) -> bool {
        let given = headers.get(header::AUTHORIZATION).map(HeaderValue::as_bytes).unwrap_or_default();
        let expected = self.0.as_bytes();
        given.len() == expected.len() && given.iter().zip(expected).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

impl std::str::FromStr for Bearer {
    type Err = BearerError;

    fn from_str(token: &str) -> Result<Bearer, BearerError> {
        Bearer::new(token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with(value: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, HeaderValue::from_str(value).unwrap());
        h
    }

    #[test]
    fn admits_only_the_exact_token() {
        let b = Bearer::new("s3cret").unwrap();
        assert!(b.admits(&with("Bearer s3cret")));
        for wrong in ["Bearer s3cre", "Bearer s3cret2", "bearer s3cret", "s3cret", ""] {
            assert!(!b.admits(&with(wrong)), "{wrong:?}");
        }
        assert!(!b.admits(&HeaderMap::new()));
        assert!(b.header().is_sensitive());
        assert_eq!(format!("{b:?}"), "Bearer(..)");
    }

    #[test]
    fn refuses_tokens_a_header_cannot_carry() {
        assert!(matches!(Bearer::new("  "), Err(BearerError::Empty)));
        assert!(matches!(Bearer::new("a\nb"), Err(BearerError::NotAHeader)));
        assert_eq!(
            Bearer::new(" t\n").unwrap(),
            Bearer::new("t").unwrap(),
            "surrounding whitespace (a token file's newline) is trimmed"
        );
    }
}
