//! Fresh inputs and the f64 CPU reference shared by `bench` and
//! `selftest`: pseudo-random values of an element type (bytes and values),
//! decoding of device bytes, and the check of an output against the exact
//! sum with a tolerance of so many roundings.
#![forbid(unsafe_code)]

use tp_allreduce::DType;

/// `n` pseudo-random values in [-1, 1) of `dtype`: their bytes and values.
pub fn random_bits(dtype: DType, n: usize, seed: u64) -> (Vec<u8>, Vec<f64>) {
    let mut next = xorshift(seed);
    let mut bytes = Vec::with_capacity(n * dtype.size_bytes());
    let mut values = Vec::with_capacity(n);
    for _ in 0..n {
        let v = next();
        match dtype {
            DType::F32 => {
                let f = v as f32;
                bytes.extend_from_slice(&f.to_le_bytes());
                values.push(f as f64);
            }
            DType::F16 => {
                let h = half::f16::from_f64(v);
                bytes.extend_from_slice(&h.to_bits().to_le_bytes());
                values.push(h.to_f64());
            }
            DType::Bf16 => {
                let h = half::bf16::from_f64(v);
                bytes.extend_from_slice(&h.to_bits().to_le_bytes());
                values.push(h.to_f64());
            }
        }
    }
    (bytes, values)
}

/// A small xorshift giving values in [-1, 1): fresh values per rank and
/// size, no dependency. The seed goes through the splitmix64 finalizer
/// first: seeds differing in a few bits (rank, size index) must not give
/// near-equal first values, or a kernel reading another call's stale data
/// could still pass the check.
fn xorshift(seed: u64) -> impl FnMut() -> f64 {
    let mut x = {
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) | 1
    };
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
}

/// Values of raw `dtype` bytes.
pub fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    match dtype {
        DType::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64).collect(),
        DType::F16 => {
            bytes.chunks_exact(2).map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64()).collect()
        }
        DType::Bf16 => {
            bytes.chunks_exact(2).map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64()).collect()
        }
    }
}

/// Half an ulp at 1.0 of `dtype` (tolerances of the correctness checks).
pub fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 2f64.powi(-24),
        DType::F16 => 2f64.powi(-11),
        DType::Bf16 => 2f64.powi(-8),
    }
}

/// Checks `got` against the f64 sum of every rank's `inputs`, allowing
/// `roundings` roundings to `dtype` of partial sums (plus f32
/// accumulation). The first wrong element is the error.
pub fn check_sum(dtype: DType, inputs: &[Vec<f64>], got: &[f64], roundings: usize) -> Result<(), String> {
    let u = unit_roundoff(dtype);
    let world = inputs.len() as f64;
    if let Some(short) = inputs.iter().position(|x| x.len() < got.len()) {
        return Err(format!("rank {short}'s input has fewer than the {} elements checked", got.len()));
    }
    for (i, g) in got.iter().enumerate() {
        let (mut exact, mut magnitude) = (0.0, 0.0);
        for x in inputs {
            exact += x[i];
            magnitude += x[i].abs();
        }
        let tolerance = roundings as f64 * u * magnitude * 1.001 + world * 6e-8 * magnitude + 1e-30;
        let error = (g - exact).abs();
        if error.is_nan() || error > tolerance {
            return Err(format!("element {i} is {g} but the sum is {exact}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_round_trip_through_their_bytes_for_every_dtype() {
        for dtype in DType::ALL {
            let (bytes, values) = random_bits(dtype, 257, 7);
            assert_eq!(bytes.len(), 257 * dtype.size_bytes());
            assert_eq!(decode(dtype, &bytes), values, "{dtype:?}");
            assert!(values.iter().all(|v| (-1.0..1.0).contains(v)), "{dtype:?}");
            // Fresh: not all equal, and another seed gives other values.
            assert!(values.windows(2).any(|w| w[0] != w[1]));
            assert_ne!(random_bits(dtype, 16, 8).1, values[..16]);
        }
    }

    #[test]
    fn the_check_accepts_the_sum_and_rejects_a_wrong_element() {
        let dtype = DType::Bf16;
        let inputs: Vec<Vec<f64>> = (0..4).map(|r| random_bits(dtype, 64, r).1).collect();
        let exact: Vec<f64> = (0..64).map(|i| inputs.iter().map(|x| x[i]).sum()).collect();
        // One rounding to bf16 of the exact sum passes with one rounding allowed.
        let rounded: Vec<f64> = exact.iter().map(|&v| half::bf16::from_f64(v).to_f64()).collect();
        check_sum(dtype, &inputs, &rounded, 1).unwrap();
        let mut wrong = rounded.clone();
        wrong[17] += 0.05;
        assert!(check_sum(dtype, &inputs, &wrong, 1).unwrap_err().starts_with("element 17 "));
        let mut poisoned = rounded;
        poisoned[3] = f64::NAN;
        assert!(check_sum(dtype, &inputs, &poisoned, 8).unwrap_err().starts_with("element 3 "));
        // A single rank's input is not the sum.
        assert!(check_sum(dtype, &inputs, &inputs[0], 8).is_err());
    }

    #[test]
    fn unit_roundoff_is_half_an_ulp_at_one() {
        let next_above_one = half::bf16::from_bits(half::bf16::ONE.to_bits() + 1).to_f64();
        assert_eq!(unit_roundoff(DType::Bf16), (next_above_one - 1.0) / 2.0);
        let next_above_one = half::f16::from_bits(half::f16::ONE.to_bits() + 1).to_f64();
        assert_eq!(unit_roundoff(DType::F16), (next_above_one - 1.0) / 2.0);
        assert_eq!(unit_roundoff(DType::F32), (f32::EPSILON as f64) / 2.0);
    }
}
