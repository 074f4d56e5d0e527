//! The validate step of the call pipeline: what can be checked of a call
//! before any device work. Pure checks of the arguments (null pointers,
//! element alignment, sizes, overlaps, the fused options), then what only
//! the driver knows (each buffer's extent in this context). A call that
//! passes reaches the kernels only with buffers the kernels may touch.

#![forbid(unsafe_code)]

use cudarc::nccl::ReduceOp;
use tp_allreduce_kernels::ids::{Collective, DType};

use super::super::Comm;
use crate::algorithm::epilogue::{check_threads, EpilogueShape, FusedOptions};
use crate::driver;
use crate::error::{Error, Result};

/// Only sums are implemented; the error says what to use instead.
pub(super) fn check_op(op: &ReduceOp) -> Result<()> {
    match op {
        ReduceOp::Sum => Ok(()),
        ReduceOp::Prod => Err(Error::Unsupported("ReduceOp::Prod: tp-allreduce implements sum only; use NCCL".into())),
        ReduceOp::Max => Err(Error::Unsupported("ReduceOp::Max: tp-allreduce implements sum only; use NCCL".into())),
        ReduceOp::Min => Err(Error::Unsupported("ReduceOp::Min: tp-allreduce implements sum only; use NCCL".into())),
        ReduceOp::Avg => Err(Error::Unsupported(
            "ReduceOp::Avg: tp-allreduce implements sum only; sum, then scale by 1/world_size".into(),
        )),
    }
}

/// How a collective's buffers relate: elements of `send` and `recv` for
/// `count` elements contributed per rank, and where `send` may sit inside
/// `recv` (in place) as an element offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct BufferShape {
    pub send: usize,
    pub recv: usize,
    /// `send == recv + in_place_offset` elements is the one overlap
    /// allowed (allreduce: the same buffer; all-gather: this rank's share
    /// of the output; reduce-scatter: `recv` at this rank's share of the
    /// input).
    pub in_place_offset: isize,
}

/// The buffers of `collective` for `count` elements per rank on rank
/// `rank` of `world`; `None` when the sizes overflow.
pub(super) fn buffer_shape(collective: Collective, count: usize, rank: usize, world: usize) -> Option<BufferShape> {
    Some(match collective {
        Collective::AllReduce => BufferShape { send: count, recv: count, in_place_offset: 0 },
        Collective::AllGather => {
            BufferShape { send: count, recv: count.checked_mul(world)?, in_place_offset: (rank * count) as isize }
        }
        Collective::ReduceScatter => {
            BufferShape { send: count.checked_mul(world)?, recv: count, in_place_offset: -((rank * count) as isize) }
        }
    })
}

/// The checks of a collective call that need no driver: pointers neither
/// null nor misaligned for `dtype`, sizes that do not overflow. Returns the
/// buffers' shape.
pub(super) fn check_pointers(
    what: &str,
    (send, recv): (u64, u64),
    shape: Option<BufferShape>,
    dtype: DType,
) -> Result<BufferShape> {
    if send == 0 || recv == 0 {
        return Err(Error::invalid(format!("{what}: null device pointer")));
    }
    let elem = dtype.size_bytes() as u64;
    if send % elem != 0 || recv % elem != 0 {
        return Err(Error::invalid(format!("{what}: pointers must be aligned to the {elem}-byte element size")));
    }
    shape
        .filter(|s| s.send.max(s.recv).checked_mul(dtype.size_bytes()).is_some())
        .ok_or_else(|| Error::invalid(format!("{what}: count overflows")))
}

/// Whether `send` and `recv` overlap other than as `shape` allows.
pub(super) fn bad_overlap(send: u64, recv: u64, shape: &BufferShape, dtype: DType) -> bool {
    let elem = dtype.size_bytes() as i128;
    let in_place = send as i128 == recv as i128 + shape.in_place_offset as i128 * elem;
    let (send_len, recv_len) = ((shape.send as u64) * elem as u64, (shape.recv as u64) * elem as u64);
    !in_place && overlap(send, send_len, recv, recv_len)
}

