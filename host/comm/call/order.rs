//! The order of one rank's calls across streams ([`Comm::ordered`]):
//! kernels keep per-block state (epochs, generations, ring counters,
//! staging) that assumes a rank's calls run one after the other, whichever
//! stream each is queued on.

use cudarc::driver::sys;

use super::super::Comm;
use crate::driver;
use crate::error::{Error, Result};

impl Comm {
    /// Runs `body` (the call's launches on `stream`) ordered after the
    /// rank's previous call. Calls on one rank must not overlap: kernels
    /// keep per-block state (epochs, generations, ring counters, staging)
    /// that assumes they run one after the other.
    ///
    /// * Eager calls: one on another stream than the previous eager call
    ///   waits for that call's work through an event recorded on the
    ///   previous call's stream *during* that call (right after its
    ///   launches), or on the communicator's own stream (alive as long as
    ///   the communicator). A later call never touches an earlier call's
    ///   stream: the caller may have destroyed it since. Streams are told
    ///   apart by their id (`cuStreamGetId`), not their handle, whose
    ///   address a new stream may reuse.
    /// * Captured calls: one on another stream than the previous call of the
    ///   same capture is refused, since the two could run concurrently in
    ///   the graph.
    /// * Eager calls and graph replays cannot be ordered here: the caller
    ///   orders them (documented on `Comm::all_reduce_raw`).
    /// * Eager calls of different communicators on one GPU take turns
    ///   (`device_order.rs`).
    ///
    /// The order lock is held across `body`, so calls of one communicator
    /// from several threads are serialised on the host too.
    ///
    /// # Safety
    /// `stream` is a live stream of the communicator's context; `body`'s
    /// own contract is the caller's.
    pub(super) unsafe fn ordered(
        &self,
        stream: sys::CUstream,
        capture: Option<u64>,
        body: impl FnOnce() -> Result<()>,
    ) -> Result<()> {
        let mut order = self.order.lock().map_err(|_| Error::Broken("call-order lock poisoned".into()))?;
        let own_stream = stream == self.stream.cu_stream();
        match capture {
            Some(capture) => {
                // Every stream of one capture is alive while it lasts, so
                // within a capture the handle tells streams apart
                // (`cuStreamGetId` on a capturing stream invalidates the
                // capture).
                let stream_handle = stream as u64;
                if order.last_capture.is_some_and(|c| c.capture == capture && c.stream_handle != stream_handle) {
                    return Err(Error::invalid(
                        "all_reduce: two calls of one communicator were captured on different streams of the same \
                         graph; they could run concurrently and corrupt each other. Capture a communicator's calls \
                         on one stream (join the branches first).",
                    ));
                }
                order.last_capture = Some(CapturedCall { capture, stream_handle });
                body()
            }
            None => {
                // SAFETY: `stream` is live (contract of this fn) and not
                // capturing.
                let stream_id = unsafe { driver::stream_id(stream)? };
                if let Some(prev) = order.last_eager.filter(|p| p.stream_id != stream_id) {
                    let event = order.event(&self.ctx)?;
                    // SAFETY: our own stream lives as long as `self`; `stream`
                    // is live (contract). A call on a foreign stream was
                    // recorded at its end, below.
                    unsafe {
                        if !prev.recorded {
                            event.record(self.stream.cu_stream())?;
                        }
                        event.wait(stream)?;
                    }
                }
                // SAFETY: `stream` is live and not capturing (above).
                let result = unsafe { self.device_turn.eager(stream, body) };
                // A call on a foreign stream records its end now, while the
                // stream is certainly alive (the caller's contract for this
                // call), so that a later call on another stream need not
                // touch it.
                let recorded = !own_stream;
                if recorded {
                    // SAFETY: as above.
                    let record = order.event(&self.ctx).and_then(|event| unsafe { event.record(stream) });
                    if result.is_ok() {
                        record?;
                    }
                }
                order.last_eager = Some(EagerCall { stream_id, recorded });
                result
            }
        }
    }
}

/// The previous eager call of a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct EagerCall {
    /// `driver::stream_id` of its stream.
    stream_id: u64,
    /// Whether `CallOrder::event` was recorded on its stream at its end
    /// (a foreign stream); else it ran on the communicator's own stream.
    recorded: bool,
}

/// The previous captured call of a rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct CapturedCall {
    capture: u64,
    /// Its stream's handle (alive while the capture lasts).
    stream_handle: u64,
}

/// What orders a rank's calls across streams (`Comm::ordered`).
#[derive(Default)]
pub(crate) struct CallOrder {
    last_eager: Option<EagerCall>,
    last_capture: Option<CapturedCall>,
    /// Created at the first eager call that needs it (never during a
    /// capture).
    event: Option<driver::Event>,
}

impl CallOrder {
    fn event(&mut self, ctx: &std::sync::Arc<cudarc::driver::CudaContext>) -> Result<&driver::Event> {
        let event = match self.event.take() {
            Some(event) => event,
            None => driver::Event::new(ctx)?,
        };
        Ok(self.event.insert(event))
    }
}
