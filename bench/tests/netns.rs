//! Two "hosts": the target in one network namespace, the initiator in another, joined by a veth
//! pair — the two-host setup of xferbench (`--target --listen` there, `--connect` here), with the
//! bytes checked. Needs root (CAP_NET_ADMIN) and iproute2; without them the test says loudly that
//! it did not run.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::Context;

/// Two namespaces and their veth pair; removed on drop (removing a namespace removes its veth).
struct Hosts {
    names: [String; 2],
}

impl Hosts {
    fn create() -> anyhow::Result<Hosts> {
        let id = std::process::id();
        let hosts = Hosts { names: [format!("xb{id}a"), format!("xb{id}b")] };
        let [a, b] = &hosts.names;
        let (va, vb) = (format!("xv{id}a"), format!("xv{id}b"));
        for line in [
            format!("netns add {a}"),
            format!("netns add {b}"),
            format!("link add {va} netns {a} type veth peer name {vb} netns {b}"),
            format!("-n {a} addr add 10.231.0.1/24 dev {va}"),
            format!("-n {b} addr add 10.231.0.2/24 dev {vb}"),
            format!("-n {a} link set {va} up"),
            format!("-n {b} link set {vb} up"),
            format!("-n {a} link set lo up"),
            format!("-n {b} link set lo up"),
        ] {
            ip(&line)?;
        }
        Ok(hosts)
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = ip(&format!("netns del {name}"));
        }
    }
}

fn ip(line: &str) -> anyhow::Result<()> {
    let out = Command::new("ip").args(line.split_whitespace()).output().context("running ip")?;
    anyhow::ensure!(out.status.success(), "ip {line}: {}", String::from_utf8_lossy(&out.stderr).trim());
    Ok(())
}

/// Kills the target if the test fails before it closes its stdin.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn initiator_and_target_in_separate_network_namespaces() {
    let hosts = match Hosts::create() {
        Ok(hosts) => hosts,
        Err(why) => {
            eprintln!("\n*** SKIPPED initiator_and_target_in_separate_network_namespaces: cannot create network namespaces ({why}); run as root with iproute2 ***\n");
            return;
        }
    };
    let exe = env!("CARGO_BIN_EXE_xferbench");
    let mut target = Reaped(
        Command::new("ip")
            .args(["netns", "exec", &hosts.names[1], exe, "--target", "--backend", "tcp"])
            .args(["--listen", "10.231.0.2:7300", "--mem", "4194304", "--max-mem", "4194304"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawning the target"),
    );
    let stdout = target.0.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let ready = rx.recv_timeout(Duration::from_secs(20)).expect("target READY within 20 s");
    assert_eq!(ready.trim(), "READY 10.231.0.2:7300 10.231.0.2:7301");

    let json = std::env::temp_dir().join(format!("xferbench-netns-{}.json", std::process::id()));
    let out = Command::new("ip")
        .args(["netns", "exec", &hosts.names[0], exe, "--connect", "10.231.0.2:7300", "--compare", "--check"])
        .args(["--op", "both", "--block-sizes", "64K,1M", "--iters", "20", "--no-progress", "--json"])
        .arg(&json)
        .output()
        .expect("running the initiator");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let rows: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).ok();
    assert_eq!(rows.len(), 8, "tcp and raw-tcp, 2 ops x 2 sizes:\n{stdout}");
    assert!(rows.iter().all(|r| r["gbps"].as_f64().unwrap() > 0.0));

    // The target also refuses a peer in the wrong namespace: no route from the host's namespace.
    let lost = Command::new(exe)
        .args(["--connect", "10.231.0.2:7300", "--block-sizes", "64K", "--iters", "1", "--no-progress"])
        .output()
        .unwrap();
    assert!(!lost.status.success(), "the host namespace has no route to 10.231.0.2");

    drop(target.0.stdin.take());
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while target.0.try_wait().unwrap().is_none() {
        assert!(std::time::Instant::now() < deadline, "target did not exit after its stdin closed");
        std::thread::sleep(Duration::from_millis(20));
    }
}
