//! pd-chaos: a simulated P/D cluster (coordinator, `pd-sim` engines and their sidecars) in
//! Linux network namespaces, broken on purpose under a steady load: engines and the
//! coordinator killed, nodes cut off, links made lossy and slow. Each scenario checks the
//! failure-handling promises of the daemons and reports its figures in a summary table.

pub mod cluster;
pub mod load;
pub mod netns;
pub mod scenarios;
pub mod summary;
