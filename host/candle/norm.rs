//! The transformer layer's epilogue after a row-parallel projection:
//! allreduce, residual add, RMSNorm.

#![forbid(unsafe_code)]

use std::sync::Arc;

use candle_core::{DType, Tensor, D};

use super::AllReduce;
use crate::comm::Comm;

/// `residual += allreduce(x)`, then returns `RMSNorm(residual) * weight`
/// (Gemma-style `(1 + weight)` with [`with_unit_offset`](Self::with_unit_offset)).
///
/// **Not fused yet.** The library has the fused kernel
/// (`Comm::all_reduce_add_rms_norm`, allreduce, add and norm in one pass),
/// but this op does not call it yet: it needs two outputs written in place
/// (the residual and the normed tensor), which candle's custom-op traits do
/// not offer without unsafe storage access. Until then this is the unfused
/// composition an engine runs today, with the same API, so code written
/// against it gets the fused kernel by upgrading:
///
/// 1. `sum = allreduce(x)` with [`AllReduce`] (out of place, `x` untouched;
///    the sum is accumulated in f32 and rounded once to the dtype);
/// 2. `residual = residual + sum`, computed by candle in the dtype (one
///    more rounding), written back into `residual`'s storage;
/// 3. `normed = residual * rsqrt(mean(residual²) + eps) * scale` in f32,
///    rounded once to the dtype, with `scale = weight` or `1 + weight`.
///
/// Shapes: `x` and `residual` are `[.., hidden]` of the same shape and dtype
/// (f32, f16 or bf16), contiguous, on the communicator's device; `weight`
/// is `[hidden]`.
#[derive(Clone, Debug)]
pub struct FusedAddRmsNorm {
    all_reduce: AllReduce,
    /// The weight in f32 (plus one with the unit offset).
    pub(super) scale: Tensor,
    eps: f64,
}

impl FusedAddRmsNorm {
    /// RMSNorm with weight `weight` (`[hidden]`, any float dtype, on the
    /// communicator's device) and `eps` (e.g. 1e-5 or 1e-6).
    pub fn new(comm: Arc<Comm>, weight: &Tensor, eps: f64) -> candle_core::Result<Self> {
        Self::with_all_reduce(AllReduce::new(comm), weight, eps)
    }

    pub(super) fn with_all_reduce(all_reduce: AllReduce, weight: &Tensor, eps: f64) -> candle_core::Result<Self> {
        if weight.rank() != 1 {
            candle_core::bail!("FusedAddRmsNorm: the weight must be a vector [hidden], got shape {:?}", weight.shape());
        }
        if !(eps.is_finite() && eps > 0.0) {
            candle_core::bail!("FusedAddRmsNorm: eps must be finite and positive, got {eps}");
        }
        Ok(FusedAddRmsNorm { all_reduce, scale: weight.to_dtype(DType::F32)?, eps })
    }

    /// Gemma's convention: scales by `1 + weight` (the checkpoints store
    /// the weight minus one).
    pub fn with_unit_offset(self) -> candle_core::Result<Self> {
        let scale = (&self.scale + 1.0)?;
        Ok(FusedAddRmsNorm { scale, ..self })
    }

    /// Hidden size (the weight's length).
    pub fn hidden_size(&self) -> usize {
        self.scale.dims1().unwrap_or(0)
    }

    /// Updates `residual` in place to `residual + allreduce(x)` and returns
    /// the normalised, scaled residual (same shape and dtype as `x`).
    pub fn forward(&self, x: &Tensor, residual: &Tensor) -> candle_core::Result<Tensor> {
        self.check(x, residual)?;
        let sum = self.all_reduce.all_reduce(x)?;
        let updated = (residual + &sum)?;
        residual.slice_set(&updated, 0, 0)?;
        let wide = updated.to_dtype(DType::F32)?;
        let mean_square = wide.sqr()?.mean_keepdim(D::Minus1)?;
        let inv_rms = (mean_square + self.eps)?.sqrt()?.recip()?;
        let normed = wide.broadcast_mul(&inv_rms)?.broadcast_mul(&self.scale)?;
        normed.to_dtype(x.dtype())
    }

    fn check(&self, x: &Tensor, residual: &Tensor) -> candle_core::Result<()> {
        if x.shape() != residual.shape() {
            candle_core::bail!(
                "FusedAddRmsNorm: x {:?} and residual {:?} must have the same shape",
                x.shape(),
                residual.shape()
            );
        }
        if x.dtype() != residual.dtype() {
            candle_core::bail!(
                "FusedAddRmsNorm: x ({:?}) and residual ({:?}) must have the same dtype",
                x.dtype(),
                residual.dtype()
            );
        }
        let hidden = self.hidden_size();
        if x.rank() == 0 || x.dim(D::Minus1)? != hidden {
            candle_core::bail!(
                "FusedAddRmsNorm: the last dimension of x {:?} must be the weight's length {hidden}",
                x.shape()
            );
        }
        if !residual.is_contiguous() {
            return Err(candle_core::Error::RequiresContiguous { op: "FusedAddRmsNorm residual" }.bt());
        }
        Ok(())
    }
}
