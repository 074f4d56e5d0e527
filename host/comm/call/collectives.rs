//! The entry points of the collectives besides the allreduce, on the same
//! pipeline. No algorithm implements them yet, so they are not public:
//! the first all-gather (reduce-scatter) algorithm makes its entry point
//! `pub` (ARCHITECTURE.md, "How to add an algorithm"). Until then a call
//! would fail with `Error::Unsupported` at the choose step.

#![allow(dead_code)]

use cudarc::driver::sys;
use tp_allreduce_kernels::ids::{Collective, DType};

use super::{Comm, Request};
use crate::error::Result;

impl Comm {
    /// All-gather: rank r's `count` elements at `send` land at element
    /// `r * count` of every rank's `recv` (`world * count` elements); in
    /// place when `send` is this rank's share of `recv`.
    ///
    /// # Safety
    /// As `Comm::all_reduce_raw`, with `recv` valid for `world * count`
    /// elements.
    pub(crate) unsafe fn all_gather_raw(
        &self,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
    ) -> Result<()> {
        let request = Request { what: "all_gather", collective: Collective::AllGather, send, recv, count, dtype, epilogue: None };
        // SAFETY: the caller's contract.
        unsafe { self.collective(request, stream) }
    }

    /// Reduce-scatter: share r (`count` elements from element `r * count`)
    /// of the sum of every rank's `send` (`world * count` elements) lands in
    /// rank r's `recv`; in place when `recv` is this rank's share of `send`.
    ///
    /// # Safety
    /// As `Comm::all_reduce_raw`, with `send` valid for `world * count`
    /// elements.
    pub(crate) unsafe fn reduce_scatter_raw(
        &self,
        send: sys::CUdeviceptr,
        recv: sys::CUdeviceptr,
        count: usize,
        dtype: DType,
        stream: sys::CUstream,
    ) -> Result<()> {
        let request =
            Request { what: "reduce_scatter", collective: Collective::ReduceScatter, send, recv, count, dtype, epilogue: None };
        // SAFETY: the caller's contract.
        unsafe { self.collective(request, stream) }
    }
}
