//! The init-time P2P transfer check, host side: launch the `p2p_check`
//! kernel (a known-pattern self-test of the real protocol, see
//! `kernels-rs/src/device/p2p_check.rs`), read what it observed, name every
//! pair that failed, and all-gather the findings so every rank decides the
//! same (fall back to host staging, or fail).

#![forbid(unsafe_code)]

use std::collections::BTreeSet;
use std::mem::offset_of;
use std::sync::Arc;

use cudarc::driver::CudaStream;
use serde::{Deserialize, Serialize};
use tp_allreduce_kernels::layout::{p2p_flag, p2p_pattern, LocalState, SignalBlock, MAX_RANKS, P2P_CHECK_WORDS};

use crate::driver::{self, CurrentContext, DeviceMemory, KernelModule};
use crate::error::Result;
use crate::rendezvous::{all_gather_json, Rendezvous};

/// One pair on which a transport attempt failed: `rank` could not use what
/// `peer` offered (for an export failure, `peer == rank`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub(crate) struct TransportProblem {
    pub rank: usize,
    pub peer: usize,
    pub what: String,
}

impl std::fmt::Display for TransportProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "rank {} <- rank {}: {}", self.rank, self.peer, self.what)
    }
}

/// What one rank's check kernel left behind, per source rank.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Observed {
    /// Last value of `p2p_flag[src]` the kernel saw.
    pub flag_seen: Vec<u32>,
    /// Words of src's burst read wrong after its flag (device count).
    pub pushed_bad: Vec<u32>,
    /// Words of src's outbox read wrong after its flag (device count).
    pub pulled_bad: Vec<u32>,
    /// `inbox[src]` as it finally landed (read after the kernel).
    pub inbox: Vec<Vec<u32>>,
}

/// Runs the check on this rank's region (`base` = its signal block) and
/// returns every rank's problems (the same list on every rank).
pub(crate) fn run(
    stream: &Arc<CudaStream>,
    module: &KernelModule,
    (base, local_state, handle): (u64, u64, &DeviceMemory),
    (rank, world): (usize, usize),
    rdv: &dyn Rendezvous,
    salts: (u32, u32),
) -> Result<Vec<TransportProblem>> {
    let everyone: Vec<usize> = (0..world).collect();
    run_among(stream, module, (base, local_state, handle), (rank, world), &everyone, rdv, salts)
}

/// [`run`] among a subset of the ranks (the per-pair transport checks each
/// island): `handle` is renumbered to them (`rank` is this rank's index
/// among `ranks`, `world` their count) and `ranks[i]` names local index `i`
/// in the problems. Every rank of the communicator calls it at once (the
/// rendezvous steps are the communicator's).
pub(crate) fn run_among(
    stream: &Arc<CudaStream>,
    module: &KernelModule,
    (base, local_state, handle): (u64, u64, &DeviceMemory),
    (rank, world): (usize, usize),
    ranks: &[usize],
    rdv: &dyn Rendezvous,
    (salt, kernel_salt): (u32, u32),
) -> Result<Vec<TransportProblem>> {
    // Every rank has mapped every region (the exchange before this ended
    // with an all-gather), so the bursts land in mapped, zeroed memory. The
    // kernels wait for each other (bounded by the communicator's timeout):
    // start them together, behind no earlier work of the callers' streams.
    driver::synchronize(stream)?;
    rdv.barrier()?;
    // (`kernel_salt` differs from `salt` only under a test hook.)
    module.launch_p2p_check(stream, handle, kernel_salt)?;
    driver::synchronize(stream)?;
    let observed = read_observed(stream, base, local_state, world)?;
    let mine: Vec<TransportProblem> = problems(rank, world, salt, &observed)
        .into_iter()
        .map(|p| TransportProblem { rank: ranks[p.rank], peer: ranks[p.peer], what: p.what })
        .collect();
    // After this all-gather every rank's kernel has finished: nobody reads
    // or writes a region any more when the caller drops it.
    let all: Vec<Vec<TransportProblem>> = all_gather_json(rdv, &mine)?;
    Ok(all.into_iter().flatten().collect())
}

fn read_observed(stream: &Arc<CudaStream>, base: u64, local_state: u64, world: usize) -> Result<Observed> {
    let _bound = CurrentContext::bind(stream.context())?;
    let mut counters = vec![0u32; 3 * MAX_RANKS];
    // The three per-source arrays are adjacent in `LocalState`.
    const _: () = assert!(
        offset_of!(LocalState, p2p_pushed_bad) == offset_of!(LocalState, p2p_flag_seen) + 4 * MAX_RANKS
            && offset_of!(LocalState, p2p_pulled_bad) == offset_of!(LocalState, p2p_pushed_bad) + 4 * MAX_RANKS
    );
    driver::memcpy_dtoh(
        bytemuck::cast_slice_mut(&mut counters),
        local_state + offset_of!(LocalState, p2p_flag_seen) as u64,
    )?;
    let mut inbox = vec![0u32; world * P2P_CHECK_WORDS];
    driver::memcpy_dtoh(bytemuck::cast_slice_mut(&mut inbox), base + offset_of!(SignalBlock, p2p_inbox) as u64)?;
    Ok(Observed {
        flag_seen: counters[..world].to_vec(),
        pushed_bad: counters[MAX_RANKS..MAX_RANKS + world].to_vec(),
        pulled_bad: counters[2 * MAX_RANKS..2 * MAX_RANKS + world].to_vec(),
        inbox: inbox.chunks(P2P_CHECK_WORDS).map(<[u32]>::to_vec).collect(),
    })
}

