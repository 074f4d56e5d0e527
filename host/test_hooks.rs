//! Failure injection for the test suite: exported (hidden) with the
//! `testing` feature only, never part of the library API. Each hook is a guard that
//! is active while it lives; hooks are process-wide, so tests that use them
//! must not initialise communicators concurrently (the GPU tests hold a
//! lock). Without a live hook every query below answers "no".

#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

const NONE: usize = usize::MAX;
static FAIL_REGION_IMPORT_ON_RANK: AtomicUsize = AtomicUsize::new(NONE);
static WRONG_P2P_CHECK_SALT_ON_RANK: AtomicUsize = AtomicUsize::new(NONE);
static NO_P2P_ACROSS_ISLANDS: AtomicBool = AtomicBool::new(false);
static KERNEL_PUBLICATION: AtomicBool = AtomicBool::new(false);
static NO_CE_HANDSHAKE_ON_RANK: AtomicUsize = AtomicUsize::new(NONE);

/// While alive, rank `rank` of every communicator initialised in this
/// process fails to map its peers' regions over the P2P transport, as a
/// failing `cuIpcOpenMemHandle` would (init step 4).
pub struct FailRegionImport(());

impl FailRegionImport {
    pub fn on_rank(rank: usize) -> FailRegionImport {
        FAIL_REGION_IMPORT_ON_RANK.store(rank, Ordering::SeqCst);
        FailRegionImport(())
    }
}

impl Drop for FailRegionImport {
    fn drop(&mut self) {
        FAIL_REGION_IMPORT_ON_RANK.store(NONE, Ordering::SeqCst);
    }
}

/// While alive, rank `rank` runs the P2P transfer check over the P2P
/// transport (init step 5) with another salt than its peers: its patterns
/// and flags are not the ones they expect, as if the link corrupted them.
pub struct CorruptP2pCheck(());

impl CorruptP2pCheck {
    pub fn on_rank(rank: usize) -> CorruptP2pCheck {
        WRONG_P2P_CHECK_SALT_ON_RANK.store(rank, Ordering::SeqCst);
        CorruptP2pCheck(())
    }
}

impl Drop for CorruptP2pCheck {
    fn drop(&mut self) {
        WRONG_P2P_CHECK_SALT_ON_RANK.store(NONE, Ordering::SeqCst);
    }
}

/// While alive, every communicator initialised in this process sees no P2P
/// access between ranks of different islands (init step 2), as on a
/// dual-socket host whose cross-socket P2P is unsupported: it settles on
/// the per-pair transport when its islands allow it.
pub struct NoP2pAcrossIslands(());

impl NoP2pAcrossIslands {
    pub fn new() -> NoP2pAcrossIslands {
        NO_P2P_ACROSS_ISLANDS.store(true, Ordering::SeqCst);
        NoP2pAcrossIslands(())
    }
}

impl Default for NoP2pAcrossIslands {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for NoP2pAcrossIslands {
    fn drop(&mut self) {
        NO_P2P_ACROSS_ISLANDS.store(false, Ordering::SeqCst);
    }
}

/// While alive, the copy-engine ring of every communicator initialised in
/// this process raises its flags with the one-thread publish kernel, as on
/// a device without stream memory operations.
pub struct KernelPublication(());

impl KernelPublication {
    pub fn new() -> KernelPublication {
        KERNEL_PUBLICATION.store(true, Ordering::SeqCst);
        KernelPublication(())
    }
}

impl Default for KernelPublication {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for KernelPublication {
    fn drop(&mut self) {
        KERNEL_PUBLICATION.store(false, Ordering::SeqCst);
    }
}

/// While alive, rank `rank` of every communicator initialised in this
/// process never tells its previous rank in the copy-engine ring that its
/// staging is free again (as a rank that died after a call would): that
/// rank's next call waits for the handshake until its timeout.
pub struct NoCopyEngineHandshake(());

impl NoCopyEngineHandshake {
    pub fn on_rank(rank: usize) -> NoCopyEngineHandshake {
        NO_CE_HANDSHAKE_ON_RANK.store(rank, Ordering::SeqCst);
        NoCopyEngineHandshake(())
    }
}

impl Drop for NoCopyEngineHandshake {
    fn drop(&mut self) {
        NO_CE_HANDSHAKE_ON_RANK.store(NONE, Ordering::SeqCst);
    }
}

/// Whether rank `rank` publishes its copy-engine ring handshakes.
pub(crate) fn copy_engine_handshake(rank: usize) -> bool {
    NO_CE_HANDSHAKE_ON_RANK.load(Ordering::SeqCst) != rank
}

/// Whether P2P between different islands must look unsupported.
pub(crate) fn no_p2p_across_islands() -> bool {
    NO_P2P_ACROSS_ISLANDS.load(Ordering::SeqCst)
}

/// Whether the copy-engine ring must publish with the kernel.
pub(crate) fn kernel_publication() -> bool {
    KERNEL_PUBLICATION.load(Ordering::SeqCst)
}

/// Whether rank `rank`'s region imports must fail.
pub(crate) fn region_import_fails(rank: usize) -> bool {
    FAIL_REGION_IMPORT_ON_RANK.load(Ordering::SeqCst) == rank
}

/// The salt rank `rank`'s check kernel runs with.
pub(crate) fn p2p_check_kernel_salt(rank: usize, salt: u32) -> u32 {
    if WRONG_P2P_CHECK_SALT_ON_RANK.load(Ordering::SeqCst) == rank {
        salt ^ 0x5a5a_5a5a
    } else {
        salt
    }
}
