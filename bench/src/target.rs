//! The target process: registers one region for the whole run, serves it through the xfer
//! backend and its metadata through the side channel, serves the raw-tcp port, prints
//! `READY <side-channel addr|-> <raw-tcp addr>` and runs until its stdin closes.

use std::io::{self, Write};
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;

use anyhow::{Context, Result};
use xfer::{Agent, BackendParams};

use crate::cli::Args;
use crate::memory::BenchBuffer;
use crate::serve::{accept_loop, Shared};

pub fn serve(args: &Args) -> Result<()> {
    let mem = args.memory()?;
    let listen: SocketAddr = args.listen.parse().with_context(|| format!("--listen {}", args.listen))?;
    let mut xfer = None;
    let mut region = None;
    let mut side = None;
    if let Some(backend) = args.xfer_backend() {
        let agent = Agent::new(&format!("xferbench-target-{}", std::process::id()))?;
        let mut params = BackendParams::parse(&args.params).context("--params")?;
        // Two hosts: peers must reach the data port at the address they reach the side channel.
        if backend == "tcp" && !listen.ip().is_unspecified() && !args.params.contains("advertise=") {
            params.insert("advertise", listen.ip().to_string());
        }
        agent.add_backend(&backend, params).with_context(|| format!("attaching backend {backend}"))?;
        let (buffer, registration) = BenchBuffer::register(&agent, args.remote_mem, &args.mem_options(), mem as usize)?;
        side = Some(agent.start_side_channel(&listen.to_string())?);
        region = Some(buffer);
        xfer = Some((agent, registration));
    }
    let agent = xfer.as_ref().map(|(agent, _)| agent.clone());
    let raw_listen = raw_port_of(listen);
    let listener = TcpListener::bind(raw_listen).with_context(|| format!("binding the raw-tcp port {raw_listen}"))?;
    let raw = listener.local_addr()?;
    let shared = Arc::new(Shared { region, max_bytes: args.max_mem, agent, grants: Default::default() });
    std::thread::spawn(move || accept_loop(listener, shared));

    let side_text = side.map_or_else(|| "-".to_string(), |a| a.to_string());
    let mut stdout = io::stdout().lock();
    writeln!(stdout, "READY {side_text} {raw}")?;
    stdout.flush()?;
    drop(stdout);

    // Serve until the initiator closes our stdin (or kills us).
    io::copy(&mut io::stdin().lock(), &mut io::sink())?;
    drop(xfer);
    Ok(())
}

/// The raw-tcp port sits next to the side channel: PORT+1, or any free port when PORT is 0.
pub fn raw_port_of(side: SocketAddr) -> SocketAddr {
    let port = if side.port() == 0 { 0 } else { side.port().wrapping_add(1) };
    SocketAddr::new(side.ip(), port)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_port_follows_the_side_channel() {
        assert_eq!(raw_port_of("127.0.0.1:5600".parse().unwrap()), "127.0.0.1:5601".parse().unwrap());
        assert_eq!(raw_port_of("0.0.0.0:0".parse().unwrap()), "0.0.0.0:0".parse().unwrap());
    }
}
