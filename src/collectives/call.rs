//! The descriptor by which the ranks of a group agree on a collective before any data moves:
//! which collective, its sizes, root, reduction or sub-group. Every backend builds a [`Call`]
//! per collective; the thread backend compares them in shared memory, the MPI and NCCL
//! backends all-gather them as an [`Announcement`] of fixed-size words. One type, so that every
//! backend compares the same fields and words a mismatch the same way.
// The wire encoding is used only by the MPI and NCCL backends.
#![cfg_attr(
    not(any(test, feature = "mpi", all(feature = "nccl", target_os = "linux"))),
    allow(dead_code)
)]

use super::{args, ReduceOp};
use crate::tensor::DType;
use std::fmt;

/// One rank's collective call, as compared across ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Call {
    AllGatherInto {
        len: usize,
    },
    Broadcast {
        root: usize,
        len: usize,
    },
    /// `len`: this rank's length (per rank, not compared).
    AllGatherBytes {
        len: usize,
    },
    /// `len`: the root's length (0 on other ranks; not compared).
    BroadcastBytes {
        root: usize,
        len: usize,
    },
    GatherInto {
        root: usize,
        len: usize,
    },
    /// `recv_len`: checked against the root's part lengths, not across ranks.
    ScatterInto {
        root: usize,
        recv_len: usize,
    },
    ReduceScatterInto {
        len: usize,
        dtype: DType,
        op: ReduceOp,
    },
    AllReduce {
        len: usize,
        dtype: DType,
        op: ReduceOp,
    },
    Barrier,
    NewSubgroup(Members),
}

/// The ranks of a sub-group as compared across ranks: their number and
/// [`args::subgroup_digest`] (what travels between processes), and the list itself when this
/// rank built the call (shown in messages). Equal when number and digest are.
#[derive(Debug, Clone, Eq)]
pub(crate) struct Members {
    pub(crate) len: usize,
    pub(crate) digest: u64,
    listed: Option<Vec<usize>>,
}

impl Members {
    /// The members `ranks`, in order.
    pub(crate) fn of(ranks: &[usize]) -> Self {
        Members {
            len: ranks.len(),
            digest: args::subgroup_digest(ranks),
            listed: Some(ranks.to_vec()),
        }
    }
}

impl PartialEq for Members {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.digest == other.digest
    }
}

/// Every [`ReduceOp`], indexed in the encoding.
const REDUCE_OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max];

/// `dtype` and `op` as one word.
fn reduction_code(dtype: DType, op: ReduceOp) -> u64 {
    let d = DType::ALL
        .iter()
        .position(|&x| x == dtype)
        .unwrap_or(0xff_ffff);
    let o = REDUCE_OPS.iter().position(|&x| x == op).unwrap_or(0xff);
    ((d as u64) << 8) | o as u64
}

fn reduction_of(code: u64) -> Option<(DType, ReduceOp)> {
    let d = usize::try_from(code >> 8).ok()?;
    Some((
        *DType::ALL.get(d)?,
        *REDUCE_OPS.get((code & 0xff) as usize)?,
    ))
}

impl Call {
    /// The collective's name, as the trait method.
    pub(crate) fn name(&self) -> &'static str {
        match self {
            Call::AllGatherInto { .. } => "all_gather_into",
            Call::Broadcast { .. } => "broadcast",
            Call::AllGatherBytes { .. } => "all_gather_bytes",
            Call::BroadcastBytes { .. } => "broadcast_bytes",
            Call::GatherInto { .. } => "gather_into",
            Call::ScatterInto { .. } => "scatter_into",
            Call::ReduceScatterInto { .. } => "reduce_scatter_into",
            Call::AllReduce { .. } => "all_reduce",
            Call::Barrier => "barrier",
            Call::NewSubgroup(_) => "new_subgroup",
        }
    }

    /// Whether two ranks' calls can complete together (lengths that are per rank ignored).
    pub(crate) fn same_call(&self, other: &Call) -> bool {
        use Call::*;
        match (self, other) {
            (AllGatherBytes { .. }, AllGatherBytes { .. }) => true,
            (BroadcastBytes { root: a, .. }, BroadcastBytes { root: b, .. }) => a == b,
            (ScatterInto { root: a, .. }, ScatterInto { root: b, .. }) => a == b,
            (a, b) => a == b,
        }
    }

    /// `[code, a, b]` (a sub-group travels as its number of ranks and digest).
    pub(crate) fn encode(&self) -> [u64; 3] {
        use Call::*;
        let w = |x: usize| x as u64;
        match self {
            AllGatherInto { len } => [1, w(*len), 0],
            Broadcast { root, len } => [2, w(*root), w(*len)],
            AllGatherBytes { len } => [3, w(*len), 0],
            BroadcastBytes { root, len } => [4, w(*root), w(*len)],
            GatherInto { root, len } => [5, w(*root), w(*len)],
            ScatterInto { root, recv_len } => [6, w(*root), w(*recv_len)],
            Barrier => [7, 0, 0],
            NewSubgroup(m) => [8, w(m.len), m.digest],
            ReduceScatterInto { len, dtype, op } => [9, w(*len), reduction_code(*dtype, *op)],
            AllReduce { len, dtype, op } => [10, w(*len), reduction_code(*dtype, *op)],
        }
    }

    /// The call `encode` gave `w`, or `None` for words no call encodes to.
    pub(crate) fn decode(w: [u64; 3]) -> Option<Call> {
        use Call::*;
        let u = |x: u64| usize::try_from(x).ok();
        Some(match w[0] {
            1 => AllGatherInto { len: u(w[1])? },
            2 => Broadcast {
                root: u(w[1])?,
                len: u(w[2])?,
            },
            3 => AllGatherBytes { len: u(w[1])? },
            4 => BroadcastBytes {
                root: u(w[1])?,
                len: u(w[2])?,
            },
            5 => GatherInto {
                root: u(w[1])?,
                len: u(w[2])?,
            },
            6 => ScatterInto {
                root: u(w[1])?,
                recv_len: u(w[2])?,
            },
            7 => Barrier,
            8 => NewSubgroup(Members {
                len: u(w[1])?,
                digest: w[2],
                listed: None,
            }),
            9 => {
                let (dtype, op) = reduction_of(w[2])?;
                ReduceScatterInto {
                    len: u(w[1])?,
                    dtype,
                    op,
                }
            }
            10 => {
                let (dtype, op) = reduction_of(w[2])?;
                AllReduce {
                    len: u(w[1])?,
                    dtype,
                    op,
                }
            }
            _ => return None,
        })
    }
}

