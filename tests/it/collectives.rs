//! Scenarios for the in-process thread backend of `ProcessGroup`: data movement, sub-groups,
//! and how ranks fail together (mismatch, timeout, a peer that dies, poisoned groups).

use crate::common;

use common::conformance::{self, Reductions};
use fsdp::collectives::{ProcessGroup, ProcessGroupExt, ReduceOp, ThreadGroup, ThreadProcessGroup};
use fsdp::DType;
use fsdp::Error;
use serde::{Deserialize, Serialize};
use std::panic::{self, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::thread;
use std::time::Duration;

/// Long enough that a test which wrongly waits for the timeout would be noticed, and whose
/// error would be `CollectiveTimeout` rather than the variant the test expects.
const LONG: Duration = Duration::from_secs(30);

/// A payload that differs per rank and per byte.
fn payload(rank: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (rank * 31 + i * 7) as u8).collect()
}

/// Runs `f` on every rank of a group with `timeout`, like `ThreadGroup::run`, but returns a
/// panicking rank's outcome as `None` instead of resuming the panic.
fn run_allowing_panics<R: Send>(
    world_size: usize,
    timeout: Duration,
    f: impl Fn(ThreadProcessGroup) -> R + Sync,
) -> Vec<Option<R>> {
    let f = &f;
    thread::scope(|s| {
        let threads: Vec<_> = ThreadGroup::with_timeout(world_size, timeout)
            .into_iter()
            .map(|pg| s.spawn(move || f(pg)))
            .collect();
        threads.into_iter().map(|t| t.join().ok()).collect()
    })
}

#[test]
fn thread_groups_of_1_to_4_ranks_pass_the_conformance_suite() {
    for world_size in 1..=4 {
        ThreadGroup::run_with_timeout(world_size, LONG, |pg| {
            conformance::run(&pg, Reductions::RankOrder, "thread group");
        });
    }
}

#[test]
fn all_gather_into_places_each_ranks_payload_at_its_offset_for_world_sizes_1_to_5() {
    for world_size in 1..=5 {
        let len = 13;
        let gathered = ThreadGroup::run(world_size, |pg| {
            let mut recv = vec![0u8; len * world_size];
            pg.all_gather_into(&payload(pg.rank(), len), &mut recv)
                .map(|()| recv)
        });
        let expected: Vec<u8> = (0..world_size).flat_map(|r| payload(r, len)).collect();
        for (rank, recv) in gathered.into_iter().enumerate() {
            assert_eq!(
                recv.unwrap(),
                expected,
                "world size {world_size}, rank {rank}"
            );
        }
    }
}

#[test]
fn all_gather_into_of_64_mib_arrives_intact_on_every_rank() {
    let world_size = 4;
    let shard = 16 << 20; // 4 ranks x 16 MiB = 64 MiB gathered per rank
    let fill = |rank: usize, i: usize| {
        (i as u32)
            .wrapping_mul(2_654_435_761)
            .wrapping_add(rank as u32) as u8
    };
    let ok = ThreadGroup::run(world_size, |pg| {
        let send: Vec<u8> = (0..shard).map(|i| fill(pg.rank(), i)).collect();
        let mut recv = vec![0u8; shard * world_size];
        pg.all_gather_into(&send, &mut recv).unwrap();
        recv.chunks_exact(shard)
            .enumerate()
            .all(|(peer, chunk)| chunk.iter().enumerate().all(|(i, &b)| b == fill(peer, i)))
    });
    assert_eq!(ok, [true; 4]);
}

#[test]
fn broadcast_copies_the_roots_buffer_to_every_rank_for_each_root() {
    let world_size = 4;
    for root in 0..world_size {
        let received = ThreadGroup::run(world_size, |pg| {
            let mut buf = if pg.rank() == root {
                payload(root, 16)
            } else {
                vec![0u8; 16]
            };
            pg.broadcast(&mut buf, root).map(|()| buf)
        });
        for (rank, buf) in received.into_iter().enumerate() {
            assert_eq!(buf.unwrap(), payload(root, 16), "root {root}, rank {rank}");
        }
    }
}

