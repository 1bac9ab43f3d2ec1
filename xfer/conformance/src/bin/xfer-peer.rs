//! `xfer-peer`: the target process of the conformance suite.
//!
//! Registers one buffer, serves its metadata on a side channel, prints
//! `READY <side-channel> <buffer-addr> <buffer-len>`, then answers one line per stdin command:
//! `fill SEED OFF LEN`, `hash OFF LEN`, `notifs`, `dereg`, `free`, `quit` (see the crate docs),
//! `grant PEER OFF LEN TTL_MS` (answers `OK ID TOKEN-HEX`) and `revoke ID` (answers once the
//! grant can no longer touch the memory), `offer NAME TTL_MS` (offers a grant to be claimed
//! over the side channel; `revoke-offer NAME` ends it, answering how many grants were claimed).
//! Errors are answered `ERR <message>`; bad input never ends the process, only `quit` or EOF
//! does. With `--alloc backend` the buffer is allocated by the backend (`Agent::allocate`).

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Parser;
use pd_config_file::report::error_line;
use xfer::credential::ClusterCredential;
use xfer::{Agent, BackendParams, BackendRegistry, Desc, Grant, GrantOffer, HostBuffer, MemType, Registration};
use xfer_conformance::pattern::{self, Buffer, Check};

#[derive(Debug, Parser)]
#[command(about = "Target process of the xfer conformance suite, driven by line commands on stdin")]
struct Args {
    /// Agent name.
    #[arg(long)]
    name: String,
    /// Backend to attach.
    #[arg(long, default_value = "tcp")]
    backend: String,
    /// Backend parameters, `k=v,k=v`.
    #[arg(long, default_value = "")]
    params: String,
    /// Bytes of the registered buffer.
    #[arg(long)]
    size: u64,
    /// Address of the metadata side channel.
    #[arg(long, default_value = "127.0.0.1:0")]
    side_channel: String,
    /// Where the buffer comes from: `host` (a HostBuffer) or `backend` (allocated by the
    /// backend through `Agent::allocate`).
    #[arg(long, default_value = "host", value_parser = ["host", "backend"])]
    alloc: String,
    /// Cluster secret file: the peer authenticates its side channel and data connections.
    #[arg(long)]
    credential: Option<std::path::PathBuf>,
}

/// The buffer, whichever kind.
type Memory = Arc<dyn Buffer + Send + Sync>;

/// Notifications as the verifier recorded them, in arrival order.
type Log = Arc<Mutex<Vec<String>>>;

struct Target {
    /// `None` after `free`.
    buffer: Option<Memory>,
    /// The buffer's address (printed in READY).
    addr: u64,
    registration: Option<Registration>,
    log: Log,
    agent: Agent,
    grants: HashMap<u64, Grant>,
    next_grant: u64,
    offers: HashMap<String, GrantOffer>,
}

fn main() {
    let args = Args::parse();
    let mut out = std::io::stdout().lock();
    let (agent, mut target, side_channel) = match start(&args) {
        Ok(started) => started,
        Err(err) => {
            // The harness waits for READY; an answer on stdout says why it will never come.
            let _ = writeln!(out, "ERR startup: {}", error_line(err.as_ref()));
            let _ = out.flush();
            std::process::exit(1);
        }
    };
    let (addr, len) = (target.addr, target.buffer.as_ref().map_or(0, |b| b.len()));
    let buffer = target.buffer.as_ref().map(Arc::downgrade).expect("allocated at start");
    spawn_verifier(agent, buffer, Arc::clone(&target.log));
    let _ = writeln!(out, "READY {side_channel} {addr} {len}");
    let _ = out.flush();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let reply = match line.trim() {
            "quit" => break,
            command => match target.run(command) {
                Ok(text) if text.is_empty() => "OK".to_string(),
                Ok(text) => format!("OK {text}"),
                Err(err) => format!("ERR {}", error_line(err.as_ref()).replace('\n', " ")),
            },
        };
        if writeln!(out, "{reply}").and_then(|()| out.flush()).is_err() {
            break;
        }
    }
    // Exit without dropping the agent or the registration: nothing here needs an orderly
    // teardown, and a deregistration waiting on a stalled transfer must not delay the exit.
    std::process::exit(0);
}

fn start(args: &Args) -> anyhow::Result<(Agent, Target, String)> {
    let size = usize::try_from(args.size).context("--size does not fit in memory")?;
    if size == 0 {
        bail!("--size must be positive");
    }
    let credential = args.credential.as_deref().map(ClusterCredential::from_file).transpose()?;
    let agent = Agent::with_credential(&args.name, BackendRegistry::default(), xfer::cuda::staging(), credential)?;
    let params = BackendParams::parse(&args.params)?;
    agent.add_backend(&args.backend, params)?;
    let (buffer, addr, registration): (Memory, u64, Registration) = if args.alloc == "backend" {
        let allocation = agent.allocate(size)?;
        let addr = allocation.buffer.addr();
        (allocation.buffer, addr, allocation.registration)
    } else {
        let buffer = Arc::new(HostBuffer::new(size));
        let registration = agent.register_buffer(&buffer)?;
        let addr = buffer.addr();
        (buffer, addr, registration)
    };
    let side_channel = agent.start_side_channel(&args.side_channel)?;
    let target = Target {
        buffer: Some(buffer),
        addr,
        registration: Some(registration),
        log: Log::default(),
        agent: agent.clone(),
        grants: HashMap::new(),
        next_grant: 1,
        offers: HashMap::new(),
    };
    Ok((agent, target, side_channel.to_string()))
}

