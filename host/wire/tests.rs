//! The wire format's encoders against brute-force references, and the
//! emulated two-shot push against the f64 reference and the derived bound.
//! Inputs are fresh per run; the seed is printed (`TP_ALLREDUCE_TEST_SEED`
//! replays it).

use super::*;
use tp_allreduce_kernels::wire::{fp8_decode, fp8_encode, int8_encode, FP8_NAN, INT8_NON_FINITE};

fn seed(test: &str) -> u64 {
    let seed = crate::env::test_seed().unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    println!("{test}: seed {seed} (TP_ALLREDUCE_TEST_SEED={seed} replays it)");
    seed
}

/// The nearest finite e4m3fn code to `y` by search over all 254 finite
/// codes, ties to the code with an even mantissa; saturating.
fn fp8_nearest(y: f32) -> u8 {
    let sign = if y.is_sign_negative() { 0x80 } else { 0 };
    let a = (y as f64).abs();
    let mut best = 0u8;
    let mut best_d = f64::INFINITY;
    for c in 0u8..0x7F {
        let d = (fp8_decode(c) as f64 - a).abs();
        if d < best_d || (d == best_d && c & 1 == 0) {
            best = c;
            best_d = d;
        }
    }
    sign | best
}

#[test]
fn fp8_codes_round_trip_and_decode_to_e4m3fn_values() {
    for c in 0..=255u8 {
        let v = fp8_decode(c);
        if c & 0x7F == FP8_NAN {
            assert!(v.is_nan(), "{c:#x}");
            continue;
        }
        assert_eq!(fp8_encode(v), c, "code {c:#x} value {v}");
    }
    assert_eq!(fp8_decode(0x7E), 448.0);
    assert_eq!(fp8_decode(0x01), 2f32.powi(-9));
    assert_eq!(fp8_decode(0x08), 2f32.powi(-6));
    assert_eq!(fp8_decode(0xC0), -2.0);
}

#[test]
fn fp8_encode_is_nearest_even_and_saturating() {
    let mut rng = Rng::new(seed("fp8_encode_is_nearest_even_and_saturating"));
    for i in 0..200_000 {
        // Magnitudes 2^-12 .. 2^10: subnormals, normals, saturation.
        let y = ((rng.uniform() * 22.0 - 12.0).exp2() * if i % 2 == 0 { 1.0 } else { -1.0 }) as f32;
        assert_eq!(fp8_encode(y), fp8_nearest(y), "y = {y:e}");
    }
    // Exact ties: midpoints between neighbouring codes go to the even code.
    for c in 0u8..0x7E {
        let mid = ((fp8_decode(c) as f64 + fp8_decode(c + 1) as f64) / 2.0) as f32;
        let even = if c & 1 == 0 { c } else { c + 1 };
        assert_eq!(fp8_encode(mid), even, "midpoint of {c:#x}");
    }
    assert_eq!(fp8_encode(1e30), 0x7E);
    assert_eq!(fp8_encode(-465.0), 0xFE);
    assert_eq!(fp8_encode(f32::INFINITY) & 0x7F, FP8_NAN);
    assert_eq!(fp8_encode(f32::NAN) & 0x7F, FP8_NAN);
    assert_eq!(fp8_encode(-0.0), 0x80);
}

#[test]
fn int8_encode_is_nearest_even_and_clamped() {
    let mut rng = Rng::new(seed("int8_encode_is_nearest_even_and_clamped"));
    for _ in 0..200_000 {
        let y = ((rng.uniform() - 0.5) * 300.0) as f32;
        let want = (y as f64).round_ties_even().clamp(-127.0, 127.0) as i8;
        assert_eq!(int8_encode(y), want, "y = {y}");
    }
    for (y, want) in [(0.5f32, 0i8), (1.5, 2), (2.5, 2), (-2.5, -2), (126.5, 126), (1e9, 127), (-1e9, -127)] {
        assert_eq!(int8_encode(y), want, "y = {y}");
    }
    assert_eq!(int8_encode(f32::NAN), INT8_NON_FINITE);
    assert_eq!(int8_encode(f32::NEG_INFINITY), INT8_NON_FINITE);
}

/// Prime counts, and counts around the share and group boundaries.
const COUNTS: [usize; 6] = [1, 31, 97, 1009, 4099, 12289];

fn check(format: WireFormat, dtype: DType, inputs: &[Vec<f32>], what: &str) -> Accuracy {
    let outputs = two_shot_push(format, dtype, inputs);
    let exact = reference_sum(inputs);
    let bound = error_bound(format, dtype, inputs);
    for (r, o) in outputs.iter().enumerate() {
        let same = o.iter().zip(&outputs[0]).all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{what}: rank {r}'s output differs from rank 0's");
    }
    for (i, ((&o, &s), &b)) in outputs[0].iter().zip(&exact).zip(&bound).enumerate() {
        let err = (o as f64 - s).abs();
        assert!(err <= b, "{what}: element {i}: out {o:e}, exact {s:e}, error {err:e} > bound {b:e}");
    }
    measure(format, dtype, inputs)
}