#[test]
fn gather_into_fills_only_the_roots_buffer_for_each_root_and_world_sizes_1_to_5() {
    for world_size in 1..=5 {
        for root in 0..world_size {
            let len = 11;
            let gathered = ThreadGroup::run(world_size, |pg| {
                let mut recv = vec![0u8; len * world_size];
                let mine = (pg.rank() == root).then_some(&mut recv[..]);
                pg.gather_into(&payload(pg.rank(), len), mine, root)
                    .map(|()| recv)
            });
            let expected: Vec<u8> = (0..world_size).flat_map(|r| payload(r, len)).collect();
            for (rank, recv) in gathered.into_iter().enumerate() {
                let recv = recv.unwrap();
                if rank == root {
                    assert_eq!(recv, expected, "world size {world_size}, root {root}");
                } else {
                    assert!(recv.iter().all(|&b| b == 0), "rank {rank} was written");
                }
            }
        }
    }
}

#[test]
fn scatter_into_sends_each_rank_its_own_length_and_parts_may_alias() {
    for world_size in 1..=5 {
        let root = world_size / 2;
        // Rank r receives r + 3 bytes; with `alias` every rank gets the same 7 bytes.
        for alias in [false, true] {
            let len_of = |r: usize| if alias { 7 } else { r + 3 };
            let parts: Vec<Vec<u8>> = (0..world_size).map(|r| payload(r, len_of(r))).collect();
            let received = ThreadGroup::run(world_size, |pg| {
                let mut recv = vec![0u8; len_of(pg.rank())];
                let views: Vec<&[u8]> = if alias {
                    vec![&parts[0][..]; world_size]
                } else {
                    parts.iter().map(Vec::as_slice).collect()
                };
                let send = (pg.rank() == root).then_some(&views[..]);
                pg.scatter_into(send, &mut recv, root).map(|()| recv)
            });
            for (rank, recv) in received.into_iter().enumerate() {
                let want = if alias { &parts[0] } else { &parts[rank] };
                assert_eq!(&recv.unwrap(), want, "world size {world_size}, rank {rank}");
            }
        }
    }
}

#[test]
fn a_scatter_where_the_root_keeps_nothing_delivers_every_byte_of_the_large_parts() {
    // As FSDP2's broadcast_from_rank0 scatters: the root receives an empty part and the
    // others large, uneven ones; the ranks share the copying, across part boundaries.
    for world_size in 2..=4 {
        let len_of = |r: usize| if r == 0 { 0 } else { 4099 * r + 17 };
        let parts: Vec<Vec<u8>> = (0..world_size).map(|r| payload(r, len_of(r))).collect();
        let received = ThreadGroup::run(world_size, |pg| {
            let mut recv = vec![0u8; len_of(pg.rank())];
            let views: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
            let send = (pg.rank() == 0).then_some(&views[..]);
            pg.scatter_into(send, &mut recv, 0).map(|()| recv)
        });
        for (rank, recv) in received.into_iter().enumerate() {
            assert_eq!(
                recv.unwrap(),
                parts[rank],
                "world size {world_size}, rank {rank}"
            );
        }
    }
}

#[test]
fn a_scatter_part_that_does_not_fit_its_receiver_fails_every_rank_naming_it() {
    let results = ThreadGroup::run_with_timeout(3, LONG, |pg| {
        let parts: Vec<&[u8]> = vec![&[1, 2], &[3, 4, 5], &[6, 7]];
        let mut recv = vec![0u8; 2]; // rank 1 should receive 3 bytes
        let send = (pg.rank() == 0).then_some(&parts[..]);
        pg.scatter_into(send, &mut recv, 0)
    });
    for (rank, result) in results.into_iter().enumerate() {
        assert_mismatch(
            &result.unwrap_err(),
            rank,
            &[
                "scatter_into(root=0)",
                "rank 1 receives 2 bytes but root 0 sends it 3",
            ],
        );
    }
}

#[test]
fn gather_and_scatter_roots_must_pass_their_buffers() {
    // One group each: the first failure poisons a group.
    let gathers =
        ThreadGroup::run_with_timeout(2, LONG, |pg| pg.gather_into(&[1, 2], None, 1).unwrap_err());
    let scatters = ThreadGroup::run_with_timeout(2, LONG, |pg| {
        pg.scatter_into(None, &mut [0u8; 1], 0).unwrap_err()
    });
    for (rank, (gather, scatter)) in gathers.into_iter().zip(scatters).enumerate() {
        for (err, op, reason) in [
            (gather, "gather_into", "must pass a receive buffer"),
            (scatter, "scatter_into", "must pass the parts"),
        ] {
            let Error::InvalidCollective {
                op: o, reason: r, ..
            } = &err
            else {
                panic!("rank {rank}: expected InvalidCollective, got {err:?}");
            };
            assert!(
                o.starts_with(op) && r.contains(reason),
                "rank {rank}: {err}"
            );
        }
    }
}

