//! Why a process group stopped working, shared by the backends so that every backend reports
//! a failure with the same error, worded the same way.

use crate::error::Error;
use std::time::Duration;

/// The first failure of a group; every later call on any rank is refused with it.
#[derive(Debug, Clone)]
pub(crate) enum FailureKind {
    /// Peers did not arrive in time.
    Timeout {
        /// The collective that timed out.
        op: &'static str,
        /// How long the rank waited.
        waited: Duration,
        /// Ranks that never arrived.
        missing: Vec<usize>,
    },
    /// A rank left the group.
    PeerDied {
        /// The rank that left.
        peer: usize,
    },
    /// Ranks called different collectives or passed incompatible arguments.
    Mismatch {
        /// What differed.
        detail: String,
    },
    /// One rank passed invalid arguments.
    Invalid {
        /// The collective it called.
        op: &'static str,
        /// The rank at fault.
        rank: usize,
        /// What was wrong.
        reason: String,
    },
}

impl FailureKind {
    /// The error `rank` gets for calling `op`; `same_round` when that call is the one that
    /// failed, otherwise it is refused because of the earlier failure.
    pub(crate) fn error(&self, op: &str, rank: usize, same_round: bool) -> Error {
        match self {
            FailureKind::Timeout {
                op: failed,
                waited,
                missing,
            } => Error::CollectiveTimeout {
                op: if same_round {
                    op.into()
                } else {
                    format!("{op} (refused: the group failed earlier when {failed} timed out)")
                },
                rank,
                waited: *waited,
                missing: missing.clone(),
            },
            FailureKind::PeerDied { peer } => Error::PeerDied {
                op: op.into(),
                rank,
                peer: *peer,
            },
            FailureKind::Mismatch { detail } => Error::CollectiveMismatch {
                rank,
                detail: if same_round {
                    detail.clone()
                } else {
                    format!("{op} refused: the group failed earlier: {detail}")
                },
            },
            FailureKind::Invalid {
                op: failed,
                rank: culprit,
                reason,
            } => Error::InvalidCollective {
                op: op.into(),
                rank,
                reason: format!(
                    "{}rank {culprit} passed invalid arguments to {failed}: {reason}",
                    if same_round {
                        ""
                    } else {
                        "the group failed earlier: "
                    }
                ),
            },
        }
    }
}
