//! The sidecar: a decode-first P/D proxy next to one engine.
