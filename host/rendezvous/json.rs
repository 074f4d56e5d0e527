//! Structured all-gathers: each rank's value encoded as JSON, every rank's
//! value decoded in rank order. Init and registration exchange their
//! records this way; the rendezvous itself carries bytes only.

#![forbid(unsafe_code)]

use serde::{de::DeserializeOwned, Serialize};

use super::Rendezvous;
use crate::error::{Error, Result};

/// Collective: every rank's `value`, in rank order. A rank whose bytes do
/// not decode is named in the error.
pub(crate) fn all_gather_json<T: Serialize + DeserializeOwned>(rdv: &dyn Rendezvous, value: &T) -> Result<Vec<T>> {
    let mine = serde_json::to_vec(value).map_err(|e| Error::Rendezvous(format!("encoding init data: {e}")))?;
    let all = rdv.all_gather(&mine)?;
    all.iter()
        .enumerate()
        .map(|(rank, bytes)| {
            serde_json::from_slice(bytes).map_err(|e| Error::Protocol {
                from: format!("rank {rank}"),
                what: format!("undecodable init data: {e}"),
            })
        })
        .collect()
}