impl Target {
    fn run(&mut self, command: &str) -> anyhow::Result<String> {
        let words: Vec<&str> = command.split_whitespace().collect();
        match words.as_slice() {
            ["fill", seed, off, len] => {
                let (seed, off, len) = (number(seed)?, number(off)?, number(len)?);
                let buffer = self.check_range(off, len)?;
                pattern::write_pattern(buffer, off, seed, 0, len);
                Ok(String::new())
            }
            ["hash", off, len] => {
                let (off, len) = (number(off)?, number(len)?);
                let buffer = self.check_range(off, len)?;
                Ok(format!("{:016x}", pattern::hash_range(buffer, off, len)))
            }
            ["grant", peer, off, len, ttl_ms] => {
                let (off, len, ttl_ms) = (number(off)?, number(len)?, number(ttl_ms)?);
                self.check_range(off, len)?;
                let range = Desc::new(self.addr + off, len, 0);
                let grant = self.agent.grant(peer, MemType::Dram, &[range], Duration::from_millis(ttl_ms))?;
                let id = self.next_grant;
                self.next_grant += 1;
                let token = grant.token_hex();
                self.grants.insert(id, grant);
                Ok(format!("{id} {token}"))
            }
            ["revoke", id] => match self.grants.remove(&number(id)?) {
                Some(grant) => {
                    grant.revoke();
                    Ok(String::new())
                }
                None => bail!("no grant {id}"),
            },
            ["offer", name, ttl_ms] => {
                let offer = self.agent.offer_grant(name, Duration::from_millis(number(ttl_ms)?));
                self.offers.insert(name.to_string(), offer);
                Ok(String::new())
            }
            ["revoke-offer", name] => match self.offers.remove(*name) {
                Some(offer) => Ok(offer.revoke().to_string()),
                None => bail!("no offer {name}"),
            },
            ["notifs"] => Ok(std::mem::take(&mut *lock(&self.log)).join(",")),
            ["dereg"] => match self.registration.take() {
                Some(registration) => {
                    drop(registration);
                    Ok(String::new())
                }
                None => bail!("not registered"),
            },
            // Deregisters and drops the buffer: memory a backend allocated is released (once
            // the verifier is done with a hash in progress).
            ["free"] => {
                drop(self.registration.take());
                match self.buffer.take() {
                    Some(buffer) => {
                        drop(buffer);
                        Ok(String::new())
                    }
                    None => bail!("already freed"),
                }
            }
            [] => bail!("empty command"),
            [other, ..] => bail!("unknown command {other:?} (or wrong arguments)"),
        }
    }

    /// The buffer, when `off .. off + len` lies in it.
    fn check_range(&self, off: u64, len: u64) -> anyhow::Result<&Memory> {
        let Some(buffer) = self.buffer.as_ref() else { bail!("the buffer was freed") };
        if !pattern::in_range(buffer, off, len) {
            bail!("range {off}+{len} is outside the {}-byte buffer", buffer.len());
        }
        Ok(buffer)
    }
}

fn number(text: &str) -> anyhow::Result<u64> {
    text.parse().with_context(|| format!("{text:?} is not a number"))
}

fn lock(log: &Log) -> std::sync::MutexGuard<'_, Vec<String>> {
    // A panic while holding the lock cannot leave the list half-updated; keep serving.
    log.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Waits for notifications and records each as it arrives. A `check:` notification is verified
/// right away: its range must already hold the bytes whose hash it carries, proving the data
/// arrived before the notification.
fn spawn_verifier(agent: Agent, buffer: Weak<dyn Buffer + Send + Sync>, log: Log) {
    std::thread::spawn(move || loop {
        if !agent.wait_notifs(Duration::from_millis(100)) {
            continue;
        }
        let mut by_peer: Vec<(String, Vec<Vec<u8>>)> = agent.get_notifs().into_iter().collect();
        by_peer.sort_by(|a, b| a.0.cmp(&b.0));
        let mut recorded = Vec::new();
        for message in by_peer.into_iter().flat_map(|(_, messages)| messages) {
            recorded.push(match Check::parse(&message) {
                Some(check) => {
                    let buffer = buffer.upgrade();
                    let ok = buffer.is_some_and(|buffer| {
                        pattern::in_range(&buffer, check.off, check.len)
                            && pattern::hash_range(&buffer, check.off, check.len) == check.hash
                    });
                    format!("{}={}", pattern::escape(check.seq.as_bytes()), if ok { "ok" } else { "bad" })
                }
                None => pattern::escape(&message),
            });
        }
        lock(&log).extend(recorded);
    });
}
