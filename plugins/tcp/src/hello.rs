//! The target's half of the hello, without I/O: the TCP backend's server and the QUIC backend's
//! target read the same bytes and answer the same way, each over its own transport.
//!
//! 1. Read [`frame::HELLO_LEN`] bytes and [`frame::decode_hello`] them; read
//!    [`names_len`] bytes of names.
//! 2. [`judge`] them: refuse, admit, or send a challenge and read [`AUTH_LEN`] bytes of proof
//!    for [`Challenge::check`].
//! 3. An admitted initiator gets [`accepted_reply`] (after any check of the transport's own).

use std::collections::HashSet;
use std::net::IpAddr;
use std::sync::Arc;

use parking_lot::Mutex;
use xfer_core::credential::{self, ClusterCredential, ProofLabel, Transcript, AUTH_LEN};

use xfer_core::RefusalCode;

use crate::frame::{self, Hello, Session};

/// Addresses whose refusals were logged; beyond this many, refusals are no longer logged.
const REFUSALS_LOGGED: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum HelloError {
    #[error("name is not UTF-8")]
    Name,
    #[error("authentication: {0}")]
    Auth(#[from] credential::CredentialError),
}

/// What the target does next with a hello.
#[derive(Debug)]
pub enum Verdict {
    Admit(Admitted),
    Refuse(Refused),
    /// Send the challenge, read [`AUTH_LEN`] bytes of proof and [`Challenge::check`] them.
    Challenge(Challenge),
}

/// The initiator named itself `from` and addressed this agent.
#[derive(Debug)]
pub struct Admitted {
    pub from: String,
    pub session: Session,
}

/// Send `reply` and stop serving the connection.
#[derive(Debug)]
pub struct Refused {
    pub reply: Vec<u8>,
    pub refusal: Refusal,
}

/// Why an initiator was refused at hello; the text goes back on the wire.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("this is agent {here:?}, not {asked:?}")]
    WrongAgent { here: String, asked: String },
    #[error("this agent has no cluster credential")]
    NoCredentialHere,
    #[error("this agent requires the cluster credential")]
    CredentialRequired,
    #[error("{0:?} did not prove the cluster credential")]
    BadProof(String),
}

impl Refusal {
    fn code(&self) -> RefusalCode {
        match self {
            Refusal::WrongAgent { .. } => RefusalCode::WrongAgent,
            _ => RefusalCode::Unauthenticated,
        }
    }

    fn refused(self) -> Refused {
        Refused { reply: refusal_reply(self.code(), &self.to_string()), refusal: self }
    }

    /// Logs a refusal for want of the credential once per address, so a stranger cannot fill
    /// the log.
    pub fn log_once(&self, logged: &Mutex<HashSet<IpAddr>>, peer: IpAddr, transport: &str) {
        if matches!(self, Refusal::WrongAgent { .. }) {
            return;
        }
        let first = {
            let mut logged = logged.lock();
            logged.len() < REFUSALS_LOGGED && logged.insert(peer)
        };
        if first {
            tracing::warn!(%peer, transport, reason = %self, "refused an unauthenticated data connection (logged once per address)");
        }
    }
}

/// How many bytes of names follow the fixed part of `hello`.
pub fn names_len(hello: &Hello) -> usize {
    hello.from_len + hello.to_len
}

/// Judges a hello and its names for the agent `here`, which holds `credential` if it has one.
pub fn judge(
    hello: &Hello,
    names: &[u8],
    here: &str,
    credential: Option<&Arc<ClusterCredential>>,
) -> Result<Verdict, HelloError> {
    let (from, to) = names.split_at(hello.from_len.min(names.len()));
    let to = std::str::from_utf8(to).map_err(|_| HelloError::Name)?;
    let from = std::str::from_utf8(from).map_err(|_| HelloError::Name)?.to_owned();
    if to != here {
        return Ok(Verdict::Refuse(Refusal::WrongAgent { here: here.to_owned(), asked: to.to_owned() }.refused()));
    }
    let refusal = match (credential, hello.auth) {
        (None, false) => return Ok(Verdict::Admit(Admitted { from, session: hello.session })),
        (None, true) => Refusal::NoCredentialHere,
        (Some(_), false) => Refusal::CredentialRequired,
        (Some(credential), true) => {
            let nonce = credential::fresh_nonce()?;
            let mut bytes = Vec::new();
            frame::encode_challenge(&nonce, &mut bytes);
            let credential = Arc::clone(credential);
            return Ok(Verdict::Challenge(Challenge {
                bytes,
                nonce,
                credential,
                from,
                to: to.to_owned(),
                session: hello.session,
            }));
        }
    };
    Ok(Verdict::Refuse(refusal.refused()))
}