impl fmt::Display for Call {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = self.name();
        match self {
            Call::AllGatherInto { len } => write!(f, "{name}({len} bytes)"),
            Call::Broadcast { root, len } | Call::GatherInto { root, len } => {
                write!(f, "{name}(root={root}, {len} bytes)")
            }
            Call::BroadcastBytes { root, .. } | Call::ScatterInto { root, .. } => {
                write!(f, "{name}(root={root})")
            }
            Call::NewSubgroup(m) => match &m.listed {
                Some(ranks) => write!(f, "{name}(ranks={ranks:?})"),
                None => write!(f, "{name}({} ranks, digest {:016x})", m.len, m.digest),
            },
            Call::ReduceScatterInto { len, dtype, op } | Call::AllReduce { len, dtype, op } => {
                write!(f, "{name}({op} over {dtype}, {len} bytes)")
            }
            Call::AllGatherBytes { .. } | Call::Barrier => write!(f, "{name}"),
        }
    }
}

/// What each rank contributes to the descriptor exchange of the MPI and NCCL backends: its
/// call, whether its local arguments are valid, and its message limit (MPI; 0 elsewhere),
/// all-gathered as [`Announcement::BYTES`] bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Announcement {
    pub(crate) call: Call,
    pub(crate) valid: bool,
    pub(crate) max_message: u64,
}

impl Announcement {
    /// Words of one encoded announcement.
    const WORDS: usize = 5;
    /// Bytes of one encoded announcement (little-endian words).
    pub(crate) const BYTES: usize = 8 * Self::WORDS;

    fn encode(&self) -> [u64; Self::WORDS] {
        let [code, a, b] = self.call.encode();
        [code, a, b, u64::from(!self.valid), self.max_message]
    }

    /// The announcement `encode` gave `w` (at least [`Announcement::WORDS`] words).
    fn decode(w: &[u64]) -> Option<Announcement> {
        Some(Announcement {
            call: Call::decode([*w.first()?, *w.get(1)?, *w.get(2)?])?,
            valid: *w.get(3)? == 0,
            max_message: *w.get(4)?,
        })
    }

    /// The bytes every rank all-gathers: the words, little-endian.
    pub(crate) fn to_bytes(&self) -> [u8; Self::BYTES] {
        let mut out = [0u8; Self::BYTES];
        for (dst, w) in out.chunks_exact_mut(8).zip(self.encode()) {
            dst.copy_from_slice(&w.to_le_bytes());
        }
        out
    }

    /// The announcement `to_bytes` gave `bytes`, or `None` for bytes it cannot have given.
    pub(crate) fn from_bytes(bytes: &[u8]) -> Option<Announcement> {
        if bytes.len() != Self::BYTES {
            return None;
        }
        let words: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
            .collect();
        Self::decode(&words)
    }

