//! pdbench: an OpenAI-API load generator for prefill/decode deployments (workload generation,
//! timing of streamed responses, statistics, plots), and the launcher of a local simulated P/D
//! cluster.

pub mod client;
pub mod cluster;
pub mod daemons;
pub mod metrics;
pub mod plot;
pub mod ports;
pub mod procs;
pub mod runner;
pub mod sse;
pub mod stats;
pub mod trace;
pub mod workload;
