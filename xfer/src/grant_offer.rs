//! Grants offered under a name and claimed over the side channel ([`crate::Agent::offer_grant`],
//! [`crate::Agent::claim_grant`]).
//!
//! A target that does not know in advance which peer will read some held memory, nor exactly
//! which ranges (vLLM's prefill knows only the request id), offers a grant under a name (the
//! request id). The first peer that claims the name, with the ranges it will read, gets a
//! grant bound to it; later claims by that peer get more grants, claims by anyone else are
//! refused. Revoking the offer revokes every grant claimed under it, waiting as
//! [`crate::Grant::revoke`] does, and a claim that comes later is refused `Revoked`.
//!
//! Wire (the body of side-channel op 4, all integers little-endian):
//! ```text
//! claim:  name len u16 | name | claimant len u8 | claimant | mem type len u8 | mem type |
//!         ranges u32 | per range: addr u64 | len u64 | dev u64
//! reply:  code u16 (0: granted, else a RefusalCode) | grant token, or the refusal as UTF-8
//! ```
//! `claimant` is the peer's agent name; when the side channel is authenticated it must be
//! empty or the authenticated name.
//!
//! A claim for a name not (yet) offered is answered `UnknownKey` at once: the side channel
//! never holds a handler waiting for an offer, so no peer can tie handlers up with early
//! claims. The claimant asks again, backing off, for up to [`CLAIM_WAIT`]
//! ([`next_claim_attempt`]).

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use xfer_core::{Desc, MemType, RefusalCode};

use crate::error::XferError;
use crate::grant::{Grant, Reader};

/// How long a claimant keeps asking for a name not yet offered: the target may learn that it
/// holds the memory a little after the peer learns where to read it.
pub const CLAIM_WAIT: Duration = Duration::from_secs(2);
/// The claimant's first pause before asking again; each later one doubles, up to
/// [`CLAIM_RETRY_MAX`].
const CLAIM_RETRY_FIRST: Duration = Duration::from_millis(5);
const CLAIM_RETRY_MAX: Duration = Duration::from_millis(100);
/// Ended offers remembered so that a late claim hears `Revoked`, not `UnknownKey` (which the
/// claimant would retry for [`CLAIM_WAIT`]).
const ENDED_REMEMBERED: usize = 4096;
/// At most this many ranges in one claim (a request's blocks per layer region).
const MAX_CLAIM_RANGES: usize = 1 << 16;

/// A peer's claim: the offer's name, who claims, and what it will read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Claim {
    pub name: String,
    pub claimant: String,
    pub mem_type: MemType,
    pub ranges: Vec<Desc>,
}

fn bad(reason: impl std::fmt::Display) -> XferError {
    XferError::InvalidArgument(format!("grant claim: {reason}"))
}

impl Claim {
    pub fn encode(&self) -> Result<Vec<u8>, XferError> {
        let mem_type = self.mem_type.to_string();
        if self.name.len() > usize::from(u16::MAX) || self.claimant.len() > usize::from(u8::MAX) {
            return Err(bad("name too long"));
        }
        if self.ranges.len() > MAX_CLAIM_RANGES {
            return Err(bad(format!("{} ranges (at most {MAX_CLAIM_RANGES})", self.ranges.len())));
        }
        let mut out = Vec::with_capacity(16 + self.name.len() + self.claimant.len() + 24 * self.ranges.len());
        out.extend_from_slice(&(self.name.len() as u16).to_le_bytes());
        out.extend_from_slice(self.name.as_bytes());
        out.push(self.claimant.len() as u8);
        out.extend_from_slice(self.claimant.as_bytes());
        out.push(mem_type.len() as u8);
        out.extend_from_slice(mem_type.as_bytes());
        out.extend_from_slice(&(self.ranges.len() as u32).to_le_bytes());
        for range in &self.ranges {
            for word in [range.addr, range.len, range.dev_id] {
                out.extend_from_slice(&word.to_le_bytes());
            }
        }
        Ok(out)
    }

