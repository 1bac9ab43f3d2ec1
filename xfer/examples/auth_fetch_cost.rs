//! What authentication costs at connection setup: the median time of a side-channel metadata
//! fetch (connect, challenge-response when authenticated, GET, verify and load) over loopback,
//! without and with a cluster credential. `cargo run --release -p xfer --example auth_fetch_cost`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use xfer::credential::ClusterCredential;
use xfer::{Agent, BackendParams, BackendRegistry, HostBuffer};

const ROUNDS: usize = 200;

fn median_fetch(credential: Option<ClusterCredential>) -> Result<Duration, Box<dyn std::error::Error>> {
    let make = |name: &str| {
        Agent::with_credential(name, BackendRegistry::default(), xfer::cuda::staging(), credential.clone())
    };
    let server = make("cost-server")?;
    server.add_backend("tcp", BackendParams::parse("listen=127.0.0.1:0")?)?;
    let buf = Arc::new(HostBuffer::new(1 << 20));
    let _reg = server.register_buffer(&buf)?;
    let addr = server.start_side_channel("127.0.0.1:0")?.to_string();
    let client = make("cost-client")?;
    client.add_backend("tcp", BackendParams::parse("listen=127.0.0.1:0")?)?;
    let mut times = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let started = Instant::now();
        client.fetch_remote_metadata(&addr)?;
        times.push(started.elapsed());
    }
    times.sort();
    Ok(times[ROUNDS / 2])
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let plain = median_fetch(None)?;
    let authed = median_fetch(Some(ClusterCredential::from_bytes(vec![0x42; 32])?))?;
    println!("side-channel fetch, median of {ROUNDS}: without credential {plain:?}, with credential {authed:?}");
    Ok(())
}
