//! Real SGLang servers (CPU engine) started through `ci/sglang/engine.sh run`: a P/D prefill or
//! decode over Mooncake's TCP transport or over xfer (SGLang's NIXL transfer backend with
//! pd_xfer.nixl as NIXL), or a plain (non-disaggregated) server.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::{
    build_model, free_port_range, repo_root, wait_http_ok, xfer_engine_args, xfer_site_from_env, E2eError, Proc,
};

/// How to run the real-SGLang suite when it is skipped.
pub const SGLANG_SKIP_HOW: &str = "install it with `ci/sglang/install.sh` (prints the venv) and run \
     `PD_SGLANG_VENV=<venv> cargo test -p pd-e2e --test sglang -- --test-threads 1` (ci/test.sh does)";

/// What the real-SGLang suite needs from the environment.
#[derive(Clone, Debug)]
pub struct SglangSettings {
    pub venv: PathBuf,
    pub model: PathBuf,
    /// First port of the range the suite uses (`PD_E2E_SGLANG_PORT_BASE`, default 28100).
    pub port_base: u16,
    /// How P/D pairs move their KV (`PD_SGLANG_TRANSFER`).
    pub transfer: SglangTransfer,
}

/// How a P/D pair moves its KV (`PD_SGLANG_TRANSFER`: `mooncake`, the default, or `xfer`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SglangTransfer {
    /// Mooncake's TCP transport, SGLang's default.
    Mooncake,
    /// SGLang's NIXL transfer backend with pd_xfer.nixl as NIXL, loaded from the unpacked wheel
    /// (`PD_XFER_SITE`), on the xfer backend `PD_XFER_BACKEND` (TCP or UCX; default TCP).
    Xfer { site: PathBuf, backend: String },
}

impl SglangTransfer {
    fn from_env() -> Result<SglangTransfer, E2eError> {
        match std::env::var("PD_SGLANG_TRANSFER").unwrap_or_default().as_str() {
            "" | "mooncake" => Ok(SglangTransfer::Mooncake),
            "xfer" => {
                let (site, backend) = xfer_site_from_env("PD_SGLANG_TRANSFER")?;
                Ok(SglangTransfer::Xfer { site, backend })
            }
            other => Err(E2eError::BadSetting {
                var: "PD_SGLANG_TRANSFER",
                value: format!("{other:?}"),
                problem: "expected mooncake or xfer",
            }),
        }
    }

    /// engine.sh's flags for this transfer.
    fn engine_args(&self) -> Vec<String> {
        match self {
            SglangTransfer::Mooncake => vec!["--transfer".into(), "mooncake".into()],
            SglangTransfer::Xfer { site, backend } => {
                [vec!["--transfer".into(), "xfer".into()], xfer_engine_args(site, backend)].concat()
            }
        }
    }
}

impl std::fmt::Display for SglangTransfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SglangTransfer::Mooncake => write!(f, "Mooncake TCP"),
            SglangTransfer::Xfer { backend, .. } => write!(f, "xfer {backend} (pd_xfer.nixl as NIXL)"),
        }
    }
}

impl SglangSettings {
    /// `Err(reason)` when the suite cannot run here (no `PD_SGLANG_VENV`).
    pub fn from_env() -> Result<SglangSettings, E2eError> {
        let venv = std::env::var_os("PD_SGLANG_VENV")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
            .ok_or(E2eError::Unset { var: "PD_SGLANG_VENV" })?;
        if !venv.join("lib").exists() || !venv.join("bin/python").exists() {
            let value = venv.display().to_string();
            return Err(E2eError::BadSetting { var: "PD_SGLANG_VENV", value, problem: "is not a venv" });
        }
        // The same tiny Llama the vLLM suite uses (make-model.py needs only `tokenizers`).
        let model = match std::env::var_os("PD_VLLM_MODEL") {
            Some(m) if !m.is_empty() => PathBuf::from(m),
            _ => build_model(&venv)?,
        };
        let wanted = std::env::var("PD_E2E_SGLANG_PORT_BASE").ok().and_then(|p| p.parse().ok()).unwrap_or(28100);
        let transfer = SglangTransfer::from_env()?;
        Ok(SglangSettings { venv, model, port_base: free_port_range(wanted, 50)?, transfer })
    }
}

/// The part a server plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SglangRole {
    /// P/D prefill with its bootstrap server on this port.
    Prefill {
        bootstrap_port: u16,
    },
    Decode,
    /// Not disaggregated: computes whole requests (the reference).
    Plain,
}

/// How to start one server.
#[derive(Clone, Debug)]
pub struct SglangSpec {
    pub name: String,
    pub role: SglangRole,
    pub port: u16,
    /// KV-event publisher port (the server binds it).
    pub events_port: Option<u16>,
    /// KV cache size in tokens (always capped).
    pub max_total_tokens: u32,
}

/// A running real SGLang server.
#[derive(Debug)]
pub struct SglangServer {
    pub spec: SglangSpec,
    pub proc: Proc,
    pub started_in: Duration,
}

impl SglangServer {
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.spec.port)
    }

    pub fn events_endpoint(&self) -> Option<String> {
        self.spec.events_port.map(|p| format!("tcp://127.0.0.1:{p}"))
    }

    /// Spawns the server; call [`SglangServer::wait_healthy`] next (lets several start together).
    pub fn spawn(settings: &SglangSettings, spec: SglangSpec) -> Result<SglangServer, E2eError> {
        let mut args: Vec<String> =
            vec![repo_root().join("ci/sglang/engine.sh").display().to_string(), "run".into(), spec.name.clone()];
        let role = match spec.role {
            SglangRole::Prefill { bootstrap_port } => {
                args.extend(["--bootstrap-port".into(), bootstrap_port.to_string()]);
                "prefill"
            }
            SglangRole::Decode => "decode",
            SglangRole::Plain => "plain",
        };
        for (flag, value) in [
            ("--role", role.to_string()),
            ("--port", spec.port.to_string()),
            ("--max-total-tokens", spec.max_total_tokens.to_string()),
            ("--venv", settings.venv.display().to_string()),
            ("--model", settings.model.display().to_string()),
        ] {
            args.extend([flag.to_string(), value]);
        }
        args.extend(settings.transfer.engine_args());
        if let Some(p) = spec.events_port {
            args.extend(["--events".into(), format!("tcp://127.0.0.1:{p}")]);
        }
        let proc = Proc::spawn(&spec.name, Path::new("bash"), &args, &[])?;
        Ok(SglangServer { spec, proc, started_in: Duration::ZERO })
    }

    /// Waits (bounded) for `GET /health` to answer 200.
    pub fn wait_healthy(&mut self, timeout: Duration) -> Result<(), E2eError> {
        let start = Instant::now();
        let health = format!("{}/health", self.url());
        wait_http_ok(&mut self.proc, &health, timeout)?;
        self.started_in = start.elapsed();
        Ok(())
    }
}
