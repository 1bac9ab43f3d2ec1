//! TLS 1.3 on the data connections (`tls=on`): each backend makes a self-signed certificate at
//! creation and publishes its SHA-256 fingerprint in its connection info; an initiator accepts
//! only the certificate with the fingerprint the target published (the handshake signature is
//! still verified, so the peer must hold the certificate's key).
//!
//! Mutual TLS (`tls_ca`, `tls_cert`, `tls_key`): the backend's certificate is the one given
//! (pinned by its fingerprint as above), it presents it as a client too, and as a target it
//! accepts only initiators whose certificate chains to the cluster CA.
//!
//! Connection info: `HOST:PORT` (plain) or `HOST:PORT#tls-sha256=HEX` (TLS).

use std::fmt;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::UnbufferedClientConnection;
use rustls::crypto::{verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::{UnbufferedServerConnection, WebPkiClientVerifier};
use rustls::{ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};

/// The name the initiator asks for; the verifier pins the certificate, not a name.
pub const SERVER_NAME: &str = "xfer-tcp";
/// Marks the fingerprint in connection info.
const CONN_INFO_TAG: &str = "#tls-sha256=";
/// Plaintext sealed per write before the records must go out: big batches keep the per-syscall
/// cost low for large payloads.
pub const SEND_BUFFER: usize = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("making the certificate: {0}")]
    Certificate(#[from] rcgen::Error),
    #[error("rustls: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("connection info {0:?}: the TLS fingerprint is not 64 hex digits")]
    BadFingerprint(String),
    #[error("{path}: {reason}")]
    Pem { path: String, reason: String },
    #[error("the cluster CA: {0}")]
    Ca(#[from] rustls::server::VerifierBuilderError),
}

/// Mutual TLS: the cluster CA's certificates, this backend's certificate chain and its key, as
/// PEM files.
#[derive(Clone, Debug)]
pub struct MutualTls {
    pub ca: std::path::PathBuf,
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
}

impl MutualTls {
    /// Takes `tls_ca`, `tls_cert` and `tls_key` from a backend's parameters: `None` when none
    /// is given, an error when only some are.
    pub fn take(params: &mut xfer_core::BackendParams) -> Result<Option<MutualTls>, xfer_core::BackendError> {
        match [params.take("tls_ca"), params.take("tls_cert"), params.take("tls_key")] {
            [None, None, None] => Ok(None),
            [Some(ca), Some(cert), Some(key)] => {
                Ok(Some(MutualTls { ca: ca.into(), cert: cert.into(), key: key.into() }))
            }
            _ => Err(xfer_core::BackendError::InvalidParam {
                name: "tls_ca".into(),
                reason: "mutual TLS needs tls_ca, tls_cert and tls_key together".into(),
            }),
        }
    }

    /// This backend's identity from the files (errors name the parameter).
    pub fn identity(&self) -> Result<TlsIdentity, xfer_core::BackendError> {
        TlsIdentity::mutual(self)
            .map_err(|e| xfer_core::BackendError::InvalidParam { name: "tls_cert".into(), reason: e.to_string() })
    }
}

fn pem_error(path: &std::path::Path, reason: impl fmt::Display) -> TlsError {
    TlsError::Pem { path: path.display().to_string(), reason: reason.to_string() }
}

fn read_certs(path: &std::path::Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| pem_error(path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(path, e))?;
    if certs.is_empty() {
        return Err(pem_error(path, "no certificate in the file"));
    }
    Ok(certs)
}

/// SHA-256 of a certificate's DER bytes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Fingerprint(pub [u8; 32]);

impl Fingerprint {
    pub fn of(cert: &[u8]) -> Fingerprint {
        let digest = ring::digest::digest(&ring::digest::SHA256, cert);
        let mut bytes = [0u8; 32];
        bytes.copy_from_slice(digest.as_ref());
        Fingerprint(bytes)
    }

    fn parse(hex: &str) -> Option<Fingerprint> {
        if hex.len() != 64 || !hex.is_ascii() {
            return None;
        }
        let mut bytes = [0u8; 32];
        for (i, byte) in bytes.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(Fingerprint(bytes))
    }
}

impl fmt::Display for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({self})")
    }
}

/// The connection info a target publishes.
pub fn encode_conn_info(addr: &str, fingerprint: Option<Fingerprint>) -> String {
    match fingerprint {
        Some(fp) => format!("{addr}{CONN_INFO_TAG}{fp}"),
        None => addr.to_string(),
    }
}

/// Splits connection info into the address and the fingerprint, if the target speaks TLS.
pub fn decode_conn_info(text: &str) -> Result<(&str, Option<Fingerprint>), TlsError> {
    match text.split_once(CONN_INFO_TAG) {
        None => Ok((text, None)),
        Some((addr, hex)) => {
            let fp = Fingerprint::parse(hex).ok_or_else(|| TlsError::BadFingerprint(text.to_string()))?;
            Ok((addr, Some(fp)))
        }
    }
}

