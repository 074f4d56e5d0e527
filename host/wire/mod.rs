//! The compressed wire (issue 38) on the CPU: an emulation of two-shot push
//! over a lossy wire, exactly as a kernel would compute it (f32
//! accumulation, rank order fixed, the format's functions from
//! `tp_allreduce_kernels::wire`), an f64 reference, the error bound derived
//! in the format's module docs, and the accuracy report `tp-allreduce plan
//! --wire` prints.
//!
//! **No kernel implements the compressed wire yet**: a lossy
//! `Config::wire` is refused (`Error::Unsupported`), and every accuracy
//! figure from here is "emulated on the CPU".
#![forbid(unsafe_code)]

use tp_allreduce_kernels::ids::DType;
use tp_allreduce_kernels::partition::{elems_per_pack, packs_for};
use tp_allreduce_kernels::shares::share_packs;
pub use tp_allreduce_kernels::wire::{
    dequantise_group, quantise_group, WireFormat, FLUSH_AMAX, GROUP,
};

#[cfg(test)]
mod tests;

/// Parses a wire name (`lossless`, `fp8`, `int8`).
pub fn parse_wire(text: &str) -> Result<WireFormat, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "lossless" => Ok(WireFormat::Lossless),
        "fp8" | "fp8-e4m3" | "e4m3" => Ok(WireFormat::Fp8E4m3),
        "int8" => Ok(WireFormat::Int8),
        other => Err(format!("unknown wire format `{other}`: expected lossless, fp8 or int8")),
    }
}

/// The element range `[start, end)` of share `k` of a two-shot push over
/// `count` elements of `dtype` and `world` ranks: shares are whole packs,
/// as in the kernels (`shares::share_packs`).
pub fn share_range(count: usize, dtype: DType, world: usize, k: usize) -> (usize, usize) {
    let per_pack = elems_per_pack(dtype) as u64;
    let sh = share_packs(packs_for(count as u64, dtype), world as u32);
    let start = (k as u64 * sh * per_pack).min(count as u64) as usize;
    let end = ((k as u64 + 1) * sh * per_pack).min(count as u64) as usize;
    (start, end)
}

/// Rounds an f32 to the output dtype (as the kernel's store does) and back.
pub fn round_to(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F32 => x,
        DType::F16 => half::f16::from_f32(x).to_f32(),
        DType::Bf16 => half::bf16::from_f32(x).to_f32(),
    }
}

/// One message on the wire: the codes and scales of a range of elements,
/// in groups of [`GROUP`] from the range's start.
struct Message {
    codes: Vec<u8>,
    scales: Vec<f32>,
}

fn encode(format: WireFormat, xs: &[f32]) -> Message {
    let mut codes = vec![0u8; xs.len()];
    let scales = xs.chunks(GROUP).zip(codes.chunks_mut(GROUP)).map(|(g, c)| quantise_group(format, g, c)).collect();
    Message { codes, scales }
}

fn decode(format: WireFormat, m: &Message) -> Vec<f32> {
    let mut out = vec![0f32; m.codes.len()];
    for ((c, &s), o) in m.codes.chunks(GROUP).zip(&m.scales).zip(out.chunks_mut(GROUP)) {
        dequantise_group(format, c, s, o);
    }
    out
}

/// Two-shot push over `format`, emulated: `inputs[r]` is rank `r`'s input
/// (values of `dtype`, widened to f32); returns every rank's output (values
/// of `dtype`, as f32). Reduce-scatter: every rank but the owner sends its
/// share encoded; the owner uses its own input as is and sums
/// `v_0 + v_1 + ... + v_{N-1}` in f32. All-gather: the owner encodes the
/// sum once; every rank, the owner too, decodes that message, so all
/// outputs are the same bits. Lossless: the same with values unchanged.
pub fn two_shot_push(format: WireFormat, dtype: DType, inputs: &[Vec<f32>]) -> Vec<Vec<f32>> {
    let world = inputs.len();
    let count = inputs.first().map_or(0, Vec::len);
    let mut outputs = vec![vec![0f32; count]; world];
    for owner in 0..world {
        let (start, end) = share_range(count, dtype, world, owner);
        if start == end {
            continue;
        }
        // Reduce-scatter: what the owner holds of each rank's share.
        let received: Vec<Vec<f32>> = (0..world)
            .map(|r| {
                let share = &inputs[r][start..end];
                if r == owner || !format.is_lossy() {
                    share.to_vec()
                } else {
                    decode(format, &encode(format, share))
                }
            })
            .collect();
        let mut acc = received[0].clone();
        for v in &received[1..] {
            for (a, &x) in acc.iter_mut().zip(v) {
                *a += x;
            }
        }
        // All-gather: one message from the owner, decoded by every rank.
        let message = format.is_lossy().then(|| encode(format, &acc));
        for out in outputs.iter_mut() {
            let reduced = message.as_ref().map_or_else(|| acc.clone(), |m| decode(format, m));
            for (o, x) in out[start..end].iter_mut().zip(reduced) {
                *o = round_to(dtype, x);
            }
        }
    }
    outputs
}