/// `(rows, hidden)` of typed buffers: `input.len() == rows * hidden`, every
/// other row-shaped buffer of the same length.
pub(super) fn typed_shape(what: &str, input: usize, hidden: usize, others: &[(&str, usize)]) -> Result<(usize, usize)> {
    if hidden == 0 {
        return Err(Error::invalid(format!("{what}: hidden (the weight's length) must be at least 1")));
    }
    if input % hidden != 0 {
        return Err(Error::invalid(format!(
            "{what}: input has {input} elements, not a whole number of rows of {hidden}"
        )));
    }
    for (name, len) in others {
        if *len != input {
            return Err(Error::invalid(format!("{what}: {name} has {len} elements, input {input}")));
        }
    }
    Ok((input / hidden, hidden))
}

impl Comm {
    /// Checks that `ptr..ptr+bytes` is device memory of this context (a
    /// wrong count or dtype in the raw API shows up as an overrun). One
    /// range query for `cuMemAlloc` memory. For cuMem memory the driver
    /// reports only the physical chunk holding `ptr`, so a range running
    /// past it is accepted when the chunks mapped after it continue it up
    /// to its end (a few pointer queries per chunk).
    pub(in crate::comm) fn validate_device_range(
        &self,
        what: &str,
        ptr: u64,
        bytes: usize,
        count: usize,
        dtype: DType,
        capturing: bool,
    ) -> std::result::Result<(), String> {
        match driver::allocation_range(ptr) {
            Ok((base, size)) => {
                let end = ptr.saturating_add(bytes as u64);
                let mut mapped_end = base.saturating_add(size as u64);
                if end > mapped_end && driver::vmm::backing(ptr) == driver::vmm::Backing::Vmm {
                    mapped_end = driver::vmm::mapped_end(mapped_end, end);
                }
                if end > mapped_end {
                    return Err(format!(
                        "{what} holds {} bytes from {ptr:#x}, but {count} x {} needs {bytes} (wrong count or dtype?)",
                        mapped_end.saturating_sub(ptr),
                        dtype.name()
                    ));
                }
                Ok(())
            }
            // Some allocations (e.g. virtual-memory mappings) have no
            // address range; accept them if they belong to this context.
            // Memory a graph allocates while the stream captures
            // (`cuMemAllocAsync` in the capture, e.g. an engine's output
            // tensor) is not known to pointer queries until the graph is
            // instantiated: accepted unchecked while capturing.
            Err(_) => match driver::pointer_context(ptr) {
                Some(c) if c == self.ctx.cu_ctx() => Ok(()),
                None if capturing => Ok(()),
                _ => Err(format!("{what} ({ptr:#x}) is not device memory of the communicator's context")),
            },
        }
    }
}

/// The device pointers of one fused call (weight and normed 0 without
/// RMSNorm).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct EpiloguePointers {
    pub input: u64,
    pub residual: u64,
    pub weight: u64,
    pub normed: u64,
}

/// `a..a+a_len` and `b..b+b_len` share a byte.
fn overlap(a: u64, a_len: u64, b: u64, b_len: u64) -> bool {
    a < b.saturating_add(b_len) && b < a.saturating_add(a_len)
}

