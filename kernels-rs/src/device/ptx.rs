//! The device support layer: every line of inline PTX in the crate lives here
//! (the thread-block cluster instructions in `ptx/cluster.rs`).
//!
//! One function per (operation, ordering, scope); the name says all three
//! (`ld_acquire_sys_u32`). Each function's doc comment quotes the PTX it
//! emits. Nothing here relies on `volatile` for *ordering*: ordering comes
//! from `.acquire` / `.release` / `fence`; `volatile`/`relaxed` loads only
//! guarantee that a polling loop re-reads memory (no hoisting, no L1 reuse).
//!
//! Why not `core::sync::atomic`: on nvptx, core's atomics compile to relaxed
//! GPU-scope `atom` whatever `Ordering` is passed, which is wrong for flags
//! that another GPU or the host reads (docs/SOURCES.md [F31, F32]).
//!
//! Addresses are generic pointers to global memory (device memory, peer
//! memory mapped through P2P/IPC, or host memory mapped into the device); on
//! every supported GPU a generic address of global memory is also its global
//! address, so `.global` instructions take them directly.
#![allow(clippy::missing_safety_doc)]

use core::arch::asm;
use core::arch::nvptx;

// ---------------------------------------------------------------- ids

/// `%tid.x`
#[inline(always)]
pub fn thread_idx_x() -> u32 {
    // SAFETY: reads a special register.
    unsafe { nvptx::_thread_idx_x() as u32 }
}

/// `%ctaid.x`
#[inline(always)]
pub fn block_idx_x() -> u32 {
    // SAFETY: reads a special register.
    unsafe { nvptx::_block_idx_x() as u32 }
}

/// `%ntid.x`
#[inline(always)]
pub fn block_dim_x() -> u32 {
    // SAFETY: reads a special register.
    unsafe { nvptx::_block_dim_x() as u32 }
}

/// `%nctaid.x`
#[inline(always)]
pub fn grid_dim_x() -> u32 {
    // SAFETY: reads a special register.
    unsafe { nvptx::_grid_dim_x() as u32 }
}

/// `mov.u32 %r, %laneid;`
#[inline(always)]
pub fn lane_id() -> u32 {
    let lane: u32;
    // SAFETY: reads a special register; no memory access.
    unsafe { asm!("mov.u32 {l}, %laneid;", l = out(reg32) lane, options(nomem, nostack, pure)) };
    lane
}

/// `mov.u64 %rd, %globaltimer;` — nanoseconds of a global timer (its update
/// granularity is about a microsecond on older GPUs, 32 ns on newer ones).
#[inline(always)]
pub fn globaltimer_ns() -> u64 {
    let t: u64;
    // SAFETY: reads a special register. Not `pure`: every call must re-read.
    unsafe { asm!("mov.u64 {t}, %globaltimer;", t = out(reg64) t, options(nomem, nostack)) };
    t
}

/// `mov.b64 %o, %i;` — returns `v` unchanged but opaque to LLVM: a value
/// derived from it is computed where it is used. Not `pure`, so it is never
/// hoisted out of a loop or a branch. Used so that `param + opaque(off)` is
/// an add with a constant-bank operand at each use instead of `param +
/// half` hoisted for every rank (one 64-bit register per rank held for a
/// whole loop).
#[inline(always)]
pub fn opaque_u64(v: u64) -> u64 {
    let o: u64;
    // SAFETY: a register move.
    unsafe { asm!("mov.b64 {o}, {i};", o = out(reg64) o, i = in(reg64) v, options(nomem, nostack)) };
    o
}

// ---------------------------------------------------------------- block barriers

/// `bar.sync 0;` — all threads of the block arrive; orders their memory
/// accesses before it against those after it, at CTA scope.
#[inline(always)]
pub fn bar_sync() {
    // SAFETY: a block-wide barrier; every thread of the block must reach it,
    // which callers guarantee by calling it from block-uniform control flow.
    unsafe { asm!("bar.sync 0;", options(nostack)) };
}

