//! Element types and 16-byte packs: loading (vector or element-wise for
//! tails and misaligned pointers), f32 accumulation, rounding back, and the
//! canonicalisation OneShotPush needs.
//!
//! A pack is `[u32; 4]`. f32 packs hold 4 elements; f16/bf16 packs hold 8,
//! element `2k` in the low half of word `k`. Accumulators are `[f32; 8]`
//! (f32 uses the first 4 lanes). Every loop here has a constant trip count so
//! LLVM unrolls it and the arrays stay in registers (checked by the PTX tests:
//! no local memory in any kernel).

use super::ptx;
use crate::ids::DType;

pub type Pack = [u32; 4];
pub type Acc = [f32; 8];

pub const ZERO_PACK: Pack = [0; 4];
pub const ZERO_ACC: Acc = [0.0; 8];

/// An element type the kernels reduce. Implemented by three zero-sized
/// markers; kernels are generic over it and monomorphised per entry point.
pub trait Element {
    const DTYPE: DType;
    /// Elements per pack (4 or 8).
    const LANES: usize;
    /// Bit pattern of a quiet NaN of this type.
    const CANONICAL_NAN: u32;

    /// The elements of `pack` widened to f32 (exact). Sums start from the
    /// first operand rather than from +0.0, so that a sum of -0.0 stays -0.0.
    fn to_acc(pack: &Pack) -> Acc;
    /// Adds the elements of `pack` to `acc` lane by lane, in f32.
    fn accumulate(acc: &mut Acc, pack: &Pack);
    /// Rounds `acc` to this type (round to nearest even) and packs it.
    fn round(acc: &Acc) -> Pack;
    /// Replaces every element whose bits are all ones with the quiet NaN.
    fn canonicalise(pack: Pack) -> Pack;

    /// Loads element `i` (its bits, zero-extended) from `base`.
    unsafe fn load_elem(base: *const u8, i: u64) -> u32;
    /// Stores element bits `bits` as element `i` at `base`.
    unsafe fn store_elem(base: *mut u8, i: u64, bits: u32);
}

pub struct F32;
pub struct F16;
pub struct Bf16;

impl Element for F32 {
    const DTYPE: DType = DType::F32;
    const LANES: usize = 4;
    const CANONICAL_NAN: u32 = 0x7FC0_0000;

    #[inline(always)]
    fn to_acc(pack: &Pack) -> Acc {
        let mut acc = ZERO_ACC;
        for k in 0..4 {
            acc[k] = f32::from_bits(pack[k]);
        }
        acc
    }

    #[inline(always)]
    fn accumulate(acc: &mut Acc, pack: &Pack) {
        for k in 0..4 {
            acc[k] += f32::from_bits(pack[k]);
        }
    }

    #[inline(always)]
    fn round(acc: &Acc) -> Pack {
        [acc[0].to_bits(), acc[1].to_bits(), acc[2].to_bits(), acc[3].to_bits()]
    }

    #[inline(always)]
    fn canonicalise(pack: Pack) -> Pack {
        let mut out = pack;
        for word in out.iter_mut() {
            if *word == 0xFFFF_FFFF {
                *word = Self::CANONICAL_NAN;
            }
        }
        out
    }

    #[inline(always)]
    unsafe fn load_elem(base: *const u8, i: u64) -> u32 {
        ptx::ld_global_u32((base as *const u32).add(i as usize))
    }

    #[inline(always)]
    unsafe fn store_elem(base: *mut u8, i: u64, bits: u32) {
        ptx::st_global_u32((base as *mut u32).add(i as usize), bits)
    }
}

/// Shared by the two 16-bit types: canonicalise each half.
#[inline(always)]
fn canonicalise_halves(pack: Pack, nan: u32) -> Pack {
    let mut out = pack;
    for word in out.iter_mut() {
        let mut lo = *word & 0xFFFF;
        let mut hi = *word >> 16;
        if lo == 0xFFFF {
            lo = nan;
        }
        if hi == 0xFFFF {
            hi = nan;
        }
        *word = lo | (hi << 16);
    }
    out
}

impl Element for F16 {
    const DTYPE: DType = DType::F16;
    const LANES: usize = 8;
    const CANONICAL_NAN: u32 = 0x7E00;

    #[inline(always)]
    fn to_acc(pack: &Pack) -> Acc {
        let mut acc = ZERO_ACC;
        for k in 0..4 {
            acc[2 * k] = ptx::cvt_f32_f16(pack[k] as u16);
            acc[2 * k + 1] = ptx::cvt_f32_f16((pack[k] >> 16) as u16);
        }
        acc
    }

    #[inline(always)]
    fn accumulate(acc: &mut Acc, pack: &Pack) {
        for k in 0..4 {
            acc[2 * k] += ptx::cvt_f32_f16(pack[k] as u16);
            acc[2 * k + 1] += ptx::cvt_f32_f16((pack[k] >> 16) as u16);
        }
    }

    #[inline(always)]
    fn round(acc: &Acc) -> Pack {
        [
            ptx::cvt_rn_f16x2_f32(acc[0], acc[1]),
            ptx::cvt_rn_f16x2_f32(acc[2], acc[3]),
            ptx::cvt_rn_f16x2_f32(acc[4], acc[5]),
            ptx::cvt_rn_f16x2_f32(acc[6], acc[7]),
        ]
    }