/// Every pair `rank <- src` the observations show broken, each named, in a
/// stable order. Pure: the decision is tested without a GPU.
pub(crate) fn problems(rank: usize, world: usize, salt: u32, seen: &Observed) -> Vec<TransportProblem> {
    let mut out: BTreeSet<(usize, String)> = BTreeSet::new();
    let words = P2P_CHECK_WORDS;
    for src in 0..world {
        let flag = seen.flag_seen.get(src).copied().unwrap_or(0);
        if flag != p2p_flag(src as u32, salt) {
            out.insert((
                src,
                format!("the flag rank {src} released after its data never arrived (saw {flag:#x} until the timeout)"),
            ));
            continue;
        }
        let landed = seen.inbox.get(src).map(Vec::as_slice).unwrap_or(&[]);
        let wrong_at_end = (0..words)
            .filter(|&w| landed.get(w).copied() != Some(p2p_pattern(src as u32, rank as u32, w as u32, salt)))
            .count();
        let read_wrong = seen.pushed_bad.get(src).copied().unwrap_or(0) as usize;
        if wrong_at_end > 0 {
            out.insert((src, format!("{wrong_at_end}/{words} words written by rank {src} arrived wrong")));
        } else if read_wrong > 0 {
            out.insert((
                src,
                format!(
                    "{read_wrong}/{words} words written by rank {src} arrived after its flag \
                     (read wrong after the flag, right afterwards: data-before-flag ordering is broken)"
                ),
            ));
        }
        let pulled_wrong = seen.pulled_bad.get(src).copied().unwrap_or(0);
        if pulled_wrong > 0 {
            out.insert((src, format!("{pulled_wrong}/{words} words read from rank {src} were wrong")));
        }
    }
    out.into_iter().map(|(peer, what)| TransportProblem { rank, peer, what }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const SALT: u32 = 0x5eed_1234;

    /// What a healthy check leaves on `rank`.
    fn healthy(rank: usize, world: usize) -> Observed {
        Observed {
            flag_seen: (0..world).map(|s| p2p_flag(s as u32, SALT)).collect(),
            pushed_bad: vec![0; world],
            pulled_bad: vec![0; world],
            inbox: (0..world)
                .map(|s| (0..P2P_CHECK_WORDS).map(|w| p2p_pattern(s as u32, rank as u32, w as u32, SALT)).collect())
                .collect(),
        }
    }

    fn described(p: &[TransportProblem]) -> Vec<String> {
        p.iter().map(|p| format!("{} <- {}: {}", p.rank, p.peer, p.what)).collect()
    }

    #[test]
    fn a_healthy_check_finds_nothing() {
        for world in 1..=MAX_RANKS {
            for rank in 0..world {
                assert!(problems(rank, world, SALT, &healthy(rank, world)).is_empty());
            }
        }
    }

    #[test]
    fn flags_are_salted_and_never_zero() {
        assert_ne!(p2p_flag(0, SALT), p2p_flag(0, SALT ^ 1), "a stale flag of another communicator must not pass");
        assert_ne!(p2p_flag(0, SALT), p2p_flag(1, SALT));
        assert!((0..64).all(|s| p2p_flag(s, SALT) != 0 && p2p_flag(s, s) != 0));
    }

    #[test]
    fn a_missing_flag_names_the_pair() {
        let mut seen = healthy(1, 3);
        seen.flag_seen[2] = 0;
        let p = problems(1, 3, SALT, &seen);
        assert_eq!((p.len(), p[0].rank, p[0].peer), (1, 1, 2), "{:?}", described(&p));
        assert!(p[0].what.contains("never arrived"), "{:?}", described(&p));
        // A flag from another communicator (other salt) is not this one's.
        seen.flag_seen[2] = p2p_flag(2, SALT ^ 0x10);
        assert_eq!(problems(1, 3, SALT, &seen).len(), 1);
    }

    #[test]
    fn corrupted_and_lost_words_are_counted() {
        let mut seen = healthy(0, 2);
        seen.inbox[1][17] ^= 0x100; // one corrupted word
        seen.inbox[1][4095] = 0; // one lost word (zeroed memory)
        seen.pushed_bad[1] = 2;
        let p = described(&problems(0, 2, SALT, &seen));
        assert_eq!(p, ["0 <- 1: 2/4096 words written by rank 1 arrived wrong"]);
    }

    #[test]
    fn data_landing_after_its_flag_is_an_ordering_failure() {
        // Read wrong by the kernel after the flag, right by the time the host looks.
        let mut seen = healthy(2, 4);
        seen.pushed_bad[3] = 5;
        let p = described(&problems(2, 4, SALT, &seen));
        assert_eq!(p.len(), 1, "{p:?}");
        assert!(p[0].starts_with("2 <- 3: 5/4096 words written by rank 3 arrived after its flag"), "{p:?}");
    }

    #[test]
    fn wrong_pulled_words_name_the_source() {
        let mut seen = healthy(0, 3);
        seen.pulled_bad[1] = 4096;
        seen.pulled_bad[2] = 1;
        let p = described(&problems(0, 3, SALT, &seen));
        assert_eq!(
            p,
            ["0 <- 1: 4096/4096 words read from rank 1 were wrong", "0 <- 2: 1/4096 words read from rank 2 were wrong"]
        );
    }
}
