//! The compressed wire format (issue 38): an opt-in lossy encoding of the
//! data a push allreduce sends over the links, for bandwidth-bound sizes on
//! PCIe. Pure scalar functions shared by the host (the CPU emulation in
//! `tp_allreduce::wire`, the cost model, tests) and, later, the kernels.
//!
//! **Status: no kernel uses this module yet.** The host refuses a lossy
//! `Config::wire` with `Error::Unsupported`; the accuracy figures in
//! docs/RESULTS.md come from the CPU emulation of the two-shot push wire.
//!
//! # The format
//!
//! A share of `n` elements (of any input dtype, widened exactly to `f32`) is
//! cut into groups of [`GROUP`] = 32 consecutive elements from the share's
//! start (the last group may be shorter). Each group travels as [`GROUP`]
//! one-byte codes and one `f32` scale; in a share's slot the codes of all its
//! groups come first (`ceil(n / GROUP) * GROUP` bytes: 16-byte aligned, so
//! whole-pack stores), then the scales (`4 * ceil(n / GROUP)` bytes).
//!
//! * [`WireFormat::Fp8E4m3`]: `scale = amax / 448` (448 = the largest e4m3fn
//!   value), code = e4m3fn(x / scale), round to nearest even, saturating
//!   at ±448. The e4m3fn encoding (OCP FP8 "E4M3", bias 7, 3 mantissa bits,
//!   subnormals down to 2^-9): no infinities; `0x7F` / `0xFF` are NaN; the
//!   sign of zero is kept.
//! * [`WireFormat::Int8`]: symmetric, `scale = amax / 127`, code =
//!   round_to_nearest_even(x / scale) clamped to ±127. The code -128 is
//!   unused by the format and marks a non-finite element; -0 becomes +0.
//!
//! `amax` is the largest |x| over the group's **finite** elements.
//!
//! ## Why G = 32 and an f32 scale
//! Scale overhead against outlier isolation. One scale per group costs
//! `4 / G` bytes per element: 0.125 at G = 32 (a bf16 message shrinks to
//! 1.125 / 2 = 56 % of its bytes), 0.0625 at G = 64 (53 %), so doubling G
//! saves 3 % of the bytes. What G buys is isolation: an activation row with
//! an outlier channel 100x its neighbours sets its group's scale, and the
//! group's other elements then lose log2(100) ≈ 6.6 bits of resolution
//! (int8 keeps ~0.6 of its 7 bits for them; fp8's exponent absorbs it down
//! to its subnormal range, 2^-9 of the scale). The smaller the group the
//! fewer neighbours share an outlier's scale; 32 elements is also one warp
//! with one element per lane and 32 code bytes = two 16-byte packs, so a
//! kernel's group reduction is one warp shuffle tree.
//!
//! The scale is f32, not f16: an f16 scale underflows for groups whose amax
//! is below ~3e-5 (448 * 2^-24 subnormal floor, with precision loss well
//! before), common in small activations, and adds a rounding of the scale;
//! f32 keeps the scale exact to 2^-24 at 3 % more bytes than f16 at G = 32.
//! (A power-of-two one-byte scale as in the MX formats would save more; it
//! costs up to a factor 2 of the code range. Not chosen: left as an option.)
//!
//! ## Non-finite values (NaN, ±Inf)
//! Decided per element, never per group: a non-finite element is sent as the
//! format's non-finite code (fp8: `0x7F` with the element's sign; int8:
//! -128), which decodes to NaN; the group's scale is computed from its finite
//! elements only, so its neighbours are unaffected. Consequence: an output
//! element that had any non-finite contribution (or whose f32 partial sum
//! overflowed to ±Inf) is **NaN**, where the lossless allreduce would give
//! ±Inf for Inf inputs of one sign. Non-finite stays non-finite; the sign of
//! an infinity is not kept.
//!
//! ## Tiny groups
//! A group whose amax is below [`FLUSH_AMAX`] (= 2^-126 * 448 ≈ 5.3e-36,
//! where the scale would be an f32 subnormal and lose its precision) is
//! sent as zeros with scale 0 (zeros keep their sign in fp8). Such a group
//! contributes at most `FLUSH_AMAX` of absolute error per element.
//!
//! # Error bound of two-shot push over this wire
//! Two-shot push (one island, `N` ranks): reduce-scatter, then all-gather.
//! Element `i` of the share owned by rank `o`:
//!
//! 1. reduce-scatter: each rank `r != o` quantises its contribution `x_r`
//!    once and sends it; `o` reads its own `x_o` locally, **not quantised**.
//!    `o` sums `acc = v_0; acc += v_r` for `r = 1 .. N-1` in rank order in
//!    f32 (`v_r = dequantise(quantise(x_r))`, `v_o = x_o`): one sum order on
//!    every rank and every size.
//! 2. all-gather: `o` quantises `acc` once (its own groups over its share)
//!    and sends it; **every rank, `o` included, outputs
//!    `dequantise(quantise(acc))`**, so outputs are bitwise identical across
//!    ranks; then the output is rounded to the output dtype.
//!
//! So a value passes through at most two quantisations: its own (if it
//! crosses the wire) and the reduced sum's.
//!
//! Per quantisation of `x` in a group of amax `A` (finite, `A >= FLUSH_AMAX`),
//! `s = A / Q` with `Q` = 448 or 127, `y = x / s`:
//!
//! * fp8: e4m3fn spacing is `2^(e-3)` for `|y|` in `[2^e, 2^(e+1))`, `e >= -6`,
//!   and `2^-9` below `2^-6`; rounding to nearest costs at most half of it:
//!   `|q(y) - y| <= max(2^-4 |y|, 2^-10)`. Saturation clips only the f32
//!   rounding excess of `A / s` over 448. Multiplying back by `s` and the
//!   two f32 operations (`x / s`, `q * s`, each `<= 2^-24` relative):
//!   `|e_q(x)| <= 2^-4 |x| + 2^-10 s + 2^-22 A` (the last term covers the
//!   f32 roundings and saturation with room to spare).
//! * int8: `|round(y) - y| <= 1/2`, so `|e_q(x)| <= s / 2 + 2^-22 A = A / 254 + 2^-22 A`.
//!
//! Call that bound `B(x, A)`. The f32 sum of `N` terms in a fixed order
//! errs by at most `gamma_{N-1} * sum |v_r|` with `gamma_k = k u / (1 - k u)`,
//! `u = 2^-24`. Writing `S = sum_r x_r` (exact), `A_r` = amax of rank `r`'s
//! group holding `i`, and
//!
//! ```text
//!   E_rs  = sum_{r != o} B(x_r, A_r)
//!   E_acc = gamma_{N-1} * sum_r (|x_r| + B(x_r, A_r))
//!   |acc - S| <= E_rs + E_acc =: E_1
//!   E_ag  = B(acc, A_acc)  with  |acc| <= |S| + E_1,
//!           A_acc <= max over the group of (|S| + E_1)
//!   |dequantise(quantise(acc)) - S| <= E_1 + E_ag
//! ```
//!
//! and the output rounding to the dtype adds `u_out (|S| + E_1 + E_ag)`
//! (`u_out` = 2^-24 f32, 2^-11 f16, 2^-8 bf16; f16 outputs assume no
//! overflow past 65504), plus `FLUSH_AMAX` per quantisation for flushed
//! groups. In words, for fp8: each element is off by at most 1/16 of each
//! other rank's contribution, plus 1/16 of the result, plus 2^-10/448 of
//! each group's amax (the subnormal floor); for int8 the error is absolute,
//! 1/254 of the amax of each group it went through (N-1 contributions and
//! the reduced share). `tp_allreduce::wire::error_bound` computes this
//! bound in f64 and the emulation tests hold every element to it.

