//! The f64 reference of the fused epilogue (allreduce + residual add +
//! RMSNorm) and the check of a device result against it, shared by the
//! tests and `bench --fused`.
//!
//! Tolerances follow the rounding a result goes through. The residual:
//! `roundings` roundings to the element type of partial results (1 fused,
//! 2 when an allreduce rounded the sum first) plus the f32 accumulation of
//! the world's terms. The normalised output: the residual's error scaled
//! by `inv_rms * |w|`, the error `inv_rms` inherits from the residual
//! (through the mean of squares) and from the f32 reduction (a tree of at
//! most 64 dependent additions), `sqrt` and the division, then one rounding
//! of the output.
#![forbid(unsafe_code)]

use crate::reference::unit_roundoff;
use tp_allreduce::DType;

/// Unit roundoff of f32.
const F32_U: f64 = 5.960_464_477_539_063e-8;

/// What the epilogue computes, per element, in f64.
#[derive(Clone, Debug, PartialEq)]
pub struct Expected {
    /// `sum over ranks of input + residual`.
    pub residual: Vec<f64>,
    /// The RMSNorm of `residual` scaled by `w` (empty without RMSNorm).
    pub normed: Vec<f64>,
    /// `sum of |terms|` per element (the scale of the rounding error).
    pub magnitude: Vec<f64>,
    /// `1 / rms` per row.
    pub inv_rms: Vec<f64>,
    /// The weight as applied (`w` or `1 + w`).
    pub scale: Vec<f64>,
}

/// The exact epilogue of `inputs` (one `rows x hidden` vector per rank)
/// over `residual`; RMSNorm with `weight` (`hidden` values) when given.
pub fn expected(
    inputs: &[Vec<f64>],
    residual: &[f64],
    weight: Option<&[f64]>,
    hidden: usize,
    eps: f64,
    weight_offset: bool,
) -> Expected {
    let n = residual.len();
    let mut out = Expected {
        residual: vec![0.0; n],
        normed: Vec::new(),
        magnitude: vec![0.0; n],
        inv_rms: Vec::new(),
        scale: Vec::new(),
    };
    for i in 0..n {
        let (mut y, mut m) = (residual[i], residual[i].abs());
        for x in inputs {
            y += x[i];
            m += x[i].abs();
        }
        out.residual[i] = y;
        out.magnitude[i] = m;
    }
    let Some(w) = weight else { return out };
    out.scale = w.iter().map(|&v| if weight_offset { 1.0 + v } else { v }).collect();
    out.normed = vec![0.0; n];
    for (r, row) in out.residual.chunks(hidden).enumerate() {
        let mean = row.iter().map(|y| y * y).sum::<f64>() / hidden as f64;
        let inv = 1.0 / (mean + eps).sqrt();
        out.inv_rms.push(inv);
        for (c, y) in row.iter().enumerate() {
            out.normed[r * hidden + c] = y * inv * out.scale[c];
        }
    }
    out
}

/// Checks a device result (`residual`, and `normed` when RMSNorm ran)
/// against `e`. `roundings`: roundings of partial results of the residual
/// (1 fused, 2 unfused); `world`: terms summed in f32. The error names the
/// first wrong element and how many are wrong.
pub fn check(
    dtype: DType,
    e: &Expected,
    residual: &[f64],
    normed: Option<&[f64]>,
    hidden: usize,
    roundings: usize,
    world: usize,
) -> Result<(), String> {
    let n = e.residual.len();
    if residual.len() != n || normed.is_some_and(|v| v.len() != n) || hidden == 0 || n % hidden != 0 {
        return Err(format!(
            "result of {} / {:?} elements for an expected {n} (rows of {hidden})",
            residual.len(),
            normed.map(<[f64]>::len)
        ));
    }
    let u = unit_roundoff(dtype);
    let tol_res = |i: usize| -> f64 {
        let m = e.magnitude[i];
        roundings as f64 * u * m * 1.001 + (world + 1) as f64 * F32_U * m + 1e-30
    };
    let mut bad = Bad::default();
    for (i, (&got, &want)) in residual.iter().zip(&e.residual).enumerate() {
        bad.check("residual", i, got, want, tol_res(i));
    }
    if let Some(normed) = normed {
        for (r, row) in e.residual.chunks(hidden).enumerate() {
            // Relative error of the mean of squares, then of inv_rms.
            let (mut dev, mut sq) = (0.0, 0.0);
            for (c, y) in row.iter().enumerate() {
                dev += 2.0 * y.abs() * tol_res(r * hidden + c);
                sq += y * y;
            }
            let inv = e.inv_rms[r];
            let rel_inv = 0.5 * (dev / sq.max(1e-300) + 64.0 * F32_U) + 4.0 * F32_U;
            for (c, y) in row.iter().enumerate() {
                let i = r * hidden + c;
                let want = e.normed[i];
                let scale = e.scale[c].abs() * inv;
                let tol =
                    1.5 * (scale * (tol_res(i) + y.abs() * rel_inv) + (u * 1.001 + 4.0 * F32_U) * want.abs()) + 1e-30;
                bad.check("normed", i, normed[i], want, tol);
            }
        }
    }
    bad.verdict()
}

/// Wrong elements seen so far.
#[derive(Default)]
struct Bad {
    count: usize,
    first: Option<String>,
}

impl Bad {
    fn check(&mut self, what: &str, i: usize, got: f64, want: f64, tol: f64) {
        let error = (got - want).abs();
        if error.is_nan() || error > tol {
            self.count += 1;
            if self.first.is_none() {
                self.first = Some(format!("{what}[{i}] is {got:e}, expected {want:e} (tolerance {tol:e})"));
            }
        }
    }