/// `bar.red.or.pred %p, 0, %q;` — a block barrier that also returns whether
/// `pred` was true on any thread of the block (CUDA's `__syncthreads_or`).
#[inline(always)]
pub fn bar_red_or(pred: bool) -> bool {
    let out: u32;
    // SAFETY: as `bar_sync`; the predicate registers are scoped to the asm block.
    unsafe {
        asm!(
            "{{ .reg .pred %p_in, %p_out;",
            "setp.ne.u32 %p_in, {pred}, 0;",
            "bar.red.or.pred %p_out, 0, %p_in;",
            "selp.u32 {out}, 1, 0, %p_out; }}",
            pred = in(reg32) pred as u32,
            out = out(reg32) out,
            options(nostack)
        )
    };
    out != 0
}

// ---------------------------------------------------------------- fences

/// `fence.acq_rel.sys;` — orders this thread's prior memory accesses before
/// its later ones for observers anywhere in the system (other GPUs, host).
#[inline(always)]
pub fn fence_acq_rel_sys() {
    // SAFETY: a fence has no operands.
    unsafe { asm!("fence.acq_rel.sys;", options(nostack)) };
}

/// `fence.sc.sys;` — sequentially consistent system-scope fence.
#[inline(always)]
pub fn fence_sc_sys() {
    // SAFETY: a fence has no operands.
    unsafe { asm!("fence.sc.sys;", options(nostack)) };
}

/// `fence.acq_rel.gpu;` — as `fence_acq_rel_sys` for observers on this GPU.
#[inline(always)]
pub fn fence_acq_rel_gpu() {
    // SAFETY: a fence has no operands.
    unsafe { asm!("fence.acq_rel.gpu;", options(nostack)) };
}

// ---------------------------------------------------------------- flags (32/64-bit)

/// `ld.acquire.sys.global.u32 %r, [addr];`
#[inline(always)]
pub unsafe fn ld_acquire_sys_u32(addr: *const u32) -> u32 {
    let v: u32;
    asm!("ld.acquire.sys.global.u32 {v}, [{a}];", v = out(reg32) v, a = in(reg64) addr, options(nostack));
    v
}

/// `ld.acquire.sys.global.u64 %rd, [addr];`
#[inline(always)]
pub unsafe fn ld_acquire_sys_u64(addr: *const u64) -> u64 {
    let v: u64;
    asm!("ld.acquire.sys.global.u64 {v}, [{a}];", v = out(reg64) v, a = in(reg64) addr, options(nostack));
    v
}

/// `ld.relaxed.sys.global.u32 %r, [addr];` — `readonly`: orders nothing,
/// so the compiler may keep other values in registers across it (it is
/// still never merged or hoisted: inline asm without `pure` always runs).
#[inline(always)]
pub unsafe fn ld_relaxed_sys_u32(addr: *const u32) -> u32 {
    let v: u32;
    asm!("ld.relaxed.sys.global.u32 {v}, [{a}];", v = out(reg32) v, a = in(reg64) addr, options(nostack, readonly));
    v
}

/// `ld.relaxed.sys.global.u64 %rd, [addr];` (`readonly`, see above)
#[inline(always)]
pub unsafe fn ld_relaxed_sys_u64(addr: *const u64) -> u64 {
    let v: u64;
    asm!("ld.relaxed.sys.global.u64 {v}, [{a}];", v = out(reg64) v, a = in(reg64) addr, options(nostack, readonly));
    v
}

/// `ld.relaxed.gpu.global.u32 %r, [addr];` — rank-local control words
/// written by earlier kernels of this GPU (`readonly`, see above).
#[inline(always)]
pub unsafe fn ld_relaxed_gpu_u32(addr: *const u32) -> u32 {
    let v: u32;
    asm!("ld.relaxed.gpu.global.u32 {v}, [{a}];", v = out(reg32) v, a = in(reg64) addr, options(nostack, readonly));
    v
}

/// `ld.relaxed.gpu.global.v4.b32 {a,b,c,d}, [addr];` — four rank-local
/// control words in one access (`addr` 16-byte aligned); each word is
/// single-copy atomic (`readonly`, see above).
#[inline(always)]
pub unsafe fn ld_relaxed_gpu_v4_u32(addr: *const u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    asm!("ld.relaxed.gpu.global.v4.b32 {{{a}, {b}, {c}, {d}}}, [{p}];", p = in(reg64) addr, a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, options(nostack, readonly));
    [a, b, c, d]
}

