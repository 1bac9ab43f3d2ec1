//! xferbench end to end with FILE and GPU memory on either side (`--local-mem`, `--remote-mem`):
//! the initiator spawns itself as the target and `--check` verifies every moved byte.

use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn xferbench(line: &str, file_dir: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_xferbench"))
        .args(line.split_whitespace())
        .arg("--file-dir")
        .arg(file_dir)
        .arg("--no-progress")
        .output()
        .expect("runs xferbench")
}

/// An empty directory for one test's files, on the build's disk (temp dirs may be tmpfs, which
/// refuses O_DIRECT).
fn file_dir(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("xferbench-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Runs `line --json <tmp>`; returns each row's (op, mem) and the stdout.
fn run(name: &str, line: &str) -> (Vec<(String, String)>, String) {
    let dir = file_dir(name);
    let json = dir.join("rows.json");
    let output = xferbench(&format!("{line} --json {}", json.display()), &dir);
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{line}\nstdout:\n{stdout}\nstderr:\n{stderr}");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).unwrap();
    let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
    assert!(left.is_empty(), "both sides' files are gone: {left:?}");
    std::fs::remove_dir(&dir).unwrap();
    let kinds = rows
        .iter()
        .map(|row| (row["op"].as_str().unwrap().to_string(), row["mem"].as_str().unwrap_or("").to_string()))
        .collect();
    (kinds, stdout)
}

fn pairs(expected: &[(&str, &str)]) -> Vec<(String, String)> {
    expected.iter().map(|(op, mem)| (op.to_string(), mem.to_string())).collect()
}

const SMALL: &str = "--op both --block-sizes 64K,1M --batch 2 --iters 3 --warmup 1 --check";

#[test]
fn file_on_either_side_over_tcp_with_check() {
    let (rows, stdout) = run("local-file", &format!("--local-mem file --remote-mem dram {SMALL}"));
    let read_write = [("read", "DRAM→FILE"), ("read", "DRAM→FILE"), ("write", "FILE→DRAM"), ("write", "FILE→DRAM")];
    assert_eq!(rows, pairs(&read_write));
    assert!(stdout.contains("memory") && stdout.contains("DRAM→FILE") && stdout.contains("FILE→DRAM"), "{stdout}");

    let (rows, stdout) = run("remote-file", &format!("--local-mem dram --remote-mem file {SMALL} --compare"));
    let with_raw = [
        ("read", "FILE→DRAM"),
        ("read", ""),
        ("read", "FILE→DRAM"),
        ("read", ""),
        ("write", "DRAM→FILE"),
        ("write", ""),
        ("write", "DRAM→FILE"),
        ("write", ""),
    ];
    assert_eq!(rows, pairs(&with_raw), "the raw-tcp baseline moves DRAM");
    assert!(stdout.contains("FILE→DRAM") && stdout.contains("DRAM→FILE"), "{stdout}");
}

#[test]
fn direct_needs_a_file_and_aligned_sizes() {
    let dir = file_dir("direct-misaligned");
    let out = xferbench("--local-mem file --direct --block-sizes 64K,6000 --iters 1", &dir);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("multiples of 4096, not 6000"), "{stderr}");
    let out = xferbench("--direct --iters 1", &dir);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--local-mem file"));
    std::fs::remove_dir(&dir).unwrap();
}

#[test]
fn direct_files_on_both_sides() {
    let dir = file_dir("direct-probe");
    let probe = dir.join("probe");
    let opened = OpenOptions::new().write(true).create(true).custom_flags(libc::O_DIRECT).open(&probe);
    std::fs::remove_file(&probe).ok();
    std::fs::remove_dir(&dir).unwrap();
    if let Err(err) = opened {
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), "SKIPPED: {} does not open files with O_DIRECT here: {err}", dir.display());
        return;
    }
    let (rows, stdout) = run("direct", &format!("--local-mem file --remote-mem file --direct {SMALL}"));
    assert_eq!(rows.len(), 4);
    assert!(rows.iter().all(|(_, mem)| mem == "FILE→FILE"), "{rows:?}");
    assert!(stdout.contains("FILE→FILE"), "{stdout}");
}

#[test]
fn gpu_memory_runs_or_fails_with_the_reason() {
    match xfer::cuda::why_no_gpu() {
        Some(reason) => {
            eprintln!("SKIPPED (no GPU, so only the refusal is tested): {reason}");
            let dir = file_dir("no-gpu");
            for line in ["--local-mem vram", "--remote-mem vram"] {
                let out = xferbench(&format!("{line} --block-sizes 64K --iters 1"), &dir);
                assert!(!out.status.success(), "{line}");
                let stderr = String::from_utf8_lossy(&out.stderr);
                assert!(stderr.contains("CUDA is not available") && stderr.contains(&reason), "{line}: {stderr}");
                assert!(!stderr.contains("panicked"), "{stderr}");
            }
            std::fs::remove_dir(&dir).unwrap();
        }
        None => {
            let (rows, _) = run("gpu-local", &format!("--local-mem vram --remote-mem dram {SMALL}"));
            assert!(rows.iter().any(|(_, mem)| mem == "VRAM→DRAM"), "{rows:?}");
            let (rows, _) = run("gpu-remote", &format!("--local-mem file --remote-mem vram {SMALL}"));
            assert!(rows.iter().any(|(_, mem)| mem == "FILE→VRAM"), "{rows:?}");
        }
    }
}

/// UCX stages a local file like TCP does (its build here has no CUDA, and never takes files).
#[cfg(feature = "ucx")]
#[test]
fn file_over_ucx_staged_with_check() {
    let line = format!("--backend ucx --params tls=tcp,net_devices=lo --local-mem file --remote-mem dram {SMALL}");
    let (rows, stdout) = run("ucx-file", &line);
    let read_write = [("read", "DRAM→FILE"), ("read", "DRAM→FILE"), ("write", "FILE→DRAM"), ("write", "FILE→DRAM")];
    assert_eq!(rows, pairs(&read_write));
    assert!(stdout.contains("FILE→DRAM"), "{stdout}");
}