    fn verdict(self) -> Result<(), String> {
        match self.first {
            None => Ok(()),
            Some(first) => Err(format!("{} wrong elements; first: {first}", self.count)),
        }
    }
}

/// A `rows x hidden` reference of what the device computes, rounding like
/// it (f32 accumulation in rank order, one rounding per output, the
/// residual normalised after rounding): for the tests of the check itself.
pub fn simulate_device(
    dtype: DType,
    inputs: &[Vec<f64>],
    residual: &[f64],
    weight: &[f64],
    hidden: usize,
    eps: f32,
    weight_offset: bool,
) -> (Vec<f64>, Vec<f64>) {
    let round = |v: f32| -> f64 {
        match dtype {
            DType::F32 => v as f64,
            DType::F16 => half::f16::from_f32(v).to_f64(),
            DType::Bf16 => half::bf16::from_f32(v).to_f64(),
        }
    };
    let res: Vec<f64> = (0..residual.len())
        .map(|i| {
            let mut acc = -0.0f32;
            for x in inputs {
                acc += x[i] as f32;
            }
            round(acc + residual[i] as f32)
        })
        .collect();
    let mut normed = vec![0.0; res.len()];
    for (r, row) in res.chunks(hidden).enumerate() {
        let sum: f32 = row.iter().map(|&x| (x as f32) * (x as f32)).sum();
        let inv = 1.0 / (sum / hidden as f32 + eps).sqrt();
        for (c, &x) in row.iter().enumerate() {
            let w = weight[c] as f32;
            let scale = if weight_offset { 1.0 + w } else { w };
            normed[r * hidden + c] = round(x as f32 * inv * scale);
        }
    }
    (res, normed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::random_bits;

    fn case(dtype: DType, world: usize, rows: usize, hidden: usize) -> (Vec<Vec<f64>>, Vec<f64>, Vec<f64>) {
        let n = rows * hidden;
        let inputs = (0..world).map(|r| random_bits(dtype, n, 11 + r as u64).1).collect();
        let residual = random_bits(dtype, n, 7).1;
        let weight = random_bits(dtype, hidden, 5).1;
        (inputs, residual, weight)
    }

    #[test]
    fn the_reference_is_sum_plus_residual_then_rms_norm() {
        // Two ranks, one row of 4: hand-computed.
        let inputs = vec![vec![1.0, 2.0, 3.0, 4.0], vec![1.0, -2.0, 1.0, 0.0]];
        let residual = vec![0.0, 0.0, 0.0, 0.0];
        let weight = vec![1.0, 2.0, 0.5, -1.0];
        let e = expected(&inputs, &residual, Some(&weight), 4, 0.0, false);
        assert_eq!(e.residual, [2.0, 0.0, 4.0, 4.0]);
        let inv = 1.0 / (36.0f64 / 4.0).sqrt(); // mean of squares 9 -> 1/3
        assert_eq!(e.inv_rms, [inv]);
        assert_eq!(e.normed, [2.0 * inv, 0.0, 4.0 * inv * 0.5, -4.0 * inv]);
        // Gemma's offset scales by 1 + w.
        let g = expected(&inputs, &residual, Some(&weight), 4, 0.0, true);
        assert_eq!(g.normed[1], 0.0);
        assert_eq!(g.normed[0], 2.0 * inv * 2.0);
        // Without RMSNorm only the residual is computed.
        assert!(expected(&inputs, &residual, None, 4, 1e-6, false).normed.is_empty());
    }

    #[test]
    fn a_device_like_result_passes_for_every_dtype_and_a_wrong_one_fails() {
        for dtype in DType::ALL {
            for (world, rows, hidden) in [(2, 3, 7168), (8, 7, 128), (3, 1, 16384)] {
                let (inputs, residual, weight) = case(dtype, world, rows, hidden);
                for offset in [false, true] {
                    let e = expected(&inputs, &residual, Some(&weight), hidden, 1e-6, offset);
                    let (res, normed) = simulate_device(dtype, &inputs, &residual, &weight, hidden, 1e-6, offset);
                    check(dtype, &e, &res, Some(&normed), hidden, 1, world)
                        .unwrap_or_else(|m| panic!("{dtype:?} world {world} {rows}x{hidden}: {m}"));
                    let mut wrong = normed.clone();
                    wrong[hidden / 2] += 0.05 * (1.0 + wrong[hidden / 2].abs());
                    let m = check(dtype, &e, &res, Some(&wrong), hidden, 1, world).unwrap_err();
                    assert!(m.starts_with("1 wrong elements") && m.contains("normed"), "{m}");
                    let mut poisoned = res.clone();
                    poisoned[0] = f64::NAN;
                    assert!(check(dtype, &e, &poisoned, Some(&normed), hidden, 1, world).is_err());
                }
            }
        }
    }

    #[test]
    fn the_tolerance_is_tight_enough_to_see_a_missing_term() {
        // Leaving one rank's input out of the sum must fail, in every dtype.
        for dtype in DType::ALL {
            let (inputs, residual, weight) = case(dtype, 4, 2, 4096);
            let e = expected(&inputs, &residual, Some(&weight), 4096, 1e-6, false);
            let (res, normed) = simulate_device(dtype, &inputs[..3], &residual, &weight, 4096, 1e-6, false);
            assert!(check(dtype, &e, &res, Some(&normed), 4096, 2, 4).is_err(), "{dtype:?}");
            // The residual alone (no rms norm) is checked too.
            assert!(check(dtype, &e, &res, None, 4096, 2, 4).is_err(), "{dtype:?}");
        }
    }
}