/// The f64 reference: `sum_r inputs[r][i]` in f64.
pub fn reference_sum(inputs: &[Vec<f32>]) -> Vec<f64> {
    let count = inputs.first().map_or(0, Vec::len);
    (0..count).map(|i| inputs.iter().map(|x| x[i] as f64).sum()).collect()
}

/// The output dtype's unit roundoff (half an ulp, relative).
pub fn unit_roundoff(dtype: DType) -> f64 {
    match dtype {
        DType::F32 => 2f64.powi(-24),
        DType::F16 => 2f64.powi(-11),
        DType::Bf16 => 2f64.powi(-8),
    }
}

/// Half the output dtype's subnormal spacing: the absolute error of
/// rounding a tiny value to it.
pub fn subnormal_floor(dtype: DType) -> f64 {
    match dtype {
        DType::F16 => 2f64.powi(-25),
        DType::F32 | DType::Bf16 => 2f64.powi(-150),
    }
}

/// The bound `B(x, A)` of one quantisation of `x` in a group of largest
/// finite magnitude `amax` (format module docs).
pub fn quantisation_bound(format: WireFormat, x: f64, amax: f64) -> f64 {
    let flush = FLUSH_AMAX as f64;
    let slack = 2f64.powi(-22) * amax + flush;
    match format {
        WireFormat::Lossless => 0.0,
        WireFormat::Fp8E4m3 => x.abs() / 16.0 + 2f64.powi(-10) * amax / 448.0 + slack,
        WireFormat::Int8 => amax / 254.0 + slack,
    }
}

/// Per-element bound on `|output - reference|` for finite inputs whose f32
/// partial sums do not overflow (derivation: `tp_allreduce_kernels::wire`).
pub fn error_bound(format: WireFormat, dtype: DType, inputs: &[Vec<f32>]) -> Vec<f64> {
    let world = inputs.len();
    let count = inputs.first().map_or(0, Vec::len);
    let exact = reference_sum(inputs);
    let u = 2f64.powi(-24);
    let k = world.saturating_sub(1) as f64;
    let gamma = k * u / (1.0 - k * u);
    let mut bound = vec![0f64; count];
    for owner in 0..world {
        let (start, end) = share_range(count, dtype, world, owner);
        let mut e1 = vec![0f64; end - start];
        for (gs, e1g) in (start..end).step_by(GROUP).zip(e1.chunks_mut(GROUP)) {
            let ge = (gs + GROUP).min(end);
            let amax: Vec<f64> = inputs.iter().map(|x| x[gs..ge].iter().map(|v| v.abs() as f64).fold(0.0, f64::max)).collect();
            for (j, e) in e1g.iter_mut().enumerate() {
                let i = gs + j;
                let mut rs = 0.0;
                let mut mag = 0.0;
                for (r, x) in inputs.iter().enumerate() {
                    let b = quantisation_bound(format, x[i] as f64, amax[r]);
                    if r != owner {
                        rs += b;
                    }
                    mag += (x[i] as f64).abs() + b;
                }
                *e = rs + gamma * mag;
            }
        }
        for (gs, e1g) in (start..end).step_by(GROUP).zip(e1.chunks(GROUP)) {
            let ge = (gs + GROUP).min(end);
            let acc_amax = (gs..ge).zip(e1g).map(|(i, e)| exact[i].abs() + e).fold(0.0, f64::max);
            for (i, &e) in (gs..ge).zip(e1g) {
                let ag = if format.is_lossy() { quantisation_bound(format, exact[i].abs() + e, acc_amax) } else { 0.0 };
                let before = e + ag;
                bound[i] = before + unit_roundoff(dtype) * (exact[i].abs() + before) + subnormal_floor(dtype);
            }
        }
    }
    bound
}

