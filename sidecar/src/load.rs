//! The engine's load as the coordinator wants it, read from the engine's Prometheus `/metrics`
//! (vLLM and SGLang names, PROTOCOLS.md §3, §4).

use pd_api::Load;

/// Sums the samples of each gauge over its label sets (one line per model/engine/rank);
/// KV usage is averaged.
pub fn parse(text: &str) -> Load {
    let mut running: Option<f64> = None;
    let mut waiting: Option<f64> = None;
    let mut usage = (0.0, 0u32);
    for line in text.lines() {
        if line.starts_with('#') {
            continue;
        }
        let Some((name_labels, value)) = line.rsplit_once(' ') else { continue };
        let name = name_labels.split('{').next().unwrap_or("").trim();
        let Ok(v) = value.trim().parse::<f64>() else { continue };
        if !v.is_finite() {
            continue;
        }
        match name {
            "vllm:num_requests_running" | "sglang:num_running_reqs" => *running.get_or_insert(0.0) += v,
            "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => *waiting.get_or_insert(0.0) += v,
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" | "sglang:token_usage" => {
                usage.0 += v;
                usage.1 += 1;
            }
            _ => {}
        }
    }
    Load {
        running: running.map(|v| v.max(0.0).round() as u64),
        waiting: waiting.map(|v| v.max(0.0).round() as u64),
        kv_usage: (usage.1 > 0).then(|| (usage.0 / f64::from(usage.1)).clamp(0.0, 1.0)),
        ..Load::default()
    }
}

/// The load of several ranks as one engine: counts add up, usage averages.
pub fn combine(loads: &[Load]) -> Load {
    let sum = |f: fn(&Load) -> Option<u64>| {
        loads.iter().filter_map(f).fold(None, |acc: Option<u64>, v| Some(acc.unwrap_or(0) + v))
    };
    let usages: Vec<f64> = loads.iter().filter_map(|l| l.kv_usage).collect();
    Load {
        running: sum(|l| l.running),
        waiting: sum(|l| l.waiting),
        kv_usage: (!usages.is_empty()).then(|| usages.iter().sum::<f64>() / usages.len() as f64),
        ..Load::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vllm_and_sglang_text() {
        let text = "# HELP vllm:num_requests_running x\n# TYPE vllm:num_requests_running gauge\n\
            vllm:num_requests_running{model_name=\"m\",engine=\"0\"} 3.0\n\
            vllm:num_requests_running{model_name=\"m\",engine=\"1\"} 2.0\n\
            vllm:num_requests_waiting{model_name=\"m\",engine=\"0\"} 7\n\
            vllm:kv_cache_usage_perc{model_name=\"m\",engine=\"0\"} 0.5\n\
            vllm:kv_cache_usage_perc{model_name=\"m\",engine=\"1\"} 0.25\n\
            vllm:num_requests_running_other 99\nbroken line\nvllm:num_requests_waiting NaN\n";
        assert_eq!(parse(text), Load { running: Some(5), waiting: Some(7), kv_usage: Some(0.375), ..Load::default() });
        let sg = "sglang:num_running_reqs{tp_rank=\"0\"} 4\nsglang:num_queue_reqs 1\nsglang:token_usage 0.1\n";
        assert_eq!(parse(sg), Load { running: Some(4), waiting: Some(1), kv_usage: Some(0.1), ..Load::default() });
        assert_eq!(parse(""), Load::default());
        assert_eq!(serde_json::to_string(&Load::default()).unwrap(), "{}");
        let both = combine(&[parse(text), parse(sg), Load::default()]);
        assert_eq!(both.running, Some(9));
        assert_eq!(both.waiting, Some(8));
        assert!((both.kv_usage.unwrap() - 0.2375).abs() < 1e-9);
    }
}
