//! TwoShotPush with payload completion: reduce-scatter by posted writes,
//! then all-gather by posted writes, two dependent hops, no flag and no
//! barrier between ranks. It is the island push of `island_push.rs` with one
//! island of every rank: rank r owns share r (`S = world` shares of
//! `ceil(packs / world)` packs).
//!
//! ```text
//!   receive region of rank d, per half (generation & 1):
//!     RS[world-1 slots][share_cap], AG[world-1 slots][share_cap]
//!   A  share o of the input -> RS slot of r at rank o, o = r+1, r+2, ...
//!   B  own share: poll the world-1 RS slots, reset, v = sum in rank order;
//!      out = v; v -> AG slot of r at every other rank
//!   D  every other share o: poll AG slot of o, reset, out = value
//! ```
//! Bytes per rank: 2(N-1)/N·S, the minimum of any allreduce; only posted
//! writes cross the fabric, peers visited r+1, r+2, ... so that at any
//! moment the ranks target different peers. The ordering argument is the
//! one of `island_push.rs` (per slot, the OneShotPush lemma).

use super::island_push::island_push;
use crate::params::IslandPushParams;

macro_rules! entries {
    ($f32:ident, $f16:ident, $bf16:ident) => {
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $f32(p: IslandPushParams) {
            island_push::<super::pack::F32, false>(p)
        }
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $f16(p: IslandPushParams) {
            island_push::<super::pack::F16, false>(p)
        }
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $bf16(p: IslandPushParams) {
            island_push::<super::pack::Bf16, false>(p)
        }
    };
}

entries!(two_shot_push_f32, two_shot_push_f16, two_shot_push_bf16);
