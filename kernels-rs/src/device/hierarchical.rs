//! Hierarchical with payload completion: for machines split into islands
//! (PCIe switches, root complexes, CPU sockets; derived from the topology,
//! any shape, unequal sizes allowed). Reduce-scatter inside each island,
//! exchange each share's partial sum with its owners in the other islands,
//! all-gather inside the island: three dependent hops, posted writes only,
//! no flag and no barrier. The body is `island_push.rs`.
//!
//! ```text
//!   islands I_0..I_{m-1} of n_g members, S = max n_g shares of
//!   sh = ceil(packs / S) packs; owner of share k in island h = I_h[k mod n_h]
//!   A  island RS: share k not owned -> owner's RS slot      (n_g-1)/S·S
//!   B  owned k: p = sum of the island (member order)
//!      -> CROSS slot at owner_h(k) of every other island h   owned·(m-1)/S·S
//!   C  owned k: f = sum of the partials (island order) -> AG slot of every member
//!   D  island AG: shares owned elsewhere in the island <- AG slots
//! ```
//! Bytes across the island boundary per rank: its owned fraction times
//! (m-1) (a 4+4 split of 42 KB: ~10.5 KB per rank, 42 KB per direction in
//! total, vs ~172 KB for a flat two-shot). Every island finishes share k
//! from the same partials in the same island order, so ranks agree bitwise;
//! f16/bf16 carry two roundings (partial, final). Members of a smaller
//! island own more shares (a 4+2 split: the two own two each).

use super::island_push::island_push;
use crate::params::IslandPushParams;

macro_rules! entries {
    ($f32:ident, $f16:ident, $bf16:ident) => {
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $f32(p: IslandPushParams) {
            island_push::<super::pack::F32, true>(p)
        }
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $f16(p: IslandPushParams) {
            island_push::<super::pack::F16, true>(p)
        }
        #[no_mangle]
        pub unsafe extern "ptx-kernel" fn $bf16(p: IslandPushParams) {
            island_push::<super::pack::Bf16, true>(p)
        }
    };
}

entries!(hierarchical_f32, hierarchical_f16, hierarchical_bf16);