    /// Decodes untrusted bytes; never panics.
    pub fn decode(bytes: &[u8]) -> Result<Self, XferError> {
        let mut reader = Reader(bytes);
        let name_len = usize::from(reader.u16()?);
        let name = reader.text(name_len)?;
        let claimant_len = usize::from(reader.take(1)?[0]);
        let claimant = reader.text(claimant_len)?;
        let mem_len = usize::from(reader.take(1)?[0]);
        let mem_type = reader.text(mem_len)?.parse::<MemType>().map_err(|_| bad("unknown memory type"))?;
        let count = u32::from_le_bytes(reader.take(4)?.try_into().map_err(|_| bad("truncated"))?) as usize;
        if count > MAX_CLAIM_RANGES || count.saturating_mul(24) > reader.0.len() {
            return Err(bad("range count does not match the body"));
        }
        let mut ranges = Vec::with_capacity(count);
        for _ in 0..count {
            ranges.push(Desc::new(reader.u64()?, reader.u64()?, reader.u64()?));
        }
        if !reader.0.is_empty() {
            return Err(bad("trailing bytes"));
        }
        Ok(Claim { name, claimant, mem_type, ranges })
    }
}

/// Decodes a claim body (untrusted bytes) exactly as the side channel does and encodes what it
/// asks for again: the claim's canonical bytes. The one public door to the claim codec, for the
/// fuzz target and its seeds; the claim itself stays private.
pub fn recode_claim(body: &[u8]) -> Result<Vec<u8>, XferError> {
    Claim::decode(body)?.encode()
}

/// After `attempts` claims refused `UnknownKey`, the first sent at `started`: how long to
/// pause before asking again, or `None` when the next ask would start past [`CLAIM_WAIT`].
pub(crate) fn next_claim_attempt(started: Instant, now: Instant, attempts: u32) -> Option<Duration> {
    let pause = CLAIM_RETRY_FIRST.saturating_mul(1 << attempts.saturating_sub(1).min(16)).min(CLAIM_RETRY_MAX);
    let deadline = started + CLAIM_WAIT;
    (now + pause < deadline).then_some(pause)
}

/// The reply's form: a token, or a refusal.
pub(crate) fn encode_reply(reply: &Result<Vec<u8>, (RefusalCode, String)>) -> Vec<u8> {
    let (code, body) = match reply {
        Ok(token) => (0, token.as_slice()),
        Err((code, message)) => (code.to_wire(), message.as_bytes()),
    };
    let mut out = code.to_le_bytes().to_vec();
    out.extend_from_slice(body);
    out
}

/// Parses [`encode_reply`]'s form: the token, or the refusal as [`XferError::Refused`].
pub(crate) fn decode_reply(bytes: &[u8]) -> Result<Vec<u8>, XferError> {
    let (code, body) = match bytes {
        [a, b, body @ ..] => (u16::from_le_bytes([*a, *b]), body),
        _ => return Err(bad("reply truncated")),
    };
    match code {
        0 => Ok(body.to_vec()),
        code => Err(XferError::Refused {
            code: RefusalCode::from_wire(code),
            message: String::from_utf8_lossy(body).into_owned(),
        }),
    }
}

struct Offer {
    /// Tells this offer from a later one of the same name.
    id: u64,
    expires: Instant,
    claimant: Option<String>,
    grants: Vec<Grant>,
}

#[derive(Default)]
struct Offers {
    open: HashMap<String, Offer>,
    ended: VecDeque<String>,
    next_id: u64,
}

/// An agent's open offers, and the names of recently ended ones.
#[derive(Default)]
pub(crate) struct OfferTable {
    offers: Mutex<Offers>,
}

