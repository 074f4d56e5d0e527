//! The PTX that `build.rs` embedded, one per architecture, and the pure
//! rules for choosing one for a device. (Which entries the PTX must have:
//! `algorithm::entries`.)

#![forbid(unsafe_code)]

mod index {
    include!(concat!(env!("OUT_DIR"), "/ptx_index.rs"));
}

pub use index::{KERNEL_SOURCES_HASH, PTX_ORIGIN, PTX_RUSTC_VERSION};

/// One embedded PTX module.
#[derive(Clone, Copy, Debug)]
pub struct EmbeddedPtx {
    /// `sm_120`, `sm_90`, ...
    pub arch: &'static str,
    /// Compute capability as `major * 10 + minor` (120, 90, 89, 80).
    pub sm: u32,
    pub text: &'static str,
}

/// Every embedded PTX module, highest architecture first.
pub fn embedded() -> Vec<EmbeddedPtx> {
    let mut all: Vec<EmbeddedPtx> =
        index::EMBEDDED_PTX.iter().map(|&(arch, sm, text)| EmbeddedPtx { arch, sm, text }).collect();
    all.sort_by_key(|p| std::cmp::Reverse(p.sm));
    all
}

/// The embedded PTX for `arch` (`"sm_90"`), if built.
pub fn for_arch(arch: &str) -> Option<EmbeddedPtx> {
    embedded().into_iter().find(|p| p.arch == arch)
}

/// The PTX to load on a device of compute capability `major.minor`: the
/// highest embedded architecture not above the device's (an exact match
/// runs as compiled; a lower one is JIT-compiled by the driver, e.g. sm_90
/// PTX on an sm_100 part). `None` if the device is older than every build.
///
/// Within one major version a higher minor is not always a superset (sm_90a,
/// sm_120a features), but the plain `sm_XY` targets we emit are forward
/// compatible through PTX JIT.
pub fn choose(major: u32, minor: u32) -> Option<EmbeddedPtx> {
    let sm = major * 10 + minor;
    embedded().into_iter().find(|p| p.sm <= sm)
}

/// Lowest compute capability (`major * 10 + minor`) whose PTX has the
/// cluster entries (`algorithm::entries::cluster_entries`; thread-block
/// clusters: sm_90).
pub const CLUSTER_MIN_SM: u32 = 90;
