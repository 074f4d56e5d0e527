//! Elementwise kernels: the first kernel of the foundation (a sum of K
//! buffers, the building block every allreduce reduction reuses through
//! `pack`) and the small dependent kernel that tests and the benchmark place
//! between allreduces in a captured graph.

use super::grid_stride;
use super::pack::{aligned16, load_pack, store_pack, Element};
use crate::dtype_entry_points;
use crate::partition::{div_ceil, elems_in_pack};

/// `output[i] = sum_k inputs[k][i]` for `i < count`, accumulated in f32 in
/// ascending `k`, rounded once. `inputs` is a device array of `num_inputs`
/// device addresses.
#[inline(always)]
unsafe fn sum<E: Element>(inputs: *const u64, num_inputs: u32, output: *mut u8, count: u64) {
    let lanes = E::LANES as u64;
    let packs = div_ceil(count, lanes);
    let mut all_aligned = aligned16(output as u64);
    for k in 0..num_inputs as usize {
        all_aligned &= aligned16(*inputs.add(k));
    }
    let (first, stride) = grid_stride();
    let mut pack = first;
    while pack < packs {
        let valid = elems_in_pack(count, lanes, pack);
        let vector = all_aligned && valid == lanes;
        let mut acc = E::to_acc(&load_pack::<E>(*inputs as *const u8, pack, valid, vector));
        for k in 1..num_inputs as usize {
            let p = load_pack::<E>(*inputs.add(k) as *const u8, pack, valid, vector);
            E::accumulate(&mut acc, &p);
        }
        store_pack::<E>(output, pack, valid, vector, &E::round(&acc));
        pack += stride;
    }
}

dtype_entry_points!(sum, sum_f32, sum_f16, sum_bf16, (inputs: *const u64, num_inputs: u32, output: *mut u8, count: u64));

/// `output[i] = input[i] * scale + bias` in f32, rounded once (the stand-in
/// for a model layer between two allreduces).
#[inline(always)]
unsafe fn affine<E: Element>(input: *const u8, output: *mut u8, count: u64, scale: f32, bias: f32) {
    let lanes = E::LANES as u64;
    let packs = div_ceil(count, lanes);
    let all_aligned = aligned16(input as u64) && aligned16(output as u64);
    let (first, stride) = grid_stride();
    let mut pack = first;
    while pack < packs {
        let valid = elems_in_pack(count, lanes, pack);
        let vector = all_aligned && valid == lanes;
        let mut acc = E::to_acc(&load_pack::<E>(input, pack, valid, vector));
        for a in acc.iter_mut() {
            *a = *a * scale + bias;
        }
        store_pack::<E>(output, pack, valid, vector, &E::round(&acc));
        pack += stride;
    }
}

dtype_entry_points!(affine, affine_f32, affine_f16, affine_bf16, (input: *const u8, output: *mut u8, count: u64, scale: f32, bias: f32));
