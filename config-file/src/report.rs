//! One line for an error and its causes, at the edge of a binary.

use std::error::Error;

/// `error: cause: cause …`, each cause once. This workspace's errors name their cause in their
/// own message and also return it from `source()`, so that a log line or an HTTP body made from
/// the message alone is complete; printing the whole chain (anyhow's `{:#}`) would then repeat
/// each cause. A cause whose text the error above it already contains is left out.
pub fn error_line(err: &(dyn Error + 'static)) -> String {
    let mut line = err.to_string();
    let mut above = line.clone();
    let mut cause = err.source();
    while let Some(next) = cause {
        let text = next.to_string();
        if !above.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        above = text;
        cause = next.source();
    }
    line
}

#[cfg(test)]
mod tests {
    use std::fmt;

    use super::*;

    /// An error with a message and, optionally, a cause it may or may not name itself.
    #[derive(Debug)]
    struct Layer {
        message: String,
        cause: Option<Box<Layer>>,
    }

    impl Layer {
        fn leaf(message: &str) -> Layer {
            Layer { message: message.into(), cause: None }
        }

        /// A layer whose message names its cause, as this workspace's errors do.
        fn naming(prefix: &str, cause: Layer) -> Layer {
            Layer { message: format!("{prefix}: {cause}"), cause: Some(Box::new(cause)) }
        }

        /// A layer that leaves its cause to `source()`, as anyhow's context does.
        fn context(message: &str, cause: Layer) -> Layer {
            Layer { message: message.into(), cause: Some(Box::new(cause)) }
        }
    }

    impl fmt::Display for Layer {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(&self.message)
        }
    }

    impl Error for Layer {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            self.cause.as_deref().map(|c| c as &(dyn Error + 'static))
        }
    }

    #[test]
    fn a_cause_the_message_names_is_not_repeated() {
        let err = Layer::context(
            "registering 16.0 MiB of GPU memory",
            Layer::naming(
                "backend ucx",
                Layer::naming("protocol error", Layer::leaf("ucx mem_map: Invalid parameter (-5)")),
            ),
        );
        assert_eq!(
            error_line(&err),
            "registering 16.0 MiB of GPU memory: backend ucx: protocol error: ucx mem_map: Invalid parameter (-5)"
        );
    }

    #[test]
    fn causes_left_to_source_are_all_printed() {
        let err = Layer::context("starting", Layer::context("binding 127.0.0.1:80", Layer::leaf("permission denied")));
        assert_eq!(error_line(&err), "starting: binding 127.0.0.1:80: permission denied");
    }

    #[test]
    fn anyhow_context_over_a_naming_error() {
        let err = anyhow::Error::new(Layer::naming("side channel 10.0.0.1:5555", Layer::leaf("connection refused")))
            .context("loading the peer's metadata");
        assert_eq!(
            error_line(err.as_ref()),
            "loading the peer's metadata: side channel 10.0.0.1:5555: connection refused"
        );
    }
}