/// Elements per group (one scale each). See the module docs for the choice.
pub const GROUP: usize = 32;

/// Bytes of one group's scale (an `f32`).
pub const SCALE_BYTES: usize = 4;

/// Largest magnitude of an e4m3fn code (`0x7E` = 1.75 * 2^8).
pub const FP8_MAX: f32 = 448.0;

/// Largest magnitude of an int8 code in the symmetric format.
pub const INT8_MAX: f32 = 127.0;

/// Groups whose largest finite |x| is below this are sent as zeros with
/// scale 0: 2^-126 (the smallest normal f32) times 448.
pub const FLUSH_AMAX: f32 = 448.0 * f32::MIN_POSITIVE;

/// The e4m3fn code for NaN (sign bit clear); `0xFF` is NaN too.
pub const FP8_NAN: u8 = 0x7F;

/// The int8 code that marks a non-finite element (decodes to NaN).
pub const INT8_NON_FINITE: i8 = -128;

/// How the data of a push allreduce travels between ranks.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub enum WireFormat {
    /// The input dtype's bytes, unchanged (every kernel today).
    #[default]
    Lossless = 0,
    /// One e4m3fn byte per element and one f32 scale per [`GROUP`].
    Fp8E4m3 = 1,
    /// One symmetric int8 byte per element and one f32 scale per [`GROUP`].
    Int8 = 2,
}