#[test]
fn all_gather_bytes_returns_variable_length_messages_in_rank_order() {
    let gathered = ThreadGroup::run(3, |pg| {
        pg.all_gather_bytes(&payload(pg.rank(), pg.rank() * 5))
    });
    for result in gathered {
        assert_eq!(
            result.unwrap(),
            vec![payload(0, 0), payload(1, 5), payload(2, 10)]
        );
    }
}

#[test]
fn broadcast_bytes_length_is_decided_by_the_root() {
    let received = ThreadGroup::run(3, |pg| {
        let mine = payload(pg.rank(), 100);
        let send = (pg.rank() == 1).then_some(&mine[..37]);
        pg.broadcast_bytes(send, 1)
    });
    for bytes in received {
        assert_eq!(bytes.unwrap(), payload(1, 37));
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct ShardMeta {
    rank: usize,
    name: String,
    numels: Vec<u64>,
    step: Option<f32>,
}

fn meta(rank: usize) -> ShardMeta {
    ShardMeta {
        rank,
        name: format!("layer{rank}.weight"),
        numels: (0..rank as u64).collect(),
        step: (rank % 2 == 0).then_some(rank as f32 + 0.5),
    }
}

#[test]
fn all_gather_object_and_broadcast_object_exchange_a_struct() {
    let results = ThreadGroup::run(3, |pg| {
        let all = pg.all_gather_object(&meta(pg.rank()))?;
        let mine = meta(pg.rank());
        let from_root = pg.broadcast_object((pg.rank() == 2).then_some(&mine), 2)?;
        Ok::<_, Error>((all, from_root))
    });
    for result in results {
        let (all, from_root) = result.unwrap();
        assert_eq!(all, vec![meta(0), meta(1), meta(2)]);
        assert_eq!(from_root, meta(2));
    }
}

#[test]
fn barrier_releases_no_rank_before_every_rank_arrived() {
    let arrived = AtomicUsize::new(0);
    let seen = ThreadGroup::run(4, |pg| {
        // Stagger the arrivals so that early ranks really wait.
        thread::sleep(Duration::from_millis(10 * pg.rank() as u64));
        arrived.fetch_add(1, Ordering::SeqCst);
        pg.barrier().unwrap();
        arrived.load(Ordering::SeqCst)
    });
    assert_eq!(seen, [4; 4]);
}

#[test]
fn even_ranks_subgroup_gathers_while_odd_ranks_do_nothing() {
    let results = ThreadGroup::run(4, |pg| {
        let Some(evens) = pg.new_subgroup(&[0, 2]).unwrap() else {
            return None; // odd ranks call nothing on the sub-group
        };
        let mut recv = vec![0u8; 2 * 3];
        evens
            .all_gather_into(&payload(pg.rank(), 3), &mut recv)
            .unwrap();
        Some(recv)
    });
    let expected: Vec<u8> = [payload(0, 3), payload(2, 3)].concat();
    assert_eq!(
        results,
        [Some(expected.clone()), None, Some(expected), None]
    );
}

#[test]
fn subgroup_ranks_are_positions_in_the_list() {
    let numbering = ThreadGroup::run(4, |pg| {
        pg.new_subgroup(&[3, 1])
            .unwrap()
            .map(|sub| (sub.rank(), sub.world_size(), sub.backend()))
    });
    assert_eq!(
        numbering,
        [None, Some((1, 2, "threads")), None, Some((0, 2, "threads"))]
    );
}

#[test]
fn subgroup_and_parent_are_independent_and_subgroups_nest() {
    let results = ThreadGroup::run(4, |pg| {
        let upper = pg.new_subgroup(&[1, 2, 3]).unwrap();
        // The parent keeps working while the sub-group exists.
        let parent_ranks = pg.all_gather_object(&pg.rank()).unwrap();
        let Some(upper) = upper else {
            return (parent_ranks, None);
        };
        let pair = upper.new_subgroup(&[1, 2]).unwrap(); // parent ranks 2 and 3
        let inner = pair.map(|pair| pair.all_gather_object(&pg.rank()).unwrap());
        (parent_ranks, Some(inner))
    });
    let world: Vec<usize> = (0..4).collect();
    assert_eq!(
        results,
        [
            (world.clone(), None),
            (world.clone(), Some(None)),
            (world.clone(), Some(Some(vec![2, 3]))),
            (world, Some(Some(vec![2, 3]))),
        ]
    );
}

fn assert_mismatch(err: &Error, rank: usize, mentions: &[&str]) {
    let Error::CollectiveMismatch { rank: r, detail } = err else {
        panic!("rank {rank}: expected CollectiveMismatch, got {err:?}");
    };
    assert_eq!(*r, rank);
    for m in mentions {
        assert!(
            detail.contains(m),
            "rank {rank}: `{detail}` does not mention `{m}`"
        );
    }
}

#[test]
fn mismatched_ops_fail_every_rank_with_collective_mismatch_naming_both_ops() {
    let errors = ThreadGroup::run_with_timeout(3, LONG, |pg| {
        if pg.rank() == 1 {
            pg.broadcast(&mut [0u8; 16], 0)
        } else {
            pg.all_gather_into(&[0u8; 8], &mut [0u8; 24])
        }
    });
    for (rank, result) in errors.into_iter().enumerate() {
        assert_mismatch(
            &result.unwrap_err(),
            rank,
            &["rank 1 called broadcast(root=0, 16 bytes) while rank 0 called all_gather_into(8 bytes)"],
        );
    }
}

#[test]
fn differing_send_lengths_roots_or_subgroup_lists_are_mismatches() {
    let lengths = ThreadGroup::run_with_timeout(2, LONG, |pg| {
        let n = 4 + pg.rank();
        pg.all_gather_into(&vec![0u8; n], &mut vec![0u8; 2 * n])
    });
    for (rank, result) in lengths.into_iter().enumerate() {
        assert_mismatch(
            &result.unwrap_err(),
            rank,
            &["all_gather_into(5 bytes)", "all_gather_into(4 bytes)"],
        );
    }

    let roots = ThreadGroup::run_with_timeout(2, LONG, |pg| pg.broadcast(&mut [0u8; 4], pg.rank()));
    for (rank, result) in roots.into_iter().enumerate() {
        assert_mismatch(
            &result.unwrap_err(),
            rank,
            &["broadcast(root=1, 4 bytes)", "broadcast(root=0, 4 bytes)"],
        );
    }

    let lists = ThreadGroup::run_with_timeout(3, LONG, |pg| {
        let ranks: &[usize] = if pg.rank() == 2 { &[0, 2] } else { &[0, 1] };
        pg.new_subgroup(ranks).map(|g| g.is_some())
    });
    for (rank, result) in lists.into_iter().enumerate() {
        assert_mismatch(
            &result.unwrap_err(),
            rank,
            &["new_subgroup(ranks=[0, 2])", "new_subgroup(ranks=[0, 1])"],
        );
    }
}

#[test]
fn a_rank_that_never_calls_makes_the_others_time_out_naming_it() {
    let world_size = 3;
    let callers_ready = Barrier::new(2); // ranks 0 and 1 call together, well within the timeout
    let others_done = Barrier::new(world_size);
    let results = ThreadGroup::run_with_timeout(world_size, Duration::from_millis(200), |pg| {
        let first = if pg.rank() == 2 {
            None // keeps its handle alive but does not call
        } else {
            callers_ready.wait();
            Some(pg.all_gather_into(&[1], &mut [0u8; 3]).unwrap_err())
        };
        others_done.wait();
        // Arriving late, or calling again, fails at once instead of waiting another timeout.
        (first, pg.barrier().unwrap_err())
    });
    for (rank, (first, later)) in results.into_iter().enumerate() {
        if let Some(err) = first {
            assert!(
                matches!(&err, Error::CollectiveTimeout { op, rank: r, missing, .. }
                    if op == "all_gather_into" && *r == rank && *missing == [2]),
                "rank {rank}: {err:?}"
            );
        }
        // Ranks 0 and 1 are told their barrier was refused because of the earlier timeout;
        // rank 2's barrier is its first call, the one that came too late.
        let Error::CollectiveTimeout { op, missing, .. } = &later else {
            panic!("rank {rank}: expected CollectiveTimeout, got {later:?}");
        };
        assert!(op.starts_with("barrier"), "rank {rank}: {op}");
        assert!(
            rank == 2 || op.contains("all_gather_into timed out"),
            "rank {rank}: {op}"
        );
        assert_eq!(*missing, [2], "rank {rank}");
    }
}

#[test]
fn a_rank_that_panics_before_calling_makes_its_peers_fail_with_peer_died() {
    let results = run_allowing_panics(3, LONG, |pg| {
        if pg.rank() == 1 {
            panic!("rank 1 fails while building its shard");
        }
        pg.all_gather_into(&[0u8; 4], &mut [0u8; 12]).unwrap_err()
    });
    assert!(results[1].is_none(), "rank 1 panicked");
    for rank in [0, 2] {
        let err = results[rank].as_ref().unwrap();
        assert_eq!(
            *err,
            Error::PeerDied {
                op: "all_gather_into".into(),
                rank,
                peer: 1
            },
            "rank {rank}"
        );
    }
}

#[test]
fn a_peer_dying_while_others_wait_wakes_them_with_peer_died() {
    let results = run_allowing_panics(3, LONG, |pg| {
        if pg.rank() == 2 {
            thread::sleep(Duration::from_millis(100)); // let the others start waiting
            panic!("rank 2 dies mid-run");
        }
        pg.barrier().unwrap_err()
    });
    for rank in [0, 1] {
        let err = results[rank].as_ref().unwrap();
        assert_eq!(
            *err,
            Error::PeerDied {
                op: "barrier".into(),
                rank,
                peer: 2
            }
        );
    }
}

#[test]
fn a_rank_that_drops_its_handle_early_makes_later_calls_fail_with_peer_died() {
    let results = ThreadGroup::run_with_timeout(2, LONG, |pg| {
        pg.barrier().unwrap();
        if pg.rank() == 1 {
            return Vec::new(); // leaves the group: its handle is dropped here
        }
        (0..3)
            .map(|_| pg.all_gather_bytes(b"x").unwrap_err())
            .collect()
    });
    for err in &results[0] {
        assert_eq!(
            *err,
            Error::PeerDied {
                op: "all_gather_bytes".into(),
                rank: 0,
                peer: 1
            }
        );
    }
}

#[test]
fn run_resumes_a_ranks_panic_after_the_peers_got_peer_died() {
    let peer_errors = Mutex::new(Vec::new());
    let caught = panic::catch_unwind(AssertUnwindSafe(|| {
        ThreadGroup::run_with_timeout(2, LONG, |pg| {
            if pg.rank() == 0 {
                panic!("rank 0 gives up");
            }
            peer_errors.lock().unwrap().push(pg.barrier().unwrap_err());
        })
    }));
    let payload = caught.unwrap_err();
    assert_eq!(payload.downcast_ref::<&str>(), Some(&"rank 0 gives up"));
    assert_eq!(
        *peer_errors.lock().unwrap(),
        [Error::PeerDied {
            op: "barrier".into(),
            rank: 1,
            peer: 0
        }]
    );
}

#[test]
fn after_a_mismatch_every_later_call_fails_fast_on_every_rank() {
    let results = ThreadGroup::run_with_timeout(3, LONG, |pg| {
        let first = if pg.rank() == 0 {
            pg.barrier()
        } else {
            pg.broadcast(&mut [0u8; 2], 0)
        };
        let later = [
            pg.barrier().unwrap_err(),
            pg.all_gather_into(&[1], &mut [0u8; 3]).unwrap_err(),
        ];
        (first.unwrap_err(), later)
    });
    for (rank, (first, later)) in results.into_iter().enumerate() {
        assert_mismatch(
            &first,
            rank,
            &["rank 1 called broadcast(root=0, 2 bytes) while rank 0 called barrier"],
        );
        // The variant shows the call was refused at once: waiting would have timed out instead.
        for err in &later {
            assert_mismatch(err, rank, &["refused", "rank 1 called broadcast"]);
        }
    }
}

#[test]
fn invalid_arguments_on_one_rank_fail_its_peers_too() {
    let results = ThreadGroup::run_with_timeout(3, LONG, |pg| {
        let recv_len = if pg.rank() == 1 { 5 } else { 6 }; // rank 1 sizes recv wrongly
        pg.all_gather_into(&[0u8; 2], &mut vec![0u8; recv_len])
            .unwrap_err()
    });
    for (rank, err) in results.into_iter().enumerate() {
        let Error::InvalidCollective {
            op,
            rank: r,
            reason,
        } = &err
        else {
            panic!("rank {rank}: expected InvalidCollective, got {err:?}");
        };
        assert_eq!((op.as_str(), *r), ("all_gather_into", rank));
        assert!(reason.contains("recv has 5 bytes"), "rank {rank}: {reason}");
    }
}

#[test]
fn a_failure_in_a_subgroup_leaves_the_parent_group_working() {
    let results = ThreadGroup::run_with_timeout(4, LONG, |pg| {
        if let Some(evens) = pg.new_subgroup(&[0, 2]).unwrap() {
            let err = if evens.rank() == 0 {
                evens.barrier()
            } else {
                evens.broadcast(&mut [0], 0)
            };
            assert!(matches!(err, Err(Error::CollectiveMismatch { .. })));
        }
        pg.all_gather_object(&pg.rank()).unwrap()
    });
    assert_eq!(results, vec![vec![0, 1, 2, 3]; 4]);
}

#[test]
fn a_thousand_small_all_gathers_stay_in_step() {
    let world_size = 4;
    let mismatches = ThreadGroup::run(world_size, |pg| {
        let mut recv = [0u8; 8];
        let mut wrong = 0;
        for i in 0..1000u32 {
            let send = [pg.rank() as u8, i as u8];
            pg.all_gather_into(&send, &mut recv).unwrap();
            let expected: Vec<u8> = (0..world_size).flat_map(|r| [r as u8, i as u8]).collect();
            wrong += usize::from(recv[..] != expected[..]);
        }
        wrong
    });
    assert_eq!(mismatches, [0; 4]);
}

#[test]
fn mixed_collectives_in_a_loop_stay_in_step() {
    let shared = Arc::new(AtomicUsize::new(0));
    let totals = ThreadGroup::run(3, |pg| {
        let mut total = 0usize;
        for i in 0..200usize {
            match i % 4 {
                0 => pg.barrier().unwrap(),
                1 => {
                    total += pg
                        .all_gather_object(&(pg.rank() + i))
                        .unwrap()
                        .iter()
                        .sum::<usize>()
                }
                2 => {
                    let root = i % 3;
                    let mut buf = [pg.rank() as u8; 3];
                    pg.broadcast(&mut buf, root).unwrap();
                    total += usize::from(buf[0]);
                }
                _ => {
                    total += pg
                        .broadcast_bytes(Some(&[1; 9][..i % 10]), 0)
                        .unwrap()
                        .len()
                }
            }
        }
        shared.fetch_add(1, Ordering::SeqCst);
        total
    });
    assert_eq!(shared.load(Ordering::SeqCst), 3);
    assert!(totals.iter().all(|&t| t == totals[0]), "{totals:?}");
}

/// A group that forwards everything to a thread rank except `reduce_scatter_into` and
/// `all_reduce`, so that those run the trait's provided (all-gather based) implementations.
struct ProvidedReductions(ThreadProcessGroup);

impl ProcessGroup for ProvidedReductions {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world_size(&self) -> usize {
        self.0.world_size()
    }
    fn all_gather_into(&self, send: &[u8], recv: &mut [u8]) -> fsdp::Result<()> {
        self.0.all_gather_into(send, recv)
    }
    fn broadcast(&self, buf: &mut [u8], root: usize) -> fsdp::Result<()> {
        self.0.broadcast(buf, root)
    }
    fn all_gather_bytes(&self, send: &[u8]) -> fsdp::Result<Vec<Vec<u8>>> {
        self.0.all_gather_bytes(send)
    }
    fn broadcast_bytes(&self, send: Option<&[u8]>, root: usize) -> fsdp::Result<Vec<u8>> {
        self.0.broadcast_bytes(send, root)
    }
    fn gather_into(&self, send: &[u8], recv: Option<&mut [u8]>, root: usize) -> fsdp::Result<()> {
        self.0.gather_into(send, recv, root)
    }
    fn scatter_into(
        &self,
        send: Option<&[&[u8]]>,
        recv: &mut [u8],
        root: usize,
    ) -> fsdp::Result<()> {
        self.0.scatter_into(send, recv, root)
    }
    fn barrier(&self) -> fsdp::Result<()> {
        self.0.barrier()
    }
    fn new_subgroup(&self, ranks: &[usize]) -> fsdp::Result<Option<Arc<dyn ProcessGroup>>> {
        self.0.new_subgroup(ranks)
    }
    fn backend(&self) -> &'static str {
        "provided"
    }
}

/// Rank `r`'s gradient-like contribution: `chunks * per_chunk` f32 values, distinct per rank.
fn grads(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((rank * 7 + i * 13) % 29) as f32 * 0.37 - 3.1 + rank as f32 * 1e-3)
        .collect()
}