#[test]
fn emulated_two_shot_push_stays_within_the_bound_on_every_world_dtype_and_count() {
    let mut rng = Rng::new(seed("emulated_two_shot_push_stays_within_the_bound"));
    for world in 2..=8 {
        for dtype in DType::ALL {
            for &count in &COUNTS {
                for format in [WireFormat::Lossless, WireFormat::Fp8E4m3, WireFormat::Int8] {
                    for dist in Distribution::ALL {
                        // Outlier rows need rows of a hidden size holding the channels.
                        let (rows, hidden) =
                            if dist == Distribution::OutlierRows { (count.div_ceil(3001), 3001) } else { (1, count) };
                        let inputs = dist.inputs(&mut rng, world, rows, hidden, dtype);
                        let what = format!("{} {} world {world} count {} {}", format.name(), dtype.name(), rows * hidden, dist.name());
                        let acc = check(format, dtype, &inputs, &what);
                        if format.is_lossy() && count >= 97 {
                            // The wire must actually lose something (else the
                            // emulation skipped the quantisation).
                            assert!(acc.max_rel > 1e-4, "{what}: no quantisation error at all ({acc:?})");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn the_fp8_bound_is_tight_within_a_factor_of_ten() {
    // A bound that is never approached would let a worse encoder pass.
    let mut rng = Rng::new(seed("the_fp8_bound_is_tight_within_a_factor_of_ten"));
    let inputs = Distribution::Gaussian.inputs(&mut rng, 8, 1, 1 << 16, DType::F32);
    let out = two_shot_push(WireFormat::Fp8E4m3, DType::F32, &inputs);
    let exact = reference_sum(&inputs);
    let bound = error_bound(WireFormat::Fp8E4m3, DType::F32, &inputs);
    let worst = out[0].iter().zip(&exact).zip(&bound).map(|((&o, &s), &b)| (o as f64 - s).abs() / b).fold(0.0, f64::max);
    assert!(worst > 0.1 && worst <= 1.0, "largest error / bound = {worst}");
}

#[test]
fn zeros_constant_rows_and_outlier_rows() {
    let mut rng = Rng::new(seed("zeros_constant_rows_and_outlier_rows"));
    for format in [WireFormat::Fp8E4m3, WireFormat::Int8] {
        for world in [2, 3, 8] {
            // Zeros: exactly zero out.
            let zeros = vec![vec![0f32; 1009]; world];
            let out = two_shot_push(format, DType::Bf16, &zeros);
            assert!(out.iter().flatten().all(|&x| x == 0.0));
            // Constant rows: every value of a group equals its amax, which
            // maps to the code maximum: exact for both formats.
            let c = (rng.uniform() * 10.0 + 0.5) as f32;
            let constant = vec![vec![half::bf16::from_f32(c).to_f32(); 4099]; world];
            let out = two_shot_push(format, DType::F32, &constant);
            let want = constant[0][0] as f64 * world as f64;
            let rel = out[0].iter().map(|&o| (o as f64 - want).abs() / want).fold(0.0, f64::max);
            assert!(rel < 1e-5, "{} world {world}: constant rows off by {rel:e}", format.name());
            // Outlier rows: within the bound (checked by `check`), and the
            // outlier channels themselves keep fp8/int8 relative accuracy.
            let inputs = Distribution::OutlierRows.inputs(&mut rng, world, 4, 4096, DType::Bf16);
            check(format, DType::Bf16, &inputs, &format!("{} outliers world {world}", format.name()));
        }
    }
}

#[test]
fn negative_zero_nan_and_inf_follow_the_documented_rule() {
    let mut rng = Rng::new(seed("negative_zero_nan_and_inf_follow_the_documented_rule"));
    let world = 4;
    let count = 257;
    // -0 everywhere: fp8 keeps the sign of zero, int8 gives +0.
    let neg = vec![vec![-0.0f32; count]; world];
    for (format, negative) in [(WireFormat::Fp8E4m3, true), (WireFormat::Int8, false), (WireFormat::Lossless, true)] {
        let out = two_shot_push(format, DType::F32, &neg);
        assert!(out.iter().flatten().all(|&x| x == 0.0 && x.is_sign_negative() == negative), "{}", format.name());
    }
    for format in [WireFormat::Fp8E4m3, WireFormat::Int8] {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut inputs = Distribution::Gaussian.inputs(&mut rng, world, 1, count, DType::F32);
            let (r, i) = ((rng.next_u64() % world as u64) as usize, (rng.next_u64() % count as u64) as usize);
            inputs[r][i] = bad;
            let out = two_shot_push(format, DType::F32, &inputs);
            assert!(out.iter().all(|o| o[i].is_nan()), "{} {bad} at rank {r} element {i}: not NaN", format.name());
            // Its neighbours (same group included) stay within the bound of
            // the inputs without the bad element.
            let mut clean = inputs.clone();
            clean[r][i] = 0.0;
            let exact = reference_sum(&clean);
            let bound = error_bound(format, DType::F32, &clean);
            for j in (0..count).filter(|&j| j != i) {
                let err = (out[0][j] as f64 - exact[j]).abs();
                assert!(err <= bound[j], "{} {bad}: neighbour {j} off by {err:e} > {:e}", format.name(), bound[j]);
            }
        }
        // A finite sum past f32::MAX overflows in the accumulator: NaN out.
        let big = vec![vec![3e38f32; 64]; 2];
        let out = two_shot_push(format, DType::F32, &big);
        assert!(out[0].iter().all(|x| x.is_nan()), "{}: overflowed sum not NaN", format.name());
    }
}

#[test]
fn wire_bytes_match_the_layout() {
    use tp_allreduce_kernels::wire::{bytes_per_group, share_wire_bytes};
    assert_eq!(bytes_per_group(WireFormat::Fp8E4m3, 2), 36);
    assert_eq!(bytes_per_group(WireFormat::Lossless, 2), 64);
    assert_eq!(share_wire_bytes(WireFormat::Int8, 32, 2), 36);
    assert_eq!(share_wire_bytes(WireFormat::Int8, 33, 2), 72);
    assert_eq!(share_wire_bytes(WireFormat::Lossless, 33, 2), 66);
    assert_eq!(parse_wire("FP8").unwrap(), WireFormat::Fp8E4m3);
    assert!(parse_wire("fp4").is_err());
}