impl WireFormat {
    /// The name used by `TP_ALLREDUCE_WIRE`, `--wire` and reports.
    pub const fn name(self) -> &'static str {
        match self {
            WireFormat::Lossless => "lossless",
            WireFormat::Fp8E4m3 => "fp8",
            WireFormat::Int8 => "int8",
        }
    }

    /// Whether values change on the wire.
    pub const fn is_lossy(self) -> bool {
        !matches!(self, WireFormat::Lossless)
    }

    /// The largest code magnitude `Q` (`scale = amax / Q`); 0 for lossless.
    pub const fn code_max(self) -> f32 {
        match self {
            WireFormat::Lossless => 0.0,
            WireFormat::Fp8E4m3 => FP8_MAX,
            WireFormat::Int8 => INT8_MAX,
        }
    }
}

/// Bytes on the wire for one full group of `elem_bytes`-byte elements.
pub const fn bytes_per_group(format: WireFormat, elem_bytes: usize) -> usize {
    match format {
        WireFormat::Lossless => GROUP * elem_bytes,
        WireFormat::Fp8E4m3 | WireFormat::Int8 => GROUP + SCALE_BYTES,
    }
}

/// Bytes on the wire for a share of `elements` elements: codes padded to
/// whole groups, then one scale per group (lossless: the elements' bytes).
pub const fn share_wire_bytes(format: WireFormat, elements: u64, elem_bytes: usize) -> u64 {
    match format {
        WireFormat::Lossless => elements * elem_bytes as u64,
        WireFormat::Fp8E4m3 | WireFormat::Int8 => elements.div_ceil(GROUP as u64) * (GROUP + SCALE_BYTES) as u64,
    }
}

/// `|x|` by clearing the sign bit (no libm on nvptx).
#[inline(always)]
pub fn abs_f32(x: f32) -> f32 {
    f32::from_bits(x.to_bits() & 0x7FFF_FFFF)
}

/// The largest finite |x| of a group.
#[inline(always)]
pub fn finite_amax(xs: &[f32]) -> f32 {
    let mut m = 0.0f32;
    for &x in xs {
        let a = abs_f32(x);
        if a.is_finite() && a > m {
            m = a;
        }
    }
    m
}

/// The scale of a group of largest finite magnitude `amax`: `amax / Q`, or
/// 0 for a flushed group (`amax < FLUSH_AMAX`). Always finite and >= 0.
#[inline(always)]
pub fn scale_for(format: WireFormat, amax: f32) -> f32 {
    if !format.is_lossy() || amax < FLUSH_AMAX {
        0.0
    } else {
        amax / format.code_max()
    }
}

/// Rounds `y` (|y| < 2^22) to the nearest integer, ties to even, with f32
/// adds only: adding 1.5 * 2^23 leaves no fraction bits in the sum, and the
/// f32 add rounds to nearest even (the default mode on the host and
/// `add.rn.f32` on nvptx).
#[inline(always)]
pub fn round_ties_even_small(y: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    let r = (y + MAGIC) - MAGIC;
    // Keep the sign of zero (-0.3 rounds to -0).
    f32::from_bits(r.to_bits() | (y.to_bits() & 0x8000_0000))
}