#[test]
fn reduce_scatter_sums_each_ranks_chunk_in_rank_order_on_threads_and_the_provided_impl() {
    for ws in 1..=4 {
        let n = 5; // f32 elements per rank's chunk
        let expected: Vec<Vec<f32>> = (0..ws)
            .map(|r| {
                (0..n)
                    .map(|i| {
                        (0..ws)
                            .map(|p| grads(p, n * ws)[r * n + i])
                            .fold(None, |acc: Option<f32>, v| Some(acc.map_or(v, |a| a + v)))
                            .unwrap()
                    })
                    .collect()
            })
            .collect();
        let reduce = |pg: &dyn ProcessGroup| -> fsdp::Result<Vec<f32>> {
            let send = grads(pg.rank(), n * ws);
            let mut recv = vec![0u8; n * 4];
            pg.reduce_scatter_into(
                bytemuck::cast_slice(&send),
                &mut recv,
                DType::F32,
                ReduceOp::Sum,
            )?;
            Ok(bytemuck::pod_collect_to_vec(&recv))
        };
        let direct = ThreadGroup::run(ws, |pg| reduce(&pg));
        let provided = ThreadGroup::run(ws, |pg| reduce(&ProvidedReductions(pg)));
        for r in 0..ws {
            let (d, p) = (direct[r].as_ref().unwrap(), provided[r].as_ref().unwrap());
            // Bit-exact: same rank order on both paths.
            assert_eq!(
                d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                expected[r].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "ws {ws} rank {r}"
            );
            assert_eq!(
                p.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                d.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }
}

#[test]
fn all_reduce_averages_and_takes_the_max_on_every_rank() {
    let out = ThreadGroup::run(3, |pg| -> fsdp::Result<(Vec<f64>, Vec<i64>)> {
        let pg = ProvidedReductions(pg);
        let r = pg.rank() as f64;
        let mut avg: Vec<u8> = bytemuck::cast_slice(&[r, 10.0 * r]).to_vec();
        pg.all_reduce(&mut avg, DType::F64, ReduceOp::Avg)?;
        let mut max: Vec<u8> = bytemuck::cast_slice(&[pg.rank() as i64 * 5 - 4]).to_vec();
        pg.all_reduce(&mut max, DType::I64, ReduceOp::Max)?;
        Ok((
            bytemuck::pod_collect_to_vec(&avg),
            bytemuck::pod_collect_to_vec(&max),
        ))
    });
    for res in out {
        let (avg, max) = res.unwrap();
        assert_eq!(avg, [1.0, 10.0]);
        assert_eq!(max, [6]);
    }
}

#[test]
fn reduce_scatter_with_a_different_dtype_on_one_rank_fails_every_rank() {
    let out = ThreadGroup::run_with_timeout(3, LONG, |pg| {
        let dtype = if pg.rank() == 2 {
            DType::I32
        } else {
            DType::F32
        };
        let mut recv = [0u8; 8];
        pg.reduce_scatter_into(&[0u8; 24], &mut recv, dtype, ReduceOp::Sum)
    });
    for (rank, res) in out.into_iter().enumerate() {
        assert_mismatch(
            &res.unwrap_err(),
            rank,
            &["reduce_scatter_into", "torch.int32"],
        );
    }
}

#[test]
fn reduce_scatter_with_a_wrong_send_length_or_bool_sum_is_invalid_not_a_panic() {
    for (send_len, dtype) in [(20usize, DType::F32), (24, DType::Bool)] {
        let out = ThreadGroup::run_with_timeout(3, LONG, |pg| {
            let mut recv = [0u8; 8];
            pg.reduce_scatter_into(&vec![0u8; send_len], &mut recv, dtype, ReduceOp::Sum)
        });
        for res in out {
            assert!(
                matches!(res, Err(Error::InvalidCollective { ref op, .. }) if op == "reduce_scatter_into"),
                "{res:?}"
            );
        }
    }
}