/// ring's suites with AES-128-GCM first: a server follows the client's order, and AES-128 costs
/// about half of AES-256 per byte (plugins/quic/README.md), which both `tls=on` and the QUIC
/// backend pay twice per byte moved.
fn provider() -> Arc<CryptoProvider> {
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites.sort_by_key(|suite| suite.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
    Arc::new(provider)
}

/// This backend's certificate and the server side of its TLS.
pub struct TlsIdentity {
    pub fingerprint: Fingerprint,
    server: Arc<ServerConfig>,
    provider: Arc<CryptoProvider>,
    /// Mutual TLS: the chain and key this backend presents as a client.
    client_auth: Option<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>)>,
}

impl fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsIdentity").field("fingerprint", &self.fingerprint).finish_non_exhaustive()
    }
}

impl TlsIdentity {
    /// A fresh self-signed certificate (a new key pair each time the backend is created).
    pub fn generate() -> Result<TlsIdentity, TlsError> {
        let certified = rcgen::generate_simple_self_signed(vec![SERVER_NAME.to_string()])?;
        let cert = certified.cert.der().clone();
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(certified.signing_key.serialize_der()));
        let fingerprint = Fingerprint::of(&cert);
        let provider = provider();
        let server = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_no_client_auth()
            .with_single_cert(vec![cert], key)?;
        Ok(TlsIdentity { fingerprint, server: finish_server(server), provider, client_auth: None })
    }

    /// Mutual TLS from the operator's files: the certificate chain (its first certificate
    /// pinned by initiators) and key this backend presents both ways, and the CA an
    /// initiator's certificate must chain to. Certificates need the clientAuth and serverAuth
    /// extended key usages.
    pub fn mutual(files: &MutualTls) -> Result<TlsIdentity, TlsError> {
        let chain = read_certs(&files.cert)?;
        let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|e| pem_error(&files.key, e))?;
        let mut roots = RootCertStore::empty();
        for ca in read_certs(&files.ca)? {
            roots.add(ca).map_err(|e| pem_error(&files.ca, e))?;
        }
        let provider = provider();
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider)).build()?;
        let server = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())?;
        let fingerprint = Fingerprint::of(&chain[0]);
        Ok(TlsIdentity { fingerprint, server: finish_server(server), provider, client_auth: Some((chain, key)) })
    }

    /// The server side's rustls config (the QUIC backend hands it to quinn).
    pub fn server_config(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.server)
    }

    pub fn accept(&self) -> Result<UnbufferedServerConnection, TlsError> {
        Ok(UnbufferedServerConnection::new(Arc::clone(&self.server))?)
    }

    /// The initiator's config for a target that published `pinned`.
    pub fn client_config(&self, pinned: Fingerprint) -> Result<Arc<ClientConfig>, TlsError> {
        let verifier = PinnedCert { pinned, provider: Arc::clone(&self.provider) };
        let builder = ClientConfig::builder_with_provider(Arc::clone(&self.provider))
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier));
        let mut config = match &self.client_auth {
            Some((chain, key)) => builder.with_client_auth_cert(chain.clone(), key.clone_key())?,
            None => builder.with_no_client_auth(),
        };
        config.resumption = rustls::client::Resumption::disabled();
        config.enable_secret_extraction = true;
        Ok(Arc::new(config))
    }
}

fn finish_server(mut server: ServerConfig) -> Arc<ServerConfig> {
    // Data connections live long and never resume: no tickets to send or store.
    server.send_tls13_tickets = 0;
    // After the handshake this backend seals and opens the records itself (`records`).
    server.enable_secret_extraction = true;
    Arc::new(server)
}

pub fn connect(config: &Arc<ClientConfig>) -> Result<UnbufferedClientConnection, TlsError> {
    let name = ServerName::try_from(SERVER_NAME).map_err(|_| rustls::Error::General("server name".into()))?;
    Ok(UnbufferedClientConnection::new(Arc::clone(config), name)?)
}

/// Accepts exactly the certificate whose SHA-256 the target published; the handshake signature
/// is verified with the provider's algorithms as usual.
#[derive(Debug)]
struct PinnedCert {
    pinned: Fingerprint,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for PinnedCert {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if Fingerprint::of(end_entity) == self.pinned {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(rustls::CertificateError::ApplicationVerificationFailure))
        }
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        // The configs allow TLS 1.3 only.
        Err(rustls::Error::General("TLS 1.2 signature on a TLS 1.3-only connection".into()))
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conn_info_round_trips_and_rejects_bad_fingerprints() {
        let fp = Fingerprint([0xab; 32]);
        let text = encode_conn_info("127.0.0.1:9", Some(fp));
        assert_eq!(decode_conn_info(&text).unwrap(), ("127.0.0.1:9", Some(fp)));
        assert_eq!(decode_conn_info("127.0.0.1:9").unwrap(), ("127.0.0.1:9", None));
        assert!(decode_conn_info("127.0.0.1:9#tls-sha256=abcd").is_err());
        let bad = format!("127.0.0.1:9#tls-sha256={}", "zz".repeat(32));
        assert!(decode_conn_info(&bad).is_err());
    }
}
