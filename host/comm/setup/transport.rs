//! Which transport init tries first and what it does after a step that
//! tested it found problems, the same on every rank (the problems are
//! all-gathered). Pure: tested on the CPU (`setup/tests.rs`).

#![forbid(unsafe_code)]

use super::super::p2p_check::TransportProblem;
use super::per_pair;
use crate::algorithm::{IslandSplit, Transport};
use crate::config::TransportPreference;
use crate::error::{Error, Result};

/// Which init step found transport problems.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Step {
    /// Step 4: mapping the peers' regions (IPC open, shared memory, peer access).
    Map,
    /// Step 5: the P2P transfer check.
    Check,
}

/// What init does after a step that tests the transport.
#[derive(Debug)]
pub(crate) enum Verdict {
    /// No problem: keep this transport.
    Keep,
    /// `Auto` on P2P: every rank switches to host staging, for this reason.
    FallBack(String),
    /// Forced transport, or host staging failed too: every rank fails.
    Fail(Error),
}

/// The decision after `step` found `problems` (all-gathered, so every rank
/// decides alike). Pure.
pub(crate) fn verdict(
    preference: TransportPreference,
    transport: Transport,
    step: Step,
    problems: &[TransportProblem],
) -> Verdict {
    let Some(first) = problems.first() else {
        return Verdict::Keep;
    };
    let listed = problems.iter().map(ToString::to_string).collect::<Vec<_>>().join("; ");
    let what = match step {
        Step::Map => "mapping the peers' regions",
        Step::Check => "the P2P transfer check",
    };
    match (preference, transport) {
        (TransportPreference::Auto, Transport::PeerToPeer | Transport::PerPair) => {
            Verdict::FallBack(format!("{what} failed ({listed}): host-staged transport"))
        }
        _ => Verdict::Fail(match step {
            Step::Check => Error::P2pCheck { rank: first.rank, peer: first.peer, what: listed },
            Step::Map => Error::Ipc(format!(
                "rank {} could not map the region of rank {} over the {transport} transport ({listed}){}",
                first.rank,
                first.peer,
                if preference == TransportPreference::Auto { "" } else { "; the transport is forced by configuration" }
            )),
        }),
    }
}

/// The transport to try first, from the pairs without P2P access and the
/// islands: P2P everywhere, else per pair (P2P inside islands) when only
/// pairs across islands lack it, else host-staged. Pure.
pub(crate) fn initial_transport(
    preference: TransportPreference,
    unreachable: &[(usize, usize)],
    split: Option<IslandSplit>,
) -> Result<(Transport, String)> {
    match preference {
        TransportPreference::Force(Transport::PeerToPeer) if !unreachable.is_empty() => Err(Error::Unsupported(
            format!("P2P transport forced, but these rank pairs have no P2P access: {unreachable:?}"),
        )),
        TransportPreference::Force(Transport::PerPair)
            if !split.is_some_and(|s| s.splits() && unreachable.iter().all(|&(a, b)| !s.together(a, b))) =>
        {
            Err(Error::Unsupported(format!(
                "per-pair transport forced, but it needs islands whose members all reach each other over P2P \
                 (islands: {}; pairs without P2P: {unreachable:?})",
                split.map_or("none".to_string(), |s| s.to_string())
            )))
        }
        TransportPreference::Force(t) => Ok((t, format!("forced to {t} by configuration"))),
        TransportPreference::Auto if unreachable.is_empty() => {
            Ok((Transport::PeerToPeer, "every pair reports P2P access".to_string()))
        }
        TransportPreference::Auto if per_pair::fits(unreachable, split) => Ok((
            Transport::PerPair,
            format!("no P2P access between ranks {unreachable:?}, all across islands: P2P inside islands, host-staged across"),
        )),
        TransportPreference::Auto => {
            Ok((Transport::HostStaged, format!("no P2P access between ranks {unreachable:?}: host-staged transport")))
        }
    }
}
