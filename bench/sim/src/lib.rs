//! `pd-sim`: an OpenAI-compatible stand-in for a vLLM or SGLang engine whose KV blocks are real
//! bytes in real memory, moved between simulators through `xfer`, so the P/D suite can be
//! developed, tested and benchmarked without GPUs. See `bench/sim/README.md`.

#![forbid(unsafe_code)]
pub mod chat;
pub mod config;
pub mod content;
pub mod engine;
pub mod events;
pub mod faults;
pub mod harness;
pub mod http;
pub mod interference;
pub mod lease;
pub mod mem;
pub mod metrics;
pub mod openai;
pub mod pool;
pub mod pull;
pub mod render;
pub mod respond;
pub mod rooms;
pub mod serve;
pub mod sglang;
pub mod tokenizer;