/// Checks a fused call's arguments: sizes, eps, pointers (null, element
/// alignment), then each buffer's extent with `extent(name, pointer,
/// bytes)` (the driver's view of the allocation, so that a wrong count is
/// named as such before it shows as an overlap), then overlaps and the
/// thread override. `Err` is the message of an `Error::InvalidUsage`,
/// naming `what`.
pub(crate) fn check_call(
    what: &str,
    p: &EpiloguePointers,
    shape: &EpilogueShape,
    eps: f32,
    opts: &FusedOptions,
    extent: &dyn Fn(&str, u64, u64) -> Result<(), String>,
) -> Result<(), String> {
    let elem = shape.dtype.size_bytes() as u64;
    if shape.hidden == 0 {
        return Err(format!("{what}: hidden must be at least 1"));
    }
    if shape.rows > u32::MAX as usize || shape.hidden > u32::MAX as usize {
        return Err(format!("{what}: {} rows of {} elements: each must fit in 32 bits", shape.rows, shape.hidden));
    }
    let bytes = (shape.rows as u64)
        .checked_mul(shape.hidden as u64)
        .and_then(|c| c.checked_mul(elem))
        .ok_or_else(|| format!("{what}: rows x hidden overflows"))?;
    if shape.norm && !(eps.is_finite() && eps >= 0.0) {
        return Err(format!("{what}: eps must be finite and >= 0, got {eps}"));
    }
    let mut named = vec![("input", p.input, bytes), ("residual", p.residual, bytes)];
    if shape.norm {
        named.push(("weight", p.weight, shape.hidden as u64 * elem));
        named.push(("normed", p.normed, bytes));
    }
    for &(name, ptr, _) in &named {
        if ptr == 0 {
            return Err(format!("{what}: {name} is a null device pointer"));
        }
        if ptr % elem != 0 {
            return Err(format!("{what}: {name} ({ptr:#x}) is not aligned to the {elem}-byte element size"));
        }
    }
    for &(name, ptr, len) in &named {
        extent(name, ptr, len)?;
    }
    for (i, &(a, pa, la)) in named.iter().enumerate() {
        for &(b, pb, lb) in &named[i + 1..] {
            // The one overlap allowed: normed written over input, exactly.
            let in_place = a == "input" && b == "normed" && pa == pb;
            if !in_place && overlap(pa, la, pb, lb) {
                return Err(format!(
                    "{what}: {a} and {b} overlap (only normed may equal input, for the in-place form)"
                ));
            }
        }
    }
    if let (Some(threads), Some(row_packs)) = (opts.threads, shape.row_packs()) {
        check_threads(threads, row_packs).map_err(|e| format!("{what}: {e}"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every extent accepted (pure checks only).
    fn any_extent(_: &str, _: u64, _: u64) -> Result<(), String> {
        Ok(())
    }

    fn shape(rows: usize, hidden: usize, dtype: DType) -> EpilogueShape {
        EpilogueShape { rows, hidden, dtype, norm: true }
    }

    #[test]
    fn calls_are_checked_before_any_device_work() {
        let s = shape(3, 7168, DType::Bf16);
        let bytes = 43_008u64;
        let p = EpiloguePointers { input: 0x10_0000, residual: 0x20_0000, weight: 0x30_0000, normed: 0x40_0000 };
        let o = FusedOptions::default();
        assert_eq!(check_call("f", &p, &s, 1e-6, &o, &any_extent), Ok(()));
        // In place: normed == input.
        assert_eq!(check_call("f", &EpiloguePointers { normed: p.input, ..p }, &s, 1e-6, &o, &any_extent), Ok(()));
        let err = |p: EpiloguePointers, s: EpilogueShape, eps: f32, o: FusedOptions| {
            check_call("f", &p, &s, eps, &o, &any_extent).unwrap_err()
        };
        assert!(err(EpiloguePointers { normed: p.input + 2, ..p }, s, 1e-6, o).contains("input and normed overlap"));
        assert!(err(EpiloguePointers { residual: p.input + bytes - 2, ..p }, s, 1e-6, o)
            .contains("input and residual overlap"));
        assert!(
            err(EpiloguePointers { weight: p.residual + 64, ..p }, s, 1e-6, o).contains("residual and weight overlap")
        );
        assert!(err(EpiloguePointers { residual: 0, ..p }, s, 1e-6, o).contains("residual is a null"));
        assert!(err(EpiloguePointers { weight: p.weight + 1, ..p }, s, 1e-6, o).contains("not aligned to the 2-byte"));
        assert!(err(p, s, f32::NAN, o).contains("eps"));
        assert!(err(p, s, -1.0, o).contains("eps"));
        assert!(err(p, EpilogueShape { hidden: 0, ..s }, 1e-6, o).contains("hidden must be at least 1"));
        assert!(err(p, EpilogueShape { rows: usize::MAX / 2, ..s }, 1e-6, o).contains("32 bits"));
        assert!(err(p, s, 1e-6, FusedOptions { threads: Some(96), ..o }).contains("at least 224"));
        // Without RMSNorm, weight and normed are not looked at (eps neither).
        let add = EpilogueShape { norm: false, ..s };
        assert_eq!(
            check_call("f", &EpiloguePointers { weight: 0, normed: 0, ..p }, &add, f32::NAN, &o, &any_extent),
            Ok(())
        );
        // Buffers that only touch end to end do not overlap.
        assert_eq!(
            check_call("f", &EpiloguePointers { residual: p.input + bytes, ..p }, &s, 1e-6, &o, &any_extent),
            Ok(())
        );
    }

    /// A count too large for the buffers is named as such, not as the
    /// overlap it makes of the adjacent allocations (seen on the H200:
    /// `rows + 1` reported "input and residual overlap").
    #[test]
    fn extents_are_checked_before_overlaps() {
        let s = shape(3, 1024, DType::Bf16);
        let p = EpiloguePointers { input: 0x10_0000, residual: 0x10_1800, weight: 0x30_0000, normed: 0x40_0000 };
        let allocations = |name: &str, ptr: u64, bytes: u64| {
            let holds = 0x1800; // 3 x 1024 bf16
            if bytes > holds {
                Err(format!("{name} holds {holds} bytes from {ptr:#x}, but the call needs {bytes}"))
            } else {
                Ok(())
            }
        };
        let o = FusedOptions::default();
        assert_eq!(check_call("f", &p, &s, 1e-6, &o, &allocations), Ok(()));
        let more_rows = check_call("f", &p, &shape(4, 1024, DType::Bf16), 1e-6, &o, &allocations).unwrap_err();
        assert!(more_rows.contains("input holds 6144 bytes"), "{more_rows}");
    }

    #[test]
    fn collective_buffers_and_their_in_place_forms() {
        let s = buffer_shape(Collective::AllReduce, 8, 1, 4).unwrap();
        assert_eq!((s.send, s.recv), (8, 8));
        assert!(!bad_overlap(0x1000, 0x1000, &s, DType::F32));
        assert!(bad_overlap(0x1004, 0x1000, &s, DType::F32));
        assert!(!bad_overlap(0x1020, 0x1000, &s, DType::F32), "end to end");
        // All-gather: rank 1's share of the output is its input, in place.
        let g = buffer_shape(Collective::AllGather, 8, 1, 4).unwrap();
        assert_eq!((g.send, g.recv), (8, 32));
        assert!(!bad_overlap(0x1000 + 8 * 4, 0x1000, &g, DType::F32));
        assert!(bad_overlap(0x1000, 0x1000, &g, DType::F32));
        // Reduce-scatter: the output at rank 1's share of the input.
        let r = buffer_shape(Collective::ReduceScatter, 8, 1, 4).unwrap();
        assert_eq!((r.send, r.recv), (32, 8));
        assert!(!bad_overlap(0x1000, 0x1000 + 8 * 4, &r, DType::F32));
        assert!(buffer_shape(Collective::AllGather, usize::MAX, 0, 2).is_none());
        let e = check_pointers("all_reduce", (0, 8), Some(s), DType::F32).unwrap_err().to_string();
        assert!(e.contains("all_reduce: null device pointer"), "{e}");
        let e = check_pointers("all_reduce", (8, 6), Some(s), DType::F32).unwrap_err().to_string();
        assert!(e.contains("aligned to the 4-byte element size"), "{e}");
        let huge = BufferShape { send: usize::MAX / 2, recv: usize::MAX / 2, in_place_offset: 0 };
        let e = check_pointers("all_reduce", (8, 8), Some(huge), DType::F32).unwrap_err().to_string();
        assert!(e.contains("count overflows"), "{e}");
    }
}
