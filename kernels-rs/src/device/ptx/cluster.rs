//! Thread-block cluster instructions (sm_90 and newer), part of the one
//! inline-PTX module (`device::ptx`, which re-exports them).
//!
//! Thread-block clusters (PTX ISA 7.8, sm_90): the blocks of a cluster are
//! scheduled together on one GPC and read each other's shared memory
//! (docs/SOURCES.md [F40]). Only entries compiled for sm_90 or newer call
//! these (`cfg(target_feature = "sm_90")`); ptxas rejects them below.

use core::arch::asm;

/// `%cluster_ctarank`: this block's rank in its cluster.
#[inline(always)]
pub fn cluster_ctarank() -> u32 {
    let r: u32;
    // SAFETY: reads a special register.
    unsafe { asm!("mov.u32 {r}, %cluster_ctarank;", r = out(reg32) r, options(nomem, nostack, pure)) };
    r
}

/// `%cluster_nctarank`: blocks per cluster.
#[inline(always)]
pub fn cluster_nctarank() -> u32 {
    let r: u32;
    // SAFETY: reads a special register.
    unsafe { asm!("mov.u32 {r}, %cluster_nctarank;", r = out(reg32) r, options(nomem, nostack, pure)) };
    r
}

/// `barrier.cluster.wait.aligned;` — waits until every thread of the
/// cluster arrived (acquire semantics, the PTX default). Pairs with this
/// thread's previous [`barrier_cluster_arrive_relaxed`].
#[inline(always)]
pub unsafe fn barrier_cluster_wait() {
    asm!("barrier.cluster.wait.aligned;", options(nostack));
}

/// `mapa.shared::cluster.u32 d, addr, cta;` — the address of shared-window
/// address `addr` in block `cta` of this cluster (for the `::cluster` loads).
#[inline(always)]
pub fn map_shared_to_cta(addr: u32, cta: u32) -> u32 {
    let d: u32;
    // SAFETY: address arithmetic only.
    unsafe {
        asm!("mapa.shared::cluster.u32 {d}, {a}, {c};", d = out(reg32) d, a = in(reg32) addr, c = in(reg32) cta, options(pure, nomem, nostack))
    };
    d
}

/// `mbarrier.init.shared::cta.b64 [addr], count;` — one thread readies
/// the mbarrier at `addr` (8-byte aligned, shared window) for `count`
/// arrivals per phase, in phase 0.
#[inline(always)]
pub unsafe fn mbarrier_init(addr: u32, count: u32) {
    asm!("mbarrier.init.shared::cta.b64 [{a}], {c};", a = in(reg32) addr, c = in(reg32) count, options(nostack));
}

/// `fence.mbarrier_init.release.cluster;` — orders this thread's earlier
/// `mbarrier.init`s before its later cluster-barrier arrive (a light fence:
/// no `MEMBAR` in the SASS, unlike a release arrive).
#[inline(always)]
pub unsafe fn fence_mbarrier_init_release_cluster() {
    asm!("fence.mbarrier_init.release.cluster;", options(nostack));
}

/// `barrier.cluster.arrive.relaxed.aligned;` — arrives at the cluster
/// barrier without ordering earlier accesses (every thread of the cluster,
/// converged within its warp).
#[inline(always)]
pub unsafe fn barrier_cluster_arrive_relaxed() {
    asm!("barrier.cluster.arrive.relaxed.aligned;", options(nostack));
}

/// `mbarrier.arrive.expect_tx.shared::cta.b64 _, [addr], bytes;` — this
/// thread's arrival on the mbarrier at `addr`, announcing `bytes` more of
/// transactions (`st.async` completions) the current phase waits for.
#[inline(always)]
pub unsafe fn mbarrier_arrive_expect_tx(addr: u32, bytes: u32) {
    asm!("mbarrier.arrive.expect_tx.shared::cta.b64 _, [{a}], {b};", a = in(reg32) addr, b = in(reg32) bytes, options(nostack));
}

/// `st.async.shared::cluster.mbarrier::complete_tx::bytes.b64 [addr], v,
/// [mbar];` — stores `v` into the shared memory of a block of this cluster
/// (`addr`, `mbar` from [`map_shared_to_cta`]) and completes 8 bytes of
/// transactions on that block's mbarrier `mbar` (a release at cluster
/// scope; the store itself is weak).
#[inline(always)]
pub unsafe fn st_async_shared_cluster_u64(addr: u32, v: u64, mbar: u32) {
    asm!(
        "st.async.shared::cluster.mbarrier::complete_tx::bytes.b64 [{a}], {v}, [{m}];",
        a = in(reg32) addr,
        v = in(reg64) v,
        m = in(reg32) mbar,
        options(nostack)
    );
}

/// `mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64` on the
/// mbarrier at `addr`: whether its phase of parity `parity` has completed
/// (acquire at cluster scope: the remote `st.async` data of that phase is
/// visible after `true`). Never hoisted out of a polling loop.
#[inline(always)]
pub unsafe fn mbarrier_try_wait_parity(addr: u32, parity: u32) -> bool {
    let done: u32;
    asm!(
        "{{ .reg .pred p;",
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [{a}], {ph};",
        "selp.u32 {d}, 1, 0, p; }}",
        a = in(reg32) addr,
        ph = in(reg32) parity,
        d = out(reg32) done,
        options(nostack)
    );
    done != 0
}

/// `ld.shared.u64 v, [addr];` (`addr` 8-byte aligned, shared window)
#[inline(always)]
pub unsafe fn ld_shared_u64(addr: u32) -> u64 {
    let v: u64;
    asm!("ld.shared.u64 {v}, [{a}];", v = out(reg64) v, a = in(reg32) addr, options(nostack, readonly));
    v
}

/// Shared-window address of this block's cluster inbox: 16 u64 (two
/// buffers of one word per block of the cluster), then two mbarriers (one
/// per buffer), declared by this asm block.
#[inline(always)]
pub fn cluster_inbox() -> u32 {
    let a: u32;
    // SAFETY: declares a block-scoped shared array and takes its address.
    unsafe {
        asm!("{{ .shared .align 8 .b8 tp_cluster_inbox[144];", "mov.u32 {a}, tp_cluster_inbox; }}", a = out(reg32) a, options(pure, nomem, nostack))
    };
    a
}