/// e4m3fn code of `y`: round to nearest even, saturating at ±448, NaN and
/// ±Inf to NaN (`0x7F` with the sign).
#[inline(always)]
pub fn fp8_encode(y: f32) -> u8 {
    let bits = y.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let a = abs_f32(y);
    if !a.is_finite() {
        return sign | FP8_NAN;
    }
    if a >= FP8_MAX {
        return sign | 0x7E;
    }
    if a < 0.015625 {
        // Subnormal range (below 2^-6): multiples of 2^-9. `a * 512` is exact;
        // its rounding is 0..=8, and 8 is the code of 2^-6 (exponent 1).
        let m = round_ties_even_small(a * 512.0) as u8;
        return sign | m;
    }
    let abits = a.to_bits();
    let exp = (abits >> 23) as i32 - 127; // -6 ..= 8
    let mant = abits & 0x7F_FFFF;
    let keep = mant >> 20;
    let rest = mant & 0xF_FFFF;
    let half = 0x8_0000;
    let up = (rest > half || (rest == half && (keep & 1) == 1)) as u32;
    // A carry out of the mantissa moves into the exponent, as it should.
    let code = (((exp + 7) as u32) << 3) + keep + up;
    sign | if code > 0x7E { 0x7E } else { code as u8 }
}

/// The value of an e4m3fn code (exact in f32); NaN for `0x7F` / `0xFF`.
#[inline(always)]
pub fn fp8_decode(code: u8) -> f32 {
    let sign = ((code & 0x80) as u32) << 24;
    let e = ((code >> 3) & 0xF) as u32;
    let m = (code & 0x7) as u32;
    let mag = if e == 0xF && m == 0x7 {
        return f32::NAN;
    } else if e == 0 {
        // m * 2^-9, exact.
        m as f32 * (1.0 / 512.0)
    } else {
        f32::from_bits(((e + 120) << 23) | (m << 20))
    };
    f32::from_bits(mag.to_bits() | sign)
}

/// int8 code of `y`: round to nearest even, clamped to ±127; non-finite
/// to [`INT8_NON_FINITE`].
#[inline(always)]
pub fn int8_encode(y: f32) -> i8 {
    if !y.is_finite() {
        return INT8_NON_FINITE;
    }
    let c = if y >= INT8_MAX {
        INT8_MAX
    } else if y <= -INT8_MAX {
        -INT8_MAX
    } else {
        round_ties_even_small(y)
    };
    c as i8
}

/// The value of an int8 code before scaling; NaN for [`INT8_NON_FINITE`].
#[inline(always)]
pub fn int8_decode(code: i8) -> f32 {
    if code == INT8_NON_FINITE {
        f32::NAN
    } else {
        code as f32
    }
}

/// Code of one element `x` of a group of scale `scale` (as a byte).
#[inline(always)]
pub fn quantise(format: WireFormat, x: f32, scale: f32) -> u8 {
    let finite = x.is_finite();
    // Scale 0: a flushed group (or lossless, which has no codes): zeros,
    // keeping the sign of zero in fp8; non-finite elements keep their code.
    let y = if !finite {
        x
    } else if scale == 0.0 {
        f32::from_bits(x.to_bits() & 0x8000_0000)
    } else {
        x / scale
    };
    match format {
        WireFormat::Fp8E4m3 => fp8_encode(y),
        WireFormat::Int8 => int8_encode(y) as u8,
        WireFormat::Lossless => 0,
    }
}

/// The value of code `code` of a group of scale `scale`.
#[inline(always)]
pub fn dequantise(format: WireFormat, code: u8, scale: f32) -> f32 {
    match format {
        WireFormat::Fp8E4m3 => fp8_decode(code) * scale,
        WireFormat::Int8 => int8_decode(code as i8) * scale,
        WireFormat::Lossless => 0.0,
    }
}

/// Quantises one group (`xs.len() <= GROUP`, `codes.len() >= xs.len()`):
/// writes the codes, returns the scale.
#[inline(always)]
pub fn quantise_group(format: WireFormat, xs: &[f32], codes: &mut [u8]) -> f32 {
    let scale = scale_for(format, finite_amax(xs));
    for (c, &x) in codes.iter_mut().zip(xs) {
        *c = quantise(format, x, scale);
    }
    scale
}

/// Dequantises one group: `out[i] = dequantise(codes[i], scale)`.
#[inline(always)]
pub fn dequantise_group(format: WireFormat, codes: &[u8], scale: f32, out: &mut [f32]) {
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = dequantise(format, c, scale);
    }
}

const _: () = assert!(GROUP & 15 == 0, "a group's codes must be whole 16-byte packs");
const _: () = assert!(bytes_per_group(WireFormat::Fp8E4m3, 2) == 36);
const _: () = assert!(share_wire_bytes(WireFormat::Int8, 33, 2) == 72);