/// `st.relaxed.gpu.global.u32 [addr], %r;` — rank-local control words.
#[inline(always)]
pub unsafe fn st_relaxed_gpu_u32(addr: *mut u32, v: u32) {
    asm!("st.relaxed.gpu.global.u32 [{a}], {v};", a = in(reg64) addr, v = in(reg32) v, options(nostack));
}

/// `st.release.sys.global.u32 [addr], %r;`
#[inline(always)]
pub unsafe fn st_release_sys_u32(addr: *mut u32, v: u32) {
    asm!("st.release.sys.global.u32 [{a}], {v};", a = in(reg64) addr, v = in(reg32) v, options(nostack));
}

/// `st.release.sys.global.u64 [addr], %rd;`
#[inline(always)]
pub unsafe fn st_release_sys_u64(addr: *mut u64, v: u64) {
    asm!("st.release.sys.global.u64 [{a}], {v};", a = in(reg64) addr, v = in(reg64) v, options(nostack));
}

/// `st.relaxed.sys.global.u32 [addr], %r;`
#[inline(always)]
pub unsafe fn st_relaxed_sys_u32(addr: *mut u32, v: u32) {
    asm!("st.relaxed.sys.global.u32 [{a}], {v};", a = in(reg64) addr, v = in(reg32) v, options(nostack));
}

/// `st.relaxed.sys.global.u64 [addr], %rd;`
#[inline(always)]
pub unsafe fn st_relaxed_sys_u64(addr: *mut u64, v: u64) {
    asm!("st.relaxed.sys.global.u64 [{a}], {v};", a = in(reg64) addr, v = in(reg64) v, options(nostack));
}

/// `atom.relaxed.gpu.global.cas.b32 %r, [addr], expected, new;` — returns the
/// previous value. GPU scope: only for words no other GPU or host touches.
#[inline(always)]
pub unsafe fn atom_cas_relaxed_gpu_u32(addr: *mut u32, expected: u32, new: u32) -> u32 {
    let old: u32;
    asm!("atom.relaxed.gpu.global.cas.b32 {o}, [{a}], {e}, {n};", o = out(reg32) old, a = in(reg64) addr, e = in(reg32) expected, n = in(reg32) new, options(nostack));
    old
}

/// `atom.relaxed.gpu.global.add.u32 %r, [addr], v;` — returns the previous
/// value. GPU scope, device memory of this GPU only (block arrivals). No
/// release: it must not wait for this thread's outstanding peer stores.
#[inline(always)]
pub unsafe fn atom_add_relaxed_gpu_u32(addr: *mut u32, v: u32) -> u32 {
    let old: u32;
    asm!("atom.relaxed.gpu.global.add.u32 {o}, [{a}], {v};", o = out(reg32) old, a = in(reg64) addr, v = in(reg32) v, options(nostack));
    old
}

/// [`atom_add_relaxed_gpu_u32`] where `enabled`, else 0 and no access: the
/// condition is a predicate inside the asm, so a caller that branches on
/// the thread index alone keeps a single-lane atomic. (A branch on the
/// thread index and another condition let ptxas 13.0 turn the atomic into
/// a warp-aggregated one whose shuffle waits for the answer at once.)
#[inline(always)]
pub unsafe fn atom_add_relaxed_gpu_u32_if(addr: *mut u32, v: u32, enabled: bool) -> u32 {
    let old: u32;
    asm!(
        "{{ .reg .pred p; setp.ne.u32 p, {e}, 0; mov.u32 {o}, 0; @p atom.relaxed.gpu.global.add.u32 {o}, [{a}], {v}; }}",
        o = out(reg32) old, a = in(reg64) addr, v = in(reg32) v, e = in(reg32) enabled as u32, options(nostack)
    );
    old
}