    #[inline(always)]
    fn canonicalise(pack: Pack) -> Pack {
        canonicalise_halves(pack, Self::CANONICAL_NAN)
    }

    #[inline(always)]
    unsafe fn load_elem(base: *const u8, i: u64) -> u32 {
        ptx::ld_global_u16((base as *const u16).add(i as usize)) as u32
    }

    #[inline(always)]
    unsafe fn store_elem(base: *mut u8, i: u64, bits: u32) {
        ptx::st_global_u16((base as *mut u16).add(i as usize), bits as u16)
    }
}

impl Element for Bf16 {
    const DTYPE: DType = DType::Bf16;
    const LANES: usize = 8;
    const CANONICAL_NAN: u32 = 0x7FC0;

    #[inline(always)]
    fn to_acc(pack: &Pack) -> Acc {
        let mut acc = ZERO_ACC;
        for k in 0..4 {
            acc[2 * k] = ptx::cvt_f32_bf16(pack[k] as u16);
            acc[2 * k + 1] = ptx::cvt_f32_bf16((pack[k] >> 16) as u16);
        }
        acc
    }

    #[inline(always)]
    fn accumulate(acc: &mut Acc, pack: &Pack) {
        for k in 0..4 {
            acc[2 * k] += ptx::cvt_f32_bf16(pack[k] as u16);
            acc[2 * k + 1] += ptx::cvt_f32_bf16((pack[k] >> 16) as u16);
        }
    }

    #[inline(always)]
    fn round(acc: &Acc) -> Pack {
        [
            ptx::cvt_rn_bf16x2_f32(acc[0], acc[1]),
            ptx::cvt_rn_bf16x2_f32(acc[2], acc[3]),
            ptx::cvt_rn_bf16x2_f32(acc[4], acc[5]),
            ptx::cvt_rn_bf16x2_f32(acc[6], acc[7]),
        ]
    }

    #[inline(always)]
    fn canonicalise(pack: Pack) -> Pack {
        canonicalise_halves(pack, Self::CANONICAL_NAN)
    }

    #[inline(always)]
    unsafe fn load_elem(base: *const u8, i: u64) -> u32 {
        ptx::ld_global_u16((base as *const u16).add(i as usize)) as u32
    }

    #[inline(always)]
    unsafe fn store_elem(base: *mut u8, i: u64, bits: u32) {
        ptx::st_global_u16((base as *mut u16).add(i as usize), bits as u16)
    }
}

/// Bits of element `lane` of `pack`.
#[inline(always)]
fn lane_bits<E: Element>(pack: &Pack, lane: usize) -> u32 {
    if E::LANES == 4 {
        pack[lane]
    } else {
        (pack[lane / 2] >> (16 * (lane % 2))) & 0xFFFF
    }
}

#[inline(always)]
fn set_lane_bits<E: Element>(pack: &mut Pack, lane: usize, bits: u32) {
    if E::LANES == 4 {
        pack[lane] = bits;
    } else {
        let shift = 16 * (lane % 2);
        pack[lane / 2] = (pack[lane / 2] & !(0xFFFF << shift)) | ((bits & 0xFFFF) << shift);
    }
}

/// Loads pack `pack` of the message at `base`, which holds `valid` real
/// elements (`valid <= LANES`); missing lanes read as zero bits. `vector`
/// says the pack is full and `base` 16-byte aligned (one `ld.global.v4`);
/// otherwise the elements are loaded one by one, which is how tails and
/// misaligned user pointers are handled.
#[inline(always)]
pub unsafe fn load_pack<E: Element>(base: *const u8, pack: u64, valid: u64, vector: bool) -> Pack {
    if vector {
        ptx::ld_global_v4_u32(base.add((pack * 16) as usize) as *const u32)
    } else {
        let mut out = ZERO_PACK;
        let first = pack * E::LANES as u64;
        for lane in 0..E::LANES {
            if (lane as u64) < valid {
                set_lane_bits::<E>(&mut out, lane, E::load_elem(base, first + lane as u64));
            }
        }
        out
    }
}

/// Stores the first `valid` elements of `value` as pack `pack` at `base`
/// (see [`load_pack`] for `vector`).
#[inline(always)]
pub unsafe fn store_pack<E: Element>(base: *mut u8, pack: u64, valid: u64, vector: bool, value: &Pack) {
    if vector {
        ptx::st_global_v4_u32(base.add((pack * 16) as usize) as *mut u32, *value)
    } else {
        let first = pack * E::LANES as u64;
        for lane in 0..E::LANES {
            if (lane as u64) < valid {
                E::store_elem(base, first + lane as u64, lane_bits::<E>(value, lane));
            }
        }
    }
}

/// Whether a sentinel receive pack still holds the EMPTY pattern in any
/// word (so its payload has not fully landed).
#[inline(always)]
pub fn any_word_empty(pack: &Pack) -> bool {
    let e = crate::layout::SENTINEL_EMPTY_WORD;
    pack[0] == e || pack[1] == e || pack[2] == e || pack[3] == e
}

/// True when `addr` is 16-byte aligned.
#[inline(always)]
pub fn aligned16(addr: u64) -> bool {
    addr & 15 == 0
}
