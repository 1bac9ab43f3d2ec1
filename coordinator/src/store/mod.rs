//! Where membership and leases live beyond this process. In memory (the default) there is
//! nothing here: the [`crate::cluster::Cluster`] is the store. With `--store etcd://…` every
//! registration is an etcd key under a lease, so several coordinators share the cluster.

pub mod etcd;