/// `atom.acq_rel.sys.global.add.u32 %r, [addr], v;` — system-scope add.
/// Only for memory local to this GPU: peer atomics are not guaranteed over
/// PCIe, so no protocol in this crate uses it on peer or host memory.
#[inline(always)]
pub unsafe fn atom_add_acq_rel_sys_u32(addr: *mut u32, v: u32) -> u32 {
    let old: u32;
    asm!("atom.acq_rel.sys.global.add.u32 {o}, [{a}], {v};", o = out(reg32) old, a = in(reg64) addr, v = in(reg32) v, options(nostack));
    old
}

/// `atom.acq_rel.sys.global.add.u64 %rd, [addr], v;` (same restriction).
#[inline(always)]
pub unsafe fn atom_add_acq_rel_sys_u64(addr: *mut u64, v: u64) -> u64 {
    let old: u64;
    asm!("atom.acq_rel.sys.global.add.u64 {o}, [{a}], {v};", o = out(reg64) old, a = in(reg64) addr, v = in(reg64) v, options(nostack));
    old
}

/// `red.release.sys.global.add.u32 [addr], v;` (same restriction).
#[inline(always)]
pub unsafe fn red_add_release_sys_u32(addr: *mut u32, v: u32) {
    asm!("red.release.sys.global.add.u32 [{a}], {v};", a = in(reg64) addr, v = in(reg32) v, options(nostack));
}

// ---------------------------------------------------------------- 128-bit data

/// `ld.global.v4.b32 {a,b,c,d}, [addr];` — weak load (may hit L1). Correct
/// for data published by a release the thread (or its block, through a
/// barrier) has acquired. `addr` must be 16-byte aligned.
#[inline(always)]
pub unsafe fn ld_global_v4_u32(addr: *const u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    asm!("ld.global.v4.b32 {{{a}, {b}, {c}, {d}}}, [{p}];", p = in(reg64) addr, a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, options(nostack, readonly));
    [a, b, c, d]
}

/// `ld.relaxed.sys.global.v4.b32 {a,b,c,d}, [addr];` — a strong (relaxed,
/// system-scope) polling load of a sentinel slot: never served from L1,
/// each 32-bit word single-copy atomic (the four words are not read
/// atomically together). `readonly` (see `ld_relaxed_sys_u32`).
#[inline(always)]
pub unsafe fn ld_relaxed_sys_v4_u32(addr: *const u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    asm!("ld.relaxed.sys.global.v4.b32 {{{a}, {b}, {c}, {d}}}, [{p}];", p = in(reg64) addr, a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, options(nostack, readonly));
    [a, b, c, d]
}

/// `st.global.v4.b32 [addr], {a,b,c,d};` — weak store; published to other
/// ranks only by a later release (after a block barrier if other threads
/// publish it). `addr` must be 16-byte aligned.
#[inline(always)]
pub unsafe fn st_global_v4_u32(addr: *mut u32, v: [u32; 4]) {
    asm!("st.global.v4.b32 [{p}], {{{a}, {b}, {c}, {d}}};", p = in(reg64) addr, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3], options(nostack));
}

/// `st.volatile.global.v4.b32 [addr], {a,b,c,d};`
#[inline(always)]
pub unsafe fn st_volatile_v4_u32(addr: *mut u32, v: [u32; 4]) {
    asm!("st.volatile.global.v4.b32 [{p}], {{{a}, {b}, {c}, {d}}};", p = in(reg64) addr, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3], options(nostack));
}

/// `st.relaxed.sys.global.v4.b32 [addr], {a,b,c,d};` — a strong store whose
/// words become visible to system-scope polling loads (payload-as-flag).
#[inline(always)]
pub unsafe fn st_relaxed_sys_v4_u32(addr: *mut u32, v: [u32; 4]) {
    asm!("st.relaxed.sys.global.v4.b32 [{p}], {{{a}, {b}, {c}, {d}}};", p = in(reg64) addr, a = in(reg32) v[0], b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3], options(nostack));
}

// ---------------------------------------------------------------- scalar data (tails, misaligned)

/// `ld.global.u16 %rs, [addr];`
#[inline(always)]
pub unsafe fn ld_global_u16(addr: *const u16) -> u16 {
    let v: u16;
    asm!("ld.global.u16 {v}, [{a}];", v = out(reg16) v, a = in(reg64) addr, options(nostack, readonly));
    v
}

