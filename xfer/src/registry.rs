use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use xfer_core::BackendFactory;

/// Backend factories by name. The default registry always has `tcp`, `posix` and `gds` (which
/// fails to attach, with the reason, where cuFile is absent); other plugins are added
/// with [`register`](BackendRegistry::register) (or by cargo feature in this crate: `ucx`,
/// `libfabric`, `quic`).
#[derive(Clone)]
pub struct BackendRegistry {
    factories: BTreeMap<&'static str, Arc<dyn BackendFactory>>,
}

impl BackendRegistry {
    /// A registry with no backends at all.
    pub fn empty() -> Self {
        BackendRegistry { factories: BTreeMap::new() }
    }

    pub fn register(&mut self, factory: Arc<dyn BackendFactory>) {
        self.factories.insert(factory.name(), factory);
    }

    pub fn get(&self, name: &str) -> Option<&Arc<dyn BackendFactory>> {
        self.factories.get(name)
    }

    pub fn names(&self) -> Vec<&'static str> {
        self.factories.keys().copied().collect()
    }
}

impl Default for BackendRegistry {
    fn default() -> Self {
        let mut registry = Self::empty();
        registry.register(Arc::new(xfer_tcp::TcpFactory));
        registry.register(Arc::new(xfer_posix::PosixFactory));
        registry.register(Arc::new(xfer_gds::GdsFactory));
        #[cfg(feature = "ucx")]
        registry.register(Arc::new(xfer_ucx::UcxFactory));
        #[cfg(feature = "libfabric")]
        registry.register(Arc::new(xfer_libfabric::LibfabricFactory));
        #[cfg(feature = "quic")]
        registry.register(Arc::new(xfer_quic::QuicFactory));
        registry
    }
}

impl fmt::Debug for BackendRegistry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.factories.keys()).finish()
    }
}
