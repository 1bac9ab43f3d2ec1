//! What coordbench and dynamo-compare share: one workload generator and one set of measuring
//! tools, so that both programs replay the same events and count the same way.

pub mod measure;
pub mod workload;