/// `ld.global.u32 %r, [addr];`
#[inline(always)]
pub unsafe fn ld_global_u32(addr: *const u32) -> u32 {
    let v: u32;
    asm!("ld.global.u32 {v}, [{a}];", v = out(reg32) v, a = in(reg64) addr, options(nostack, readonly));
    v
}

/// `st.global.u16 [addr], %rs;`
#[inline(always)]
pub unsafe fn st_global_u16(addr: *mut u16, v: u16) {
    asm!("st.global.u16 [{a}], {v};", a = in(reg64) addr, v = in(reg16) v, options(nostack));
}

/// `st.global.u32 [addr], %r;`
#[inline(always)]
pub unsafe fn st_global_u32(addr: *mut u32, v: u32) {
    asm!("st.global.u32 [{a}], {v};", a = in(reg64) addr, v = in(reg32) v, options(nostack));
}

// ---------------------------------------------------------------- conversions and packed math

/// `cvt.f32.f16 %f, %h;` (exact)
#[inline(always)]
pub fn cvt_f32_f16(h: u16) -> f32 {
    let f: f32;
    // SAFETY: register-only conversion.
    unsafe { asm!("cvt.f32.f16 {f}, {h};", f = out(reg32) f, h = in(reg16) h, options(pure, nomem, nostack)) };
    f
}

/// `cvt.rn.f16.f32 %h, %f;` (round to nearest even)
#[inline(always)]
pub fn cvt_rn_f16_f32(f: f32) -> u16 {
    let h: u16;
    // SAFETY: register-only conversion.
    unsafe { asm!("cvt.rn.f16.f32 {h}, {f};", h = out(reg16) h, f = in(reg32) f, options(pure, nomem, nostack)) };
    h
}

/// `cvt.rn.f16x2.f32 %r, hi, lo;` — two f32 to packed f16x2 (`lo` in bits 0..16).
#[inline(always)]
pub fn cvt_rn_f16x2_f32(lo: f32, hi: f32) -> u32 {
    let r: u32;
    // SAFETY: register-only conversion (sm_80+).
    unsafe {
        asm!("cvt.rn.f16x2.f32 {r}, {hi}, {lo};", r = out(reg32) r, hi = in(reg32) hi, lo = in(reg32) lo, options(pure, nomem, nostack))
    };
    r
}

