//! The GPU baselines of the staging bars, measured in one run: raw `cuMemcpy` device→host and
//! host→device against pinned memory and device→device, beside the staging pipeline (a
//! `CudaLane` filling and draining slots with the wire replaced by nothing) at the TCP backend's
//! default slot size. Prints one JSON object; `ci/gpu-check.sh` reads it.
//!
//!     cargo run --release -p xfer-cuda --example cuda_bandwidth [-- MIB [SLOT_KIB]]

use std::time::Instant;

use xfer_core::staging::{self, CopyLane, Flow, Wire};
use xfer_core::{BackendError, Desc, LocalMem, LocalRegion, MemSlice, MemType};
use xfer_cuda::{CudaLane, DeviceBuffer, PinnedHost};

/// A wire that moves nothing: the pipeline's own speed.
struct Null;

impl Wire for Null {
    fn send(&mut self, _: &[u8]) -> Result<(), BackendError> {
        Ok(())
    }
    fn send_host(&mut self, _: &MemSlice) -> Result<(), BackendError> {
        Ok(())
    }
    fn receive(&mut self, _: &mut [u8]) -> Result<(), BackendError> {
        Ok(())
    }
    fn receive_host(&mut self, _: &mut MemSlice) -> Result<(), BackendError> {
        Ok(())
    }
}

fn gbps(bytes: usize, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

/// Best of `rounds` timings of `f`, in GB/s.
fn best(rounds: usize, bytes: usize, mut f: impl FnMut() -> anyhow::Result<()>) -> anyhow::Result<f64> {
    let mut top = 0f64;
    for _ in 0..rounds {
        let started = Instant::now();
        f()?;
        top = top.max(gbps(bytes, started.elapsed().as_secs_f64()));
    }
    Ok(top)
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let mib: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(512);
    let slot_kib: usize = args.next().map(|a| a.parse()).transpose()?.unwrap_or(1024);
    let len = mib << 20;
    let device = DeviceBuffer::new(0, len)?;
    let other = DeviceBuffer::new(0, len)?;
    let mut pinned = PinnedHost::new(len)?;
    let d2h = best(5, len, || Ok(device.read(0, pinned.as_mut_slice())?))?;
    let h2d = best(5, len, || Ok(device.write(0, pinned.as_slice())?))?;
    let d2d = best(5, len, || Ok(other.copy_from(&device)?))?;
    // SAFETY: a VRAM region over the device buffer, which outlives it; nothing dereferences it
    // on the host (the lane copies through CUDA).
    let region = std::sync::Arc::new(unsafe {
        LocalRegion::new(1, MemType::Vram, Desc::new(device.ptr(), len as u64, device.device()))
    });
    let pin = region.pin().expect("a fresh region pins");
    let mut lane = CudaLane::new(0, 2, slot_kib << 10)?;
    let mut pipeline = |flow: Flow| -> anyhow::Result<f64> {
        best(5, len, || {
            let mut pieces: Vec<LocalMem> = vec![pin.local_at(device.ptr(), len as u64).expect("inside")];
            Ok(staging::run(flow, &mut pieces, &mut lane as &mut dyn CopyLane, &mut Null)?)
        })
    };
    let staged_d2h = pipeline(Flow::ToWire)?;
    let staged_h2d = pipeline(Flow::FromWire)?;
    println!(
        "{{\"bytes\":{len},\"slot_bytes\":{},\"memcpy_d2h_gbps\":{d2h:.2},\"memcpy_h2d_gbps\":{h2d:.2},\
         \"memcpy_d2d_gbps\":{d2d:.2},\"staged_d2h_gbps\":{staged_d2h:.2},\"staged_h2d_gbps\":{staged_h2d:.2}}}",
        slot_kib << 10
    );
    Ok(())
}