/// A challenge to send, and what the initiator's proof must answer.
#[derive(Debug)]
pub struct Challenge {
    pub bytes: Vec<u8>,
    nonce: credential::Nonce,
    credential: Arc<ClusterCredential>,
    from: String,
    to: String,
    session: Session,
}

impl Challenge {
    /// Admits the initiator if `proof` answers the challenge.
    pub fn check(self, proof: &[u8; AUTH_LEN]) -> Result<Admitted, Refused> {
        let transcript = Transcript {
            client_nonce: &frame::session_nonce(self.session),
            server_nonce: &self.nonce,
            client_name: &self.from,
            server_name: &self.to,
        };
        if self.credential.verify(ProofLabel::DataInitiator, &transcript, proof) {
            Ok(Admitted { from: self.from, session: self.session })
        } else {
            Err(Refusal::BadProof(self.from).refused())
        }
    }
}

/// The answer that admits an initiator.
pub fn accepted_reply() -> Vec<u8> {
    refusal_reply_raw(0, "")
}

/// A refusal the initiator reads as `code` with `msg`.
pub fn refusal_reply(code: RefusalCode, msg: &str) -> Vec<u8> {
    refusal_reply_raw(code.to_wire(), msg)
}

fn refusal_reply_raw(code: u16, msg: &str) -> Vec<u8> {
    let mut out = Vec::new();
    frame::encode_hello_reply(code, msg, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello_for(from: &str, to: &str, auth: bool) -> (Hello, Vec<u8>) {
        let session = Session { id: 9, epoch: 3 };
        let mut bytes = Vec::new();
        frame::encode_hello_with(from, to, session, auth, &mut bytes);
        let hello = frame::decode_hello(&bytes[..frame::HELLO_LEN]).unwrap();
        let names = bytes[frame::HELLO_LEN..].to_vec();
        assert_eq!(names.len(), names_len(&hello));
        (hello, names)
    }

    fn refused_with(verdict: Verdict) -> u16 {
        match verdict {
            Verdict::Refuse(refused) => code_of(refused),
            other => panic!("not refused: {other:?}"),
        }
    }

    fn code_of(refused: Refused) -> u16 {
        frame::decode_hello_reply(&refused.reply).unwrap().0
    }

    #[test]
    fn hellos_are_admitted_refused_or_challenged_by_the_credentials_on_both_sides() {
        let credential =
            Arc::new(ClusterCredential::from_bytes(b"a cluster secret of enough bytes!".to_vec()).unwrap());
        let (hello, names) = hello_for("decode-1", "prefill-0", false);
        assert!(
            matches!(judge(&hello, &names, "prefill-0", None).unwrap(), Verdict::Admit(Admitted { from, .. }) if from == "decode-1")
        );
        assert_eq!(refused_with(judge(&hello, &names, "prefill-9", None).unwrap()), RefusalCode::WrongAgent.to_wire());
        let unauthenticated = RefusalCode::Unauthenticated.to_wire();
        assert_eq!(refused_with(judge(&hello, &names, "prefill-0", Some(&credential)).unwrap()), unauthenticated);
        let (hello, names) = hello_for("decode-1", "prefill-0", true);
        assert_eq!(refused_with(judge(&hello, &names, "prefill-0", None).unwrap()), unauthenticated);
        let Verdict::Challenge(challenge) = judge(&hello, &names, "prefill-0", Some(&credential)).unwrap() else {
            panic!("no challenge")
        };
        assert!(!challenge.bytes.is_empty());
        assert_eq!(code_of(challenge.check(&[0; AUTH_LEN]).unwrap_err()), unauthenticated);
        let (bad_hello, mut bad_names) = hello_for("decode-1", "prefill-0", false);
        bad_names[0] = 0xff;
        assert!(matches!(judge(&bad_hello, &bad_names, "prefill-0", None), Err(HelloError::Name)));
    }
}