impl OfferTable {
    /// Opens an offer; an open offer of the same name is replaced (its grants revoked).
    pub fn open(self: &Arc<Self>, name: &str, ttl: Duration) -> GrantOffer {
        let (id, replaced) = {
            let mut offers = self.offers.lock();
            offers.next_id += 1;
            let id = offers.next_id;
            offers.ended.retain(|ended| ended != name);
            let offer = Offer { id, expires: Instant::now() + ttl, claimant: None, grants: Vec::new() };
            (id, offers.open.insert(name.to_string(), offer))
        };
        drop(replaced);
        GrantOffer { name: name.to_string(), id, table: Arc::clone(self), claimed_by: Mutex::new(None) }
    }

    /// Answers a claim at once; a name not offered (yet) is `UnknownKey`. `issue` makes the
    /// grant, given the offer's remaining time; it runs under the table's lock so that a
    /// revocation cannot slip between issuing and recording the grant.
    pub fn claim(
        &self,
        name: &str,
        claimant: &str,
        issue: impl FnOnce(Duration) -> Result<Grant, XferError>,
    ) -> Result<Vec<u8>, (RefusalCode, String)> {
        let mut offers = self.offers.lock();
        let Some(offer) = offers.open.get_mut(name) else {
            if offers.ended.iter().any(|ended| ended == name) {
                return Err((RefusalCode::Revoked, format!("the grant offered as {name:?} was revoked")));
            }
            return Err((RefusalCode::UnknownKey, format!("no grant is offered as {name:?}")));
        };
        let now = Instant::now();
        if now >= offer.expires {
            return Err((RefusalCode::Revoked, format!("the grant offered as {name:?} has expired")));
        }
        if let Some(other) = offer.claimant.as_deref().filter(|other| *other != claimant) {
            return Err((RefusalCode::WrongAgent, format!("the grant offered as {name:?} was claimed by {other:?}")));
        }
        let grant = issue(offer.expires - now).map_err(|err| (RefusalCode::BadRequest, err.to_string()))?;
        let token = grant.token();
        offer.claimant = Some(claimant.to_string());
        offer.grants.push(grant);
        Ok(token)
    }

    /// The peer that claimed an open offer.
    fn claimant(&self, name: &str, id: u64) -> Option<String> {
        let offers = self.offers.lock();
        offers.open.get(name).filter(|offer| offer.id == id).and_then(|offer| offer.claimant.clone())
    }

    /// Ends the offer `id` of that name (not a later one that replaced it).
    fn end(&self, name: &str, id: u64) -> Option<Offer> {
        let mut offers = self.offers.lock();
        if offers.open.get(name).is_none_or(|offer| offer.id != id) {
            return None;
        }
        let offer = offers.open.remove(name);
        if offers.ended.len() >= ENDED_REMEMBERED {
            offers.ended.pop_front();
        }
        offers.ended.push_back(name.to_string());
        offer
    }
}

/// An open offer ([`crate::Agent::offer_grant`]). [`GrantOffer::revoke`] (or dropping it) ends
/// it and returns only once no transfer under a grant claimed from it still touches memory.
pub struct GrantOffer {
    name: String,
    id: u64,
    table: Arc<OfferTable>,
    claimed_by: Mutex<Option<String>>,
}

impl std::fmt::Debug for GrantOffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrantOffer").field("name", &self.name).finish_non_exhaustive()
    }
}

impl GrantOffer {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The peer that claimed it, if one did (still known after revocation).
    pub fn claimant(&self) -> Option<String> {
        let mut claimed = self.claimed_by.lock();
        if claimed.is_none() {
            *claimed = self.table.claimant(&self.name, self.id);
        }
        claimed.clone()
    }

    /// Ends the offer; blocks until transfers under its grants are done with the memory.
    /// Returns how many grants were claimed under it.
    pub fn revoke(self) -> usize {
        self.end()
    }

    fn end(&self) -> usize {
        let Some(offer) = self.table.end(&self.name, self.id) else { return 0 };
        if let Some(claimant) = &offer.claimant {
            self.claimed_by.lock().get_or_insert_with(|| claimant.clone());
        }
        let count = offer.grants.len();
        offer.grants.into_iter().for_each(Grant::revoke);
        count
    }
}