    /// Whether two ranks' announcements can complete together (validity aside).
    pub(crate) fn agrees_with(&self, other: &Announcement) -> bool {
        self.call.same_call(&other.call) && self.max_message == other.max_message
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn every_call() -> Vec<Call> {
        vec![
            Call::AllGatherInto { len: 8 },
            Call::Broadcast { root: 1, len: 3 },
            Call::AllGatherBytes { len: 5 },
            Call::BroadcastBytes { root: 2, len: 9 },
            Call::GatherInto { root: 0, len: 4 },
            Call::ScatterInto {
                root: 3,
                recv_len: 7,
            },
            Call::Barrier,
            Call::NewSubgroup(Members::of(&[0, 2])),
            Call::ReduceScatterInto {
                len: 12,
                dtype: DType::BF16,
                op: ReduceOp::Avg,
            },
            Call::AllReduce {
                len: 3,
                dtype: DType::Bool,
                op: ReduceOp::Max,
            },
        ]
    }

    #[test]
    fn announcements_round_trip_through_words_and_bytes() {
        for call in every_call() {
            for valid in [true, false] {
                let a = Announcement {
                    call: call.clone(),
                    valid,
                    max_message: 77,
                };
                assert_eq!(Announcement::decode(&a.encode()), Some(a.clone()));
                assert_eq!(Announcement::from_bytes(&a.to_bytes()), Some(a));
            }
        }
        for dtype in DType::ALL {
            for op in REDUCE_OPS {
                let call = Call::AllReduce { len: 2, dtype, op };
                assert_eq!(Call::decode(call.encode()), Some(call));
            }
        }
    }

    #[test]
    fn unknown_words_decode_to_nothing() {
        assert_eq!(Announcement::decode(&[99, 0, 0, 0, 0]), None);
        assert_eq!(Announcement::decode(&[1, 0, 0]), None, "too short");
        assert_eq!(Call::decode([9, 4, 0xff]), None, "unknown reduction");
        assert_eq!(Announcement::from_bytes(&[0u8; 39]), None);
    }

    #[test]
    fn calls_print_name_sizes_root_reduction_and_members() {
        let shown: Vec<String> = every_call().iter().map(Call::to_string).collect();
        assert_eq!(
            shown,
            [
                "all_gather_into(8 bytes)",
                "broadcast(root=1, 3 bytes)",
                "all_gather_bytes",
                "broadcast_bytes(root=2)",
                "gather_into(root=0, 4 bytes)",
                "scatter_into(root=3)",
                "barrier",
                "new_subgroup(ranks=[0, 2])",
                "reduce_scatter_into(avg over torch.bfloat16, 12 bytes)",
                "all_reduce(max over torch.bool, 3 bytes)",
            ]
        );
        // A sub-group received from another process shows what travelled.
        let received = Call::decode(Call::NewSubgroup(Members::of(&[0, 2])).encode()).unwrap();
        assert_eq!(
            received.to_string(),
            format!(
                "new_subgroup(2 ranks, digest {:016x})",
                args::subgroup_digest(&[0, 2])
            )
        );
        for call in every_call() {
            assert!(call.to_string().starts_with(call.name()), "{call}");
        }
    }

    #[test]
    fn per_rank_lengths_are_not_compared_but_everything_else_is() {
        let same = |a: Call, b: Call| a.same_call(&b);
        assert!(same(
            Call::AllGatherBytes { len: 1 },
            Call::AllGatherBytes { len: 9 }
        ));
        assert!(same(
            Call::BroadcastBytes { root: 1, len: 5 },
            Call::BroadcastBytes { root: 1, len: 0 }
        ));
        assert!(!same(
            Call::BroadcastBytes { root: 1, len: 5 },
            Call::BroadcastBytes { root: 0, len: 5 }
        ));
        assert!(same(
            Call::ScatterInto {
                root: 0,
                recv_len: 3
            },
            Call::ScatterInto {
                root: 0,
                recv_len: 4
            }
        ));
        assert!(!same(
            Call::AllGatherInto { len: 1 },
            Call::AllGatherInto { len: 2 }
        ));
        assert!(!same(Call::Barrier, Call::AllGatherInto { len: 0 }));
        let reduce = |dtype| Call::AllReduce {
            len: 8,
            dtype,
            op: ReduceOp::Sum,
        };
        assert!(!same(reduce(DType::F32), reduce(DType::I32)));
        // Sub-groups compare by members and order, whether listed or received.
        let members = |r: &[usize]| Call::NewSubgroup(Members::of(r));
        assert!(same(members(&[0, 1]), members(&[0, 1])));
        assert!(!same(members(&[0, 1]), members(&[1, 0])));
        assert!(!same(members(&[0, 1]), members(&[0, 2])));
        let received = Call::decode(members(&[0, 1]).encode()).unwrap();
        assert!(same(received, members(&[0, 1])));
    }

    #[test]
    fn announcements_agree_on_the_call_and_the_message_limit() {
        let a = |call, max_message| Announcement {
            call,
            valid: true,
            max_message,
        };
        let gather = |len| Call::AllGatherBytes { len };
        assert!(a(gather(1), 8).agrees_with(&a(gather(2), 8)));
        assert!(!a(gather(1), 8).agrees_with(&a(gather(1), 4)));
        let invalid = Announcement {
            valid: false,
            ..a(gather(1), 8)
        };
        assert!(
            invalid.agrees_with(&a(gather(1), 8)),
            "validity is separate"
        );
    }
}