/// A small deterministic generator (SplitMix64) for the report and the
/// tests: the same seed gives the same inputs on every machine.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1).
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let (a, b) = (self.uniform(), self.uniform());
        (-2.0 * a.ln()).sqrt() * (2.0 * std::f64::consts::PI * b).cos()
    }
    /// Laplace of scale 1/sqrt(2) (unit variance).
    pub fn laplace(&mut self) -> f64 {
        let u = self.uniform() - 0.5;
        -u.signum() * (1.0 - 2.0 * u.abs()).ln() / std::f64::consts::SQRT_2
    }
    /// Student-t with 3 degrees of freedom.
    pub fn student_t3(&mut self) -> f64 {
        let chi2: f64 = (0..3).map(|_| self.normal().powi(2)).sum();
        self.normal() / (chi2 / 3.0).sqrt()
    }
}

/// Activation-like inputs of the accuracy report.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Distribution {
    Gaussian,
    Laplace,
    StudentT3,
    /// Gaussian rows whose [`OUTLIER_CHANNELS`] channels (the same on
    /// every row and rank, as outlier features are) are 100x larger.
    OutlierRows,
}

/// Channels of [`Distribution::OutlierRows`] scaled 100x.
pub const OUTLIER_CHANNELS: [usize; 4] = [7, 300, 1234, 2900];

impl Distribution {
    pub const ALL: [Distribution; 4] =
        [Distribution::Gaussian, Distribution::Laplace, Distribution::StudentT3, Distribution::OutlierRows];

    pub fn name(self) -> &'static str {
        match self {
            Distribution::Gaussian => "gaussian",
            Distribution::Laplace => "laplace",
            Distribution::StudentT3 => "student-t(3)",
            Distribution::OutlierRows => "outlier rows (4 channels 100x)",
        }
    }

    /// `world` inputs of `rows x hidden` values of `dtype` (as f32).
    pub fn inputs(self, rng: &mut Rng, world: usize, rows: usize, hidden: usize, dtype: DType) -> Vec<Vec<f32>> {
        (0..world)
            .map(|_| {
                (0..rows * hidden)
                    .map(|i| {
                        let v = match self {
                            Distribution::Gaussian => rng.normal(),
                            Distribution::Laplace => rng.laplace(),
                            Distribution::StudentT3 => rng.student_t3(),
                            Distribution::OutlierRows => {
                                let x = rng.normal();
                                if OUTLIER_CHANNELS.contains(&(i % hidden)) {
                                    100.0 * x
                                } else {
                                    x
                                }
                            }
                        };
                        round_to(dtype, v as f32)
                    })
                    .collect()
            })
            .collect()
    }
}

/// Errors of one emulated allreduce against the f64 reference.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Accuracy {
    /// Largest / mean of `|out - S| / max(|S|, rms(S))` (elementwise
    /// relative error, against the result's RMS where `|S|` is smaller: sums
    /// that cancel to ~0 are judged on the scale of the result).
    pub max_rel: f64,
    pub mean_rel: f64,
    /// Fraction of elements whose error exceeds [`error_bound`].
    pub beyond_bound: f64,
    /// Whether every rank's output is the same bits.
    pub ranks_identical: bool,
}

/// Runs the emulation on `inputs` and measures it.
pub fn measure(format: WireFormat, dtype: DType, inputs: &[Vec<f32>]) -> Accuracy {
    let outputs = two_shot_push(format, dtype, inputs);
    let exact = reference_sum(inputs);
    let bound = error_bound(format, dtype, inputs);
    let rms = (exact.iter().map(|s| s * s).sum::<f64>() / exact.len().max(1) as f64).sqrt();
    let (mut max_rel, mut sum_rel, mut beyond) = (0f64, 0f64, 0usize);
    for ((&o, &s), &b) in outputs[0].iter().zip(&exact).zip(&bound) {
        let err = (o as f64 - s).abs();
        let rel = if err == 0.0 { 0.0 } else { err / s.abs().max(rms) };
        max_rel = max_rel.max(rel);
        sum_rel += rel;
        if err.is_nan() || err > b {
            beyond += 1;
        }
    }
    let bits = |v: &Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let ranks_identical = outputs.iter().all(|o| bits(o) == bits(&outputs[0]));
    let n = exact.len().max(1) as f64;
    Accuracy { max_rel, mean_rel: sum_rel / n, beyond_bound: beyond as f64 / n, ranks_identical }
}
