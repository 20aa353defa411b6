//! TLS identity for the QUIC transport: a self-signed certificate per rank, its SHA-256
//! fingerprint published through the authenticated rendezvous store, and verifiers that accept
//! exactly the published fingerprints — no certificate authority, and no "skip verification"
//! mode under any name.

use std::collections::HashMap;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};
use sha2::{Digest, Sha256};

/// ALPN protocol id of tutti's QUIC transport.
pub(crate) const ALPN: &[u8] = b"tutti/1";

/// SHA-256 of a DER certificate.
pub(crate) fn fingerprint(cert: &[u8]) -> [u8; 32] {
    Sha256::digest(cert).into()
}

pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

pub(crate) fn unhex(s: &str) -> Option<[u8; 32]> {
    if s.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// This rank's certificate and key.
pub(crate) struct Identity {
    pub(crate) cert: CertificateDer<'static>,
    pub(crate) key: PrivatePkcs8KeyDer<'static>,
    pub(crate) fp: [u8; 32],
}

impl Identity {
    pub(crate) fn generate() -> Result<Identity, String> {
        let ck = rcgen::generate_simple_self_signed(vec!["tutti".to_string()])
            .map_err(|e| format!("generating the QUIC certificate: {e}"))?;
        let cert = ck.cert.der().clone();
        let fp = fingerprint(&cert);
        Ok(Identity { cert, key: PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()), fp })
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn algs() -> WebPkiSupportedAlgorithms {
    rustls::crypto::ring::default_provider().signature_verification_algorithms
}

/// The handshake signature checks, the same for both verifiers: rustls' own, with the
/// provider's algorithms (`self.algs`). Only the certificate check is tutti's.
macro_rules! signature_checks {
    () => {
        fn verify_tls12_signature(
            &self,
            m: &[u8],
            c: &CertificateDer<'_>,
            d: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls12_signature(m, c, d, &self.algs)
        }

        fn verify_tls13_signature(
            &self,
            m: &[u8],
            c: &CertificateDer<'_>,
            d: &DigitallySignedStruct,
        ) -> Result<HandshakeSignatureValid, rustls::Error> {
            rustls::crypto::verify_tls13_signature(m, c, d, &self.algs)
        }

        fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
            self.algs.supported_schemes()
        }
    };
}

/// Accepts a server certificate only if its fingerprint is the one the expected rank published.
#[derive(Debug)]
struct PinnedServer {
    expected: [u8; 32],
    algs: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for PinnedServer {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if fingerprint(end_entity) == self.expected {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::General(
                "server certificate fingerprint is not the one published by that rank".into(),
            ))
        }
    }

    signature_checks!();
}

/// Accepts a client certificate only if its fingerprint belongs to a rank of this job.
#[derive(Debug)]
struct PinnedClients {
    allowed: HashMap<[u8; 32], usize>,
    algs: WebPkiSupportedAlgorithms,
}

impl ClientCertVerifier for PinnedClients {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _i: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        if self.allowed.contains_key(&fingerprint(end_entity)) {
            Ok(ClientCertVerified::assertion())
        } else {
            Err(rustls::Error::General(
                "client certificate fingerprint was not published by any rank of this job".into(),
            ))
        }
    }

    signature_checks!();
}

/// Server side: our certificate; clients must present a published fingerprint.
pub(crate) fn server_config(
    id: &Identity,
    allowed: HashMap<[u8; 32], usize>,
) -> Result<rustls::ServerConfig, rustls::Error> {
    let mut c = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(Arc::new(PinnedClients { allowed, algs: algs() }))
        .with_single_cert(vec![id.cert.clone()], PrivateKeyDer::Pkcs8(id.key.clone_key()))?;
    c.alpn_protocols = vec![ALPN.to_vec()];
    Ok(c)
}

/// Client side, for a connection to the rank that published `expected`.
pub(crate) fn client_config(
    id: &Identity,
    expected: [u8; 32],
) -> Result<rustls::ClientConfig, rustls::Error> {
    let mut c = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(PinnedServer { expected, algs: algs() }))
        .with_client_auth_cert(vec![id.cert.clone()], PrivateKeyDer::Pkcs8(id.key.clone_key()))?;
    c.alpn_protocols = vec![ALPN.to_vec()];
    Ok(c)
}
