//! What the pull algorithms (OneShotPull, TwoShotPull) share on the host:
//! their side of a rank and the launches of a call. A pull kernel reads
//! every peer's *input*, so each launch names where the peers' inputs are:
//! a device-table entry of every rank's registered buffer (read in place),
//! or of every rank's staging buffer, into which the launch's input is
//! copied first (`PeerInput`, resolved by the call pipeline). Kernels take
//! `(handle, peer_inputs, peer_offset, output, count)`.

#![forbid(unsafe_code)]

use tp_allreduce_kernels::ids::AlgorithmId;
use tp_allreduce_kernels::layout::THREADS_PER_BLOCK;
use tp_allreduce_kernels::partition::packs_for;

use super::launch::{chunks, entry_name, ByDtype, Call, Grid, Issue, Launch, PeerInput, RankSetup};
use super::{AlgorithmHost, Geometry};
use crate::driver::{Kernel, KernelArgs};
use crate::error::{Error, Result};

/// A pull algorithm's side of one rank.
pub(crate) struct PullRank {
    pub host: &'static dyn AlgorithmHost,
    pub geometry: Geometry,
    /// The rank's `DeviceHandle`.
    pub handle: u64,
    pub kernels: ByDtype<Kernel>,
}

impl PullRank {
    pub fn new(host: &'static dyn AlgorithmHost, rank: &RankSetup<'_>) -> Result<PullRank> {
        let id: AlgorithmId = host.kernel();
        Ok(PullRank {
            host,
            geometry: rank.geometry,
            handle: rank.handle,
            kernels: ByDtype::kernels(rank.module, |d| entry_name(id, d))?,
        })
    }

    /// The launches of `call`: launches of at most a staging buffer each
    /// (the staging holds a whole launch), each input staged first unless
    /// peers read it in place.
    pub fn run(&self, call: &Call, issue: &mut Issue<'_>) -> Result<()> {
        let kernel = self.kernels.get(call.dtype);
        let elem = call.dtype.size_bytes();
        for (start, n) in chunks(call.count, call.dtype, self.host.launch_capacity_packs(&self.geometry)) {
            let (blocks, threads) = self.host.launch_shape(&self.geometry, packs_for(n as u64, call.dtype));
            let off = (start * elem) as u64;
            let (entry, peer_offset) = peer_entry(call.peer_input, call.input + off, n * elem, off, issue)?;
            let args =
                KernelArgs::new().u64(self.handle).u64(entry).u64(peer_offset).u64(call.output + off).u64(n as u64);
            // The table entry's addresses are filled (or zero, which the
            // kernel refuses); the grid is the same on every rank (the
            // barriers pair blocks across ranks).
            debug_assert_eq!(threads, THREADS_PER_BLOCK);
            issue(Launch::Args { kernel, grid: Grid::new(blocks, threads), args: &args })?;
        }
        Ok(())
    }
}

/// The table entry peers read a launch's input through, and the input's
/// offset there: staged (the launch's `bytes` from `input` copied into
/// staging first, offset 0) or registered (in place, offset `offset`).
pub(crate) fn peer_entry(
    peer_input: PeerInput,
    input: u64,
    bytes: usize,
    offset: u64,
    issue: &mut Issue<'_>,
) -> Result<(u64, u64)> {
    match peer_input {
        PeerInput::Staged { staging, entry } => {
            issue(Launch::Copy { dst: staging, src: input, bytes })?;
            Ok((entry, 0))
        }
        PeerInput::Registered { entry } => Ok((entry, offset)),
        PeerInput::Local => Err(Error::invalid("a pull call without a peer-visible input (host bug)")),
    }
}
