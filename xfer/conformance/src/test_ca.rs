//! A certificate authority made for a test, and the certificates it issues (PEM): the
//! mutual-TLS scenario's cluster CA and the real-engine suites' (`pd-e2e`).

/// A self-signed CA.
pub struct TestCa {
    cert: rcgen::Certificate,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestCa").finish_non_exhaustive()
    }
}

impl TestCa {
    /// A new CA named `name`. Panics only if rcgen cannot make a key (a broken crypto provider).
    pub fn new(name: &str) -> TestCa {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::DigitalSignature];
        let key = rcgen::KeyPair::generate().expect("a CA key");
        let cert = params.self_signed(&key).expect("the CA certificate");
        TestCa { cert, issuer: rcgen::Issuer::new(params, key) }
    }

    /// The CA's certificate.
    pub fn cert_pem(&self) -> String {
        self.cert.pem()
    }

    /// A certificate for `name` and its key. It has both extended key usages: an xfer agent is
    /// a target and an initiator.
    pub fn issue(&self, name: &str) -> (String, String) {
        let mut params = rcgen::CertificateParams::new(vec![name.to_string()]).expect("parameters");
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        params.extended_key_usages =
            vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth, rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let key = rcgen::KeyPair::generate().expect("a key");
        let cert = params.signed_by(&key, &self.issuer).expect("a certificate");
        (cert.pem(), key.serialize_pem())
    }
}
