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
    let all = super::all_gather_counted(rdv, &mine)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A rendezvous of the user's that answers with the wrong count.
    struct Short(usize);

    impl Rendezvous for Short {
        fn rank(&self) -> usize {
            0
        }
        fn world_size(&self) -> usize {
            3
        }
        fn all_gather(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
            Ok(vec![mine.to_vec(); self.0])
        }
    }

    /// A user's `Rendezvous` that gathers fewer or more parts than ranks
    /// (none at all included) is a protocol error, not an index panic.
    #[test]
    fn a_gather_with_the_wrong_count_is_a_protocol_error() {
        for count in [0, 1, 2, 4] {
            let err = all_gather_json(&Short(count), &7u32).expect_err("the wrong count accepted");
            assert!(matches!(err, Error::Protocol { .. }), "{count}: {err}");
            assert!(err.to_string().contains(&format!("{count} part")), "{count}: {err}");
        }
        assert_eq!(all_gather_json(&Short(3), &7u32).unwrap(), [7, 7, 7]);
        // What `Comm::from_rendezvous` wraps a user's rendezvous in.
        let err = super::super::Counted(Box::new(Short(1))).all_gather(b"x").unwrap_err();
        assert!(matches!(err, Error::Protocol { .. }), "{err}");
        assert_eq!(super::super::Counted(Box::new(Short(3))).all_gather(b"x").unwrap().len(), 3);
    }
}
