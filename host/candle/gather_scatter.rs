//! All-gather and reduce-scatter as candle ops ([`CustomOp1`], out of
//! place), over dimension 0 of a contiguous tensor:
//!
//! * [`AllGather`]: `(n, ...)` on every rank -> `(world x n, ...)`, rank
//!   r's tensor at rows `[r n, (r + 1) n)`;
//! * [`ReduceScatter`]: `(world x m, ...)` -> `(m, ...)` on rank r, the sum
//!   over ranks of rows `[r m, (r + 1) m)`.
//!
//! They run on the tensor's candle stream as [`AllReduce`](super::AllReduce)
//! does (same stream and graph-capture rules; they need no registration).

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, Layout, Shape};

use super::{check_input, on_cpu, to_candle, OpElement};
use crate::comm::Comm;
use crate::Collective;
use crate::DType;

/// The name candle reports for an op's errors.
fn op_name(collective: Collective) -> &'static str {
    match collective {
        Collective::AllGather => "tp-allreduce all_gather",
        _ => "tp-allreduce reduce_scatter",
    }
}

/// The output shape of `collective` over `world` ranks for an input of
/// `shape`, or why there is none (a scalar; a reduce-scatter whose first
/// dimension the world size does not divide).
pub(super) fn output_shape(collective: Collective, shape: &Shape, world: usize) -> Result<Shape, String> {
    let dims = shape.dims();
    let Some(&first) = dims.first() else {
        return Err("a scalar has no dimension 0 to gather or scatter over".into());
    };
    let mut out = dims.to_vec();
    match collective {
        Collective::AllGather => out[0] = first * world,
        _ => {
            if first % world != 0 {
                return Err(format!("dimension 0 ({first}) is not a multiple of the world size ({world})"));
            }
            out[0] = first / world;
        }
    }
    Ok(Shape::from(out))
}

/// One of the two collectives over a [`Comm`], as a candle op.
#[derive(Clone)]
struct GatherScatter {
    comm: Arc<Comm>,
    collective: Collective,
}

impl GatherScatter {
    fn run<T: OpElement>(
        &self,
        storage: &CudaStorage,
        start: usize,
        out_shape: &Shape,
    ) -> candle_core::Result<CudaStorage> {
        let device = storage.device().clone();
        let world = self.comm.world_size();
        let count = match self.collective {
            Collective::AllGather => out_shape.elem_count() / world,
            _ => out_shape.elem_count(),
        };
        let mut out = device.alloc_zeros::<T>(out_shape.elem_count().max(1))?;
        self.comm
            .gather_scatter_slices_on(
                self.collective,
                (storage.as_cuda_slice::<T>()?, start),
                (&mut out, 0),
                count,
                &device.cuda_stream(),
            )
            .map_err(to_candle)?;
        Ok(CudaStorage::wrap_cuda_slice(out, device))
    }
}

impl CustomOp1 for GatherScatter {
    fn name(&self) -> &'static str {
        op_name(self.collective)
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        Err(on_cpu(op_name(self.collective)))
    }

    fn cuda_fwd(&self, storage: &CudaStorage, layout: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let op = op_name(self.collective);
        let (dtype, start, _count) = check_input(op, storage.dtype(), layout)?;
        let shape = output_shape(self.collective, layout.shape(), self.comm.world_size())
            .map_err(|why| candle_core::Error::Msg(format!("{op}: {why}")).bt())?;
        let out = match dtype {
            DType::F32 => self.run::<f32>(storage, start, &shape)?,
            DType::F16 => self.run::<half::f16>(storage, start, &shape)?,
            DType::Bf16 => self.run::<half::bf16>(storage, start, &shape)?,
        };
        Ok((out, shape))
    }
}

/// All-gather over dimension 0 (see the module docs).
///
/// ```ignore
/// let gather = AllGather::new(comm.clone());
/// let all = gather.all_gather(&x)?;   // (world * n, ...) from (n, ...)
/// ```
#[derive(Clone)]
pub struct AllGather(GatherScatter);

impl AllGather {
    pub fn new(comm: Arc<Comm>) -> Self {
        AllGather(GatherScatter { comm, collective: Collective::AllGather })
    }

    pub fn all_gather(&self, xs: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
        xs.apply_op1_no_bwd(&self.0)
    }
}

/// Reduce-scatter (sum) over dimension 0 (see the module docs).
///
/// ```ignore
/// let scatter = ReduceScatter::new(comm.clone());
/// let mine = scatter.reduce_scatter(&x)?;   // (m, ...) from (world * m, ...)
/// ```
#[derive(Clone)]
pub struct ReduceScatter(GatherScatter);

impl ReduceScatter {
    pub fn new(comm: Arc<Comm>) -> Self {
        ReduceScatter(GatherScatter { comm, collective: Collective::ReduceScatter })
    }

    pub fn reduce_scatter(&self, xs: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
        xs.apply_op1_no_bwd(&self.0)
    }
}

impl std::fmt::Debug for AllGather {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AllGather")
    }
}

impl std::fmt::Debug for ReduceScatter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ReduceScatter")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_shapes_over_dimension_zero() {
        let s = |d: &[usize]| Shape::from(d.to_vec());
        assert_eq!(output_shape(Collective::AllGather, &s(&[3, 7168]), 4).unwrap(), s(&[12, 7168]));
        assert_eq!(output_shape(Collective::AllGather, &s(&[5]), 2).unwrap(), s(&[10]));
        assert_eq!(output_shape(Collective::ReduceScatter, &s(&[12, 7168]), 4).unwrap(), s(&[3, 7168]));
        let e = output_shape(Collective::ReduceScatter, &s(&[10, 3]), 4).unwrap_err();
        assert!(e.contains("not a multiple of the world size"), "{e}");
        assert!(output_shape(Collective::AllGather, &s(&[]), 2).is_err());
    }
}
