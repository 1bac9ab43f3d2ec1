//! Reading Prometheus text exposition: the sum of a metric's samples over all label sets.

/// Sum of every sample named exactly `name` (any labels).
pub fn sum(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let rest = if rest.starts_with('{') {
                &rest[rest.find('}')? + 1..]
            } else if rest.starts_with(' ') || rest.starts_with('\t') {
                rest
            } else {
                return None;
            };
            rest.split_whitespace().next()?.parse::<f64>().ok()
        })
        .filter(|v| v.is_finite())
        .sum()
}

/// Sum of the samples named `name` whose label set contains `label` (e.g. `reason="local"`).
pub fn sum_labeled(text: &str, name: &str, label: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with('{'))
        .filter(|l| l.split('}').next().is_some_and(|labels| labels.contains(label)))
        .map(|l| sum(l, name))
        .sum()
}

/// Whether any sample named `name` is present.
pub fn has(text: &str, name: &str) -> bool {
    text.lines().any(|l| l.strip_prefix(name).is_some_and(|r| r.starts_with('{') || r.starts_with(' ')))
}

/// The first of these names that is present, summed (counters are `_total` in newer clients,
/// histograms expose `_sum`).
pub fn sum_any(text: &str, names: &[&str]) -> f64 {
    names.iter().find(|n| has(text, n)).map_or(0.0, |n| sum(text, n))
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: &str = "# HELP vllm:x x\n# TYPE vllm:x counter\nvllm:x_total{engine=\"0\",model_name=\"m\"} 3\nvllm:x_total{engine=\"1\"} 4.5\nvllm:x_total_more 100\nvllm:h_sum 2.5e-1\nvllm:h_count 7\nvllm:nan NaN\n";

    #[test]
    fn sums_across_labels_and_ignores_prefix_matches() {
        assert_eq!(sum(T, "vllm:x_total"), 7.5);
        assert_eq!(sum(T, "vllm:h_sum"), 0.25);
        assert_eq!(sum(T, "vllm:h_count"), 7.0);
        assert_eq!(sum(T, "vllm:nan"), 0.0);
        assert_eq!(sum(T, "vllm:absent"), 0.0);
        assert!(has(T, "vllm:h_count") && !has(T, "vllm:h"));
        assert_eq!(sum_any(T, &["vllm:y_total", "vllm:h_sum"]), 0.25);
        assert_eq!(sum_labeled(T, "vllm:x_total", "engine=\"1\""), 4.5);
        assert_eq!(sum_labeled(T, "vllm:x_total", "engine=\"2\""), 0.0);
    }
}
