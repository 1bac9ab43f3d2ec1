//! The harness itself, without any engine: process groups die with their owner however it ends,
//! and the parsers of Prometheus text and SSE streams read what vLLM writes.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use pd_e2e::{metric_sum, sse_text, Proc};

fn group_alive(pgid: i32) -> bool {
    // SAFETY: signal 0 only checks that the group exists.
    unsafe { libc::kill(-pgid, 0) == 0 }
}

fn wait_gone(pgid: i32, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    while group_alive(pgid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    !group_alive(pgid)
}

fn sleepers(name: &str) -> Proc {
    let args = ["-c".to_string(), "sleep 300 & sleep 300".to_string()];
    Proc::spawn(name, Path::new("sh"), &args, &[]).expect("spawn")
}

#[test]
fn a_group_dies_when_its_proc_is_dropped() {
    let mut p = sleepers("harness-drop");
    let pgid = p.pgid;
    assert!(p.running());
    assert!(p.main_pid().is_some(), "the guardian's child is visible");
    drop(p);
    assert!(wait_gone(pgid, Duration::from_secs(20)), "group {pgid} survived its Proc");
}

/// Not a test on its own: the body of the child process that the next test kills.
#[test]
#[ignore = "run by guardian_kills_the_group_when_its_owner_is_killed"]
fn spawner_child() {
    if std::env::var_os("PD_E2E_SPAWNER").is_none() {
        return;
    }
    let p = sleepers("harness-orphan");
    println!("PGID {}", p.pgid);
    std::thread::sleep(Duration::from_secs(120));
}

#[test]
fn guardian_kills_the_group_when_its_owner_is_killed() {
    let mut owner = Command::new(std::env::current_exe().expect("current exe"))
        .args(["--exact", "spawner_child", "--ignored", "--nocapture", "--test-threads", "1"])
        .env("PD_E2E_SPAWNER", "1")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn owner");
    let stdout = owner.stdout.take().expect("stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            // libtest prints "test spawner_child ... " before the line.
            if let Some(pgid) = line.split("PGID ").nth(1) {
                let _ = tx.send(pgid.trim().parse::<i32>().expect("pgid"));
            }
        }
    });
    let pgid = match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(pgid) => pgid,
        Err(e) => {
            let _ = owner.kill();
            panic!("the owner never reported its group: {e}");
        }
    };
    assert!(group_alive(pgid));
    owner.kill().expect("SIGKILL the owner");
    let _ = owner.wait();
    assert!(wait_gone(pgid, Duration::from_secs(20)), "group {pgid} outlived its SIGKILLed owner");
}

#[test]
fn prometheus_sums_by_name_and_labels() {
    let text = "# HELP vllm:prompt_tokens_by_source_total x\n\
        vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"m\",source=\"local_compute\"} 12.0\n\
        vllm:prompt_tokens_by_source_total{engine=\"0\",model_name=\"m\",source=\"external_kv_transfer\"} 115.0\n\
        vllm:nixl_xfer_time_seconds_count{engine=\"0\",model_name=\"m\"} 3.0\n\
        vllm:nixl_xfer_time_seconds_count_extra 9\n";
    let name = "vllm:prompt_tokens_by_source_total";
    assert_eq!(metric_sum(text, name, &[("source", "external_kv_transfer")]), 115.0);
    assert_eq!(metric_sum(text, name, &[]), 127.0);
    assert_eq!(metric_sum(text, "vllm:nixl_xfer_time_seconds_count", &[]), 3.0);
    assert_eq!(metric_sum(text, "vllm:absent", &[]), 0.0);
}

#[test]
fn sse_streams_of_completions_and_chat() {
    let completions =
        "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"text\":\"b\"}]}\n\ndata: [DONE]\n\n";
    assert_eq!(sse_text(completions).unwrap(), "ab");
    let chat = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n\
        data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\ndata: [DONE]\n\n";
    assert_eq!(sse_text(chat).unwrap(), "x");
    assert!(sse_text("data: {\"choices\":[{\"text\":\"a\"}]}\n\n").is_err(), "no [DONE]");
    assert!(sse_text("data: {\"error\":{\"message\":\"boom\"}}\n\ndata: [DONE]\n\n").is_err());
}
