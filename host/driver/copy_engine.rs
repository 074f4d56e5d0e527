//! Driver calls of the copy-engine ring: its helper stream (created at
//! init, never during a capture), event record/wait, the flag publication
//! (`cuStreamWriteValue32` where stream memory operations are supported,
//! else a one-thread kernel), and [`run`], which issues one call's
//! program ([`CopyEngineOp`]s, built by `algorithm/copy_engine_ring.rs`) on the
//! caller's stream and the helper stream. Inside a stream capture the
//! same calls become graph nodes: the helper stream joins the capture
//! through the fork event and leaves it through the join event.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};
use tp_allreduce_kernels::params::CopyEngineParams;

use super::{bind, cu, device_attribute, launch, launch_by_value, Event, Kernel, KernelArgs, ParamStruct};
use crate::error::Result;

/// A non-blocking stream of the library's own (the copy engine's queue).
pub struct HelperStream {
    ctx: Arc<CudaContext>,
    stream: sys::CUstream,
}

// SAFETY: a CUstream handle may be used from any thread of the process.
unsafe impl Send for HelperStream {}
// SAFETY: as above; the driver serialises work queued on one stream.
unsafe impl Sync for HelperStream {}

impl HelperStream {
    /// Creates the stream (not during a capture: callers create it at init).
    pub fn new(ctx: &Arc<CudaContext>) -> Result<HelperStream> {
        bind(ctx)?;
        let mut stream: sys::CUstream = std::ptr::null_mut();
        cu!(cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32))?;
        Ok(HelperStream { ctx: ctx.clone(), stream })
    }

    pub fn raw(&self) -> sys::CUstream {
        self.stream
    }
}

impl Drop for HelperStream {
    fn drop(&mut self) {
        if bind(&self.ctx).is_ok() {
            // SAFETY: created by cuStreamCreate in this context, destroyed
            // once; pending work completes before the driver frees it.
            let _ = unsafe { sys::cuStreamDestroy_v2(self.stream) };
        }
    }
}

/// Whether the device of `ctx` runs stream memory operations
/// (`CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS`).
pub fn stream_mem_ops_supported(ctx: &CudaContext) -> Result<bool> {
    let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1;
    Ok(device_attribute(ctx, attr)? != 0)
}

/// One operation of a copy-engine ring call, on the caller's stream
/// ("main") or the helper stream ("copy").
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum CopyEngineOp {
    /// main: wait (bounded) for the next rank's handshake, clear it.
    Handshake(CopyEngineParams),
    /// main -> copy: the copy stream waits for everything queued on main.
    Fork,
    /// copy: wait for the step kernel that last handled piece `piece`.
    AfterStep { piece: usize },
    /// copy: `bytes` from `src` to `dst` (a peer's staging).
    Copy { dst: u64, src: u64, bytes: usize },
    /// copy: raise the peer's flag at `flag` once the copy before completed.
    Publish { flag: u64 },
    /// main: the step kernel of one piece.
    Step { params: CopyEngineParams, blocks: u32, threads: u32 },
    /// main: mark the step kernel just queued as piece `piece`'s latest.
    StepDone { piece: usize },
    /// copy -> main: main waits for everything queued on the copy stream.
    Join,
}

/// What a communicator holds for its copy-engine ring calls.
pub struct CopyEngineRuntime {
    pub copy: HelperStream,
    pub fork: Event,
    pub join: Event,
    /// One per piece index: the latest step kernel of that piece.
    pub done: Vec<Event>,
    /// Publish with `cuStreamWriteValue32` (else the publish kernel).
    pub mem_ops: bool,
    pub handshake: Kernel,
    pub publish: Kernel,
}

/// Issues `ops` of one call, `step` being the step kernel of the call's
/// dtype. Capturable: nothing here allocates or creates a stream or event.
///
/// # Safety
/// `main` is a live stream of the runtime's context; every address in the
/// ops is valid for the copies and kernels (the communicator's mapped
/// regions, the caller's buffers) until the work completes; the ops come
/// from `algorithm/copy_engine_ring.rs` (fork first, join last, each
/// `AfterStep` after a `StepDone` of its piece).
pub unsafe fn run(rt: &CopyEngineRuntime, ops: &[CopyEngineOp], step: &Kernel, main: sys::CUstream) -> Result<()> {
    let copy = rt.copy.raw();
    for op in ops {
        match *op {
            CopyEngineOp::Handshake(p) => launch_by_value(&rt.handshake, 1, 32, 1, main, ParamStruct::of(&p))?,
            CopyEngineOp::Fork => {
                rt.fork.record(main)?;
                rt.fork.wait(copy)?;
            }
            CopyEngineOp::AfterStep { piece } => rt.done[piece].wait(copy)?,
            CopyEngineOp::Copy { dst, src, bytes } => super::memcpy_dtod_async(dst, src, bytes, copy)?,
            CopyEngineOp::Publish { flag } if rt.mem_ops => {
                let flags = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
                cu!(cuStreamWriteValue32_v2(copy, flag, 1, flags))?
            }
            CopyEngineOp::Publish { flag } => {
                let args = KernelArgs::new().u64(flag);
                launch(&rt.publish, 1, 32, copy, &args)?
            }
            CopyEngineOp::Step { params, blocks, threads } => {
                launch_by_value(step, blocks, threads, 1, main, ParamStruct::of(&params))?
            }
            CopyEngineOp::StepDone { piece } => rt.done[piece].record(main)?,
            CopyEngineOp::Join => {
                rt.join.record(copy)?;
                rt.join.wait(main)?;
            }
        }
    }
    Ok(())
}