/// bf16 bits to f32: exact, a shift (no PTX instruction needed).
#[inline(always)]
pub fn cvt_f32_bf16(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// `cvt.rn.bf16.f32 %h, %f;` (round to nearest even, NaN preserved)
#[inline(always)]
pub fn cvt_rn_bf16_f32(f: f32) -> u16 {
    let h: u16;
    // SAFETY: register-only conversion (sm_80+).
    unsafe { asm!("cvt.rn.bf16.f32 {h}, {f};", h = out(reg16) h, f = in(reg32) f, options(pure, nomem, nostack)) };
    h
}

/// `cvt.rn.bf16x2.f32 %r, hi, lo;` — two f32 to packed bf16x2.
#[inline(always)]
pub fn cvt_rn_bf16x2_f32(lo: f32, hi: f32) -> u32 {
    let r: u32;
    // SAFETY: register-only conversion (sm_80+).
    unsafe {
        asm!("cvt.rn.bf16x2.f32 {r}, {hi}, {lo};", r = out(reg32) r, hi = in(reg32) hi, lo = in(reg32) lo, options(pure, nomem, nostack))
    };
    r
}

/// `add.rn.f16x2 %r, a, b;` — packed half add (one rounding per lane).
#[inline(always)]
pub fn add_rn_f16x2(a: u32, b: u32) -> u32 {
    let r: u32;
    // SAFETY: register-only arithmetic (sm_53+).
    unsafe {
        asm!("add.rn.f16x2 {r}, {a}, {b};", r = out(reg32) r, a = in(reg32) a, b = in(reg32) b, options(pure, nomem, nostack))
    };
    r
}

/// `fma.rn.bf16x2 %r, a, 1.0, b;` — packed bf16 add. Written as an fma with
/// 1.0 because `add.bf16x2` needs sm_90 and this must assemble for sm_80.
#[inline(always)]
pub fn add_rn_bf16x2(a: u32, b: u32) -> u32 {
    let r: u32;
    // SAFETY: register-only arithmetic (sm_80+). 0x3F803F80 is bf16x2 (1.0, 1.0).
    unsafe {
        asm!("fma.rn.bf16x2 {r}, {a}, {one}, {b};", r = out(reg32) r, a = in(reg32) a, one = in(reg32) 0x3F80_3F80u32, b = in(reg32) b, options(pure, nomem, nostack))
    };
    r
}

/// `sqrt.rn.f32 %f, x;` (IEEE square root, round to nearest even).
#[inline(always)]
pub fn sqrt_rn_f32(x: f32) -> f32 {
    let r: f32;
    // SAFETY: register-only arithmetic.
    unsafe { asm!("sqrt.rn.f32 {r}, {x};", r = out(reg32) r, x = in(reg32) x, options(pure, nomem, nostack)) };
    r
}

// ---------------------------------------------------------------- block reductions (fused epilogue)

/// `shfl.sync.bfly.b32 %r, v, lane_mask, 0x1f, 0xffffffff;` — `v` of lane
/// `laneid ^ lane_mask`. Every lane of the warp must execute it together
/// (block-uniform control flow, full warps).
#[inline(always)]
pub fn shfl_sync_bfly_f32(v: f32, lane_mask: u32) -> f32 {
    let r: f32;
    // SAFETY: a warp-synchronous register exchange, no memory access; the
    // callers run it with every lane of the warp converged.
    unsafe {
        asm!("shfl.sync.bfly.b32 {r}, {v}, {m}, 0x1f, 0xffffffff;", r = out(reg32) r, v = in(reg32) v, m = in(reg32) lane_mask, options(nomem, nostack))
    };
    r
}

/// Shared-window address of the block-reduction scratch: 32 f32 (two
/// buffers of 16 warp partials), declared by this asm block as
/// `.shared .align 16 .b8 [128]` (ptxas allocates one per kernel that
/// uses it). Call it once at kernel entry and pass the address on.
#[inline(always)]
pub fn reduction_scratch() -> u32 {
    let a: u32;
    // SAFETY: declares a block-scoped shared array and takes its address.
    unsafe {
        asm!("{{ .shared .align 16 .b8 tp_reduction_scratch[256];", "mov.u32 {a}, tp_reduction_scratch; }}", a = out(reg32) a, options(pure, nomem, nostack))
    };
    a
}

/// `st.shared.f32 [addr], v;` (`addr`: a shared-window address)
#[inline(always)]
pub unsafe fn st_shared_f32(addr: u32, v: f32) {
    asm!("st.shared.f32 [{a}], {v};", a = in(reg32) addr, v = in(reg32) v, options(nostack));
}

/// `ld.shared.v4.f32 {a,b,c,d}, [addr];` (`addr` 16-byte aligned, shared
/// window; `readonly`, ordered after `bar.sync` by the barrier's clobber)
#[inline(always)]
pub unsafe fn ld_shared_v4_f32(addr: u32) -> [f32; 4] {
    let (a, b, c, d): (f32, f32, f32, f32);
    asm!("ld.shared.v4.f32 {{{a}, {b}, {c}, {d}}}, [{p}];", p = in(reg32) addr, a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, options(nostack, readonly));
    [a, b, c, d]
}

// ---------------------------------------------------------------- waits and traps

/// `nanosleep.u32 ns;` — back off inside a long spin (sm_70+).
#[inline(always)]
pub fn nanosleep(ns: u32) {
    // SAFETY: suspends the thread for about `ns` nanoseconds.
    unsafe { asm!("nanosleep.u32 {n};", n = in(reg32) ns, options(nomem, nostack)) };
}

/// `trap;` — abort the kernel; the host sees a launch failure.
#[inline(always)]
pub fn trap() -> ! {
    // SAFETY: `trap` never returns.
    unsafe { nvptx::trap() }
}

// ---------------------------------------------------------------- clusters (sm_90+)

mod cluster;
pub use cluster::*;