impl Drop for GrantOffer {
    fn drop(&mut self) {
        self.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn claims_and_replies_round_trip_and_reject_garbage() {
        let claim = Claim {
            name: "cmpl-42".into(),
            claimant: "decode-0".into(),
            mem_type: MemType::Dram,
            ranges: vec![Desc::new(0x1000, 4096, 0), Desc::new(0x9000, 64, 1)],
        };
        let bytes = claim.encode().unwrap();
        assert_eq!(Claim::decode(&bytes).unwrap(), claim);
        for cut in 0..bytes.len() {
            assert!(Claim::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut huge = bytes[..bytes.len() - 48].to_vec();
        let at = huge.len() - 4;
        huge[at..].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(Claim::decode(&huge).is_err());

        assert_eq!(decode_reply(&encode_reply(&Ok(vec![1, 2, 3]))).unwrap(), vec![1, 2, 3]);
        let refused = decode_reply(&encode_reply(&Err((RefusalCode::Revoked, "gone".into())))).unwrap_err();
        assert!(matches!(refused, XferError::Refused { code: RefusalCode::Revoked, ref message } if message == "gone"));
        assert!(decode_reply(&[0]).is_err());
    }

    #[test]
    fn unknown_names_are_refused_at_once_and_ended_ones_as_revoked() {
        let table = Arc::new(OfferTable::default());
        assert_eq!(table.claim("r1", "d", |_| unreachable!()).unwrap_err().0, RefusalCode::UnknownKey);

        let offer = table.open("r1", Duration::from_secs(60));
        assert_eq!(offer.revoke(), 0);
        assert_eq!(table.claim("r1", "d", |_| unreachable!()).unwrap_err().0, RefusalCode::Revoked);

        let expired = table.open("r2", Duration::ZERO);
        assert_eq!(table.claim("r2", "d", |_| unreachable!()).unwrap_err().0, RefusalCode::Revoked);
        drop(expired);

        // A replaced offer's handle no longer ends the name's current offer.
        let first = table.open("r3", Duration::from_secs(60));
        let second = table.open("r3", Duration::from_secs(60));
        assert_eq!(first.revoke(), 0);
        let token = table.claim("r3", "d", |_| Err(XferError::InvalidArgument("x".into())));
        assert_eq!(token.unwrap_err().0, RefusalCode::BadRequest, "the second offer was ended with the first");
        drop(second);
    }

    #[test]
    fn claimants_back_off_doubling_and_stop_at_the_claim_wait() {
        let started = Instant::now();
        let pauses: Vec<_> = (1..=6).map(|n| next_claim_attempt(started, started, n).unwrap()).collect();
        let ms = |n: u64| Duration::from_millis(n);
        assert_eq!(pauses, [ms(5), ms(10), ms(20), ms(40), ms(80), ms(100)]);
        assert_eq!(next_claim_attempt(started, started, u32::MAX), Some(CLAIM_RETRY_MAX));
        // The pause may not carry the next ask past the bound.
        assert_eq!(next_claim_attempt(started, started + CLAIM_WAIT - ms(50), 10), None);
        assert_eq!(next_claim_attempt(started, started + CLAIM_WAIT - ms(150), 10), Some(CLAIM_RETRY_MAX));
        assert_eq!(next_claim_attempt(started, started + CLAIM_WAIT, 1), None);
        // The sum of every pause allowed stays within the bound.
        let (mut now, mut attempts) = (started, 1);
        while let Some(pause) = next_claim_attempt(started, now, attempts) {
            now += pause;
            attempts += 1;
        }
        assert!(now - started < CLAIM_WAIT && now - started > CLAIM_WAIT - CLAIM_RETRY_MAX, "{:?}", now - started);
    }
}
