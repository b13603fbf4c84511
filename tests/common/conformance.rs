//! The conformance suite every `ProcessGroup` backend passes: each trait method with uneven and
//! empty sizes, every root, sub-groups, object exchange, reductions over every dtype and
//! operation, and the argument errors of `collectives/args.rs`, matched by variant and fields.
//!
//! Run on the thread backend by tests/it/collectives.rs, under `mpirun` by tests/mpi/worker.rs,
//! and on NCCL (where a GPU exists) by tests/nccl.rs. Every function is collective: call it on
//! every rank of the group. Expected values are computed here, independently of any backend; a
//! difference panics naming the case, the rank and the backend.

use fsdp::collectives::{reduce_parts, ProcessGroup, ProcessGroupExt, ReduceOp};
use fsdp::{DType, Error};
use half::{bf16, f16};
use std::sync::Arc;

/// How a backend's reductions relate to [`reduce_parts`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reductions {
    /// Bit-identical to [`reduce_parts`] (values combined in rank order): threads, MPI.
    RankOrder,
    /// The backend's own order (NCCL): bit-identical where the order cannot matter (integers,
    /// max, sums of small integers), float averages and sums of fractions within a tolerance.
    BackendOrder,
}

/// The whole suite on `pg` (which stays usable: failures happen in fresh sub-groups).
pub fn run(pg: &dyn ProcessGroup, reductions: Reductions, what: &str) {
    data_movement(pg, what);
    reductions_of_every_dtype(pg, reductions, what);
    objects_and_agreement(pg, what);
    subgroups(pg, what);
    argument_errors(pg, what);
    pg.barrier().unwrap();
}

/// Rank `r`'s deterministic test bytes.
pub fn bytes(r: usize, len: usize, salt: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ (r as u8).wrapping_mul(7) ^ salt)
        .collect()
}

/// all_gather_into, broadcast, gather_into, all_gather_bytes, broadcast_bytes, scatter_into,
/// barrier: empty, one byte, uneven lengths, every root that differs from another.
pub fn data_movement(pg: &dyn ProcessGroup, what: &str) {
    let (rank, ws) = (pg.rank(), pg.world_size());
    let what = format!("{what} ({} rank {rank} of {ws})", pg.backend());
    let roots = if ws == 1 { vec![0] } else { vec![0, ws - 1] };
    for n in [0usize, 1, 23, 4096 + 3] {
        let mut recv = vec![0u8; n * ws];
        pg.all_gather_into(&bytes(rank, n, 1), &mut recv).unwrap();
        let want: Vec<u8> = (0..ws).flat_map(|r| bytes(r, n, 1)).collect();
        assert_eq!(recv, want, "{what}: all_gather_into of {n} bytes");

        for &root in &roots {
            let mut buf = if rank == root {
                bytes(root, n, 2)
            } else {
                vec![0; n]
            };
            pg.broadcast(&mut buf, root).unwrap();
            assert_eq!(buf, bytes(root, n, 2), "{what}: broadcast from {root}");

            let mut recv = vec![0u8; n * ws];
            let recv_arg = (rank == root).then_some(&mut recv[..]);
            pg.gather_into(&bytes(rank, n, 3), recv_arg, root).unwrap();
            let want: Vec<u8> = if rank == root {
                (0..ws).flat_map(|r| bytes(r, n, 3)).collect()
            } else {
                vec![0; n * ws]
            };
            assert_eq!(recv, want, "{what}: gather_into {n} bytes to {root}");
        }
    }
    // Variable lengths, rank 1 sending nothing.
    let len_of = |r: usize| if r == 1 { 0 } else { r * 977 + 5 };
    let got = pg.all_gather_bytes(&bytes(rank, len_of(rank), 4)).unwrap();
    let want: Vec<Vec<u8>> = (0..ws).map(|r| bytes(r, len_of(r), 4)).collect();
    assert_eq!(got, want, "{what}: all_gather_bytes");
    let got = pg.all_gather_bytes(&[]).unwrap();
    assert_eq!(
        got,
        vec![Vec::<u8>::new(); ws],
        "{what}: empty all_gather_bytes"
    );

    for &root in &roots {
        let payload = bytes(root, 3001, 5);
        let send = (rank == root).then_some(&payload[..]);
        let got = pg.broadcast_bytes(send, root).unwrap();
        assert_eq!(got, payload, "{what}: broadcast_bytes from {root}");
        let got = pg
            .broadcast_bytes((rank == root).then_some(&[][..]), root)
            .unwrap();
        assert!(got.is_empty(), "{what}: empty broadcast_bytes from {root}");

        // Per-rank lengths (rank 1's part empty), then one buffer aliased for every rank.
        let part_len = |r: usize| if r == 1 { 0 } else { r * 1501 + 2 };
        let parts: Vec<Vec<u8>> = (0..ws).map(|r| bytes(r, part_len(r), 6)).collect();
        let refs: Vec<&[u8]> = parts.iter().map(Vec::as_slice).collect();
        let mut recv = vec![0u8; part_len(rank)];
        pg.scatter_into((rank == root).then_some(&refs[..]), &mut recv, root)
            .unwrap();
        assert_eq!(recv, parts[rank], "{what}: scatter_into from {root}");
        let one = bytes(root, 777, 7);
        let aliased: Vec<&[u8]> = vec![&one[..]; ws];
        let mut recv = vec![0u8; 777];
        pg.scatter_into((rank == root).then_some(&aliased[..]), &mut recv, root)
            .unwrap();
        assert_eq!(recv, one, "{what}: aliased scatter_into from {root}");
    }
    pg.barrier().unwrap();
}

/// Element `i` of rank `r`'s reduction input: a small integer (so that sums are exact in
/// every dtype and any order), `0..=10` for unsigned dtypes, 0 or 1 for bool.
fn small(dtype: DType, r: usize, i: usize) -> f64 {
    let v = ((i * 7 + r * 3) % 11) as f64;
    match dtype {
        DType::Bool => f64::from(u8::from((i + r) % 3 == 0)),
        DType::U8 | DType::U16 | DType::U32 | DType::U64 => v,
        _ => v - 5.0,
    }
}

/// `values` encoded as `dtype`.
fn encode(dtype: DType, values: &[f64]) -> Vec<u8> {
    values
        .iter()
        .flat_map(|&x| -> Vec<u8> {
            match dtype {
                DType::F32 => (x as f32).to_le_bytes().to_vec(),
                DType::F64 => x.to_le_bytes().to_vec(),
                DType::F16 => f16::from_f64(x).to_le_bytes().to_vec(),
                DType::BF16 => bf16::from_f64(x).to_le_bytes().to_vec(),
                DType::I64 => (x as i64).to_le_bytes().to_vec(),
                DType::I32 => (x as i32).to_le_bytes().to_vec(),
                DType::U8 | DType::Bool => vec![x as u8],
                DType::I8 => (x as i8).to_le_bytes().to_vec(),
                DType::I16 => (x as i16).to_le_bytes().to_vec(),
                DType::U16 => (x as u16).to_le_bytes().to_vec(),
                DType::U32 => (x as u32).to_le_bytes().to_vec(),
                DType::U64 => (x as u64).to_le_bytes().to_vec(),
                // A real number: its real part, imaginary part 0.
                DType::C64 => [(x as f32).to_le_bytes(), 0f32.to_le_bytes()].concat(),
                DType::C128 => [x.to_le_bytes(), 0f64.to_le_bytes()].concat(),
                DType::F8E4M3FN | DType::F8E5M2 => {
                    unreachable!("no reduction is defined for {dtype}")
                }
            }
        })
        .collect()
}

/// `bytes` of `dtype` as numbers.
fn decode(dtype: DType, bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(dtype.size())
        .map(|c| match dtype {
            DType::F32 => f64::from(f32::from_le_bytes(c.try_into().unwrap())),
            DType::F64 => f64::from_le_bytes(c.try_into().unwrap()),
            DType::F16 => f16::from_le_bytes(c.try_into().unwrap()).to_f64(),
            DType::BF16 => bf16::from_le_bytes(c.try_into().unwrap()).to_f64(),
            DType::I64 => i64::from_le_bytes(c.try_into().unwrap()) as f64,
            DType::I32 => f64::from(i32::from_le_bytes(c.try_into().unwrap())),
            DType::U8 | DType::Bool => f64::from(c[0]),
            DType::I8 => f64::from(c[0] as i8),
            DType::I16 => f64::from(i16::from_le_bytes(c.try_into().unwrap())),
            DType::U16 => f64::from(u16::from_le_bytes(c.try_into().unwrap())),
            DType::U32 => f64::from(u32::from_le_bytes(c.try_into().unwrap())),
            DType::U64 => u64::from_le_bytes(c.try_into().unwrap()) as f64,
            // The real part (the inputs' imaginary parts are 0, and so are their sums).
            DType::C64 => f64::from(f32::from_le_bytes(c[..4].try_into().unwrap())),
            DType::C128 => f64::from_le_bytes(c[..8].try_into().unwrap()),
            DType::F8E4M3FN | DType::F8E5M2 => unreachable!("no reduction is defined for {dtype}"),
        })
        .collect()
}

fn is_float(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::F32 | DType::F64 | DType::F16 | DType::BF16 | DType::C64 | DType::C128
    )
}

/// Asserts that `got` is the rank-order reduction `want`: bit for bit, or, when the backend
/// keeps its own order and order can matter, within a relative tolerance of the dtype.
fn assert_reduced(got: &[u8], want: &[u8], dtype: DType, exact: bool, what: &str) {
    if exact {
        assert_eq!(got, want, "{what}");
        return;
    }
    let tolerance = match dtype {
        DType::F16 => 1e-2,
        DType::BF16 => 1e-1,
        _ => 1e-5,
    };
    let (g, w) = (decode(dtype, got), decode(dtype, want));
    assert_eq!(g.len(), w.len(), "{what}: length");
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        assert!(
            (a - b).abs() <= tolerance * b.abs().max(1.0),
            "{what}: element {i} is {a}, expected {b}"
        );
    }
}

/// The operations `dtype` supports (bool: max only, a logical or).
/// Whether `pg` refuses `op` on `dtype`: no backend reduces float8; NCCL has no 16-bit
/// integer datatype.
fn refuses(pg: &dyn ProcessGroup, dtype: DType, op: ReduceOp) -> bool {
    fsdp::collectives::check_reduction(dtype, op, 0).is_err()
        || (pg.backend() == "nccl"
            && matches!(dtype, DType::I16 | DType::U16 | DType::C64 | DType::C128))
}

fn ops_of(dtype: DType) -> Vec<ReduceOp> {
    if dtype == DType::Bool {
        vec![ReduceOp::Max]
    } else if matches!(dtype, DType::C64 | DType::C128) {
        vec![ReduceOp::Sum, ReduceOp::Avg]
    } else {
        vec![ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max]
    }
}

/// all_reduce and reduce_scatter_into over every dtype and supported operation, with empty,
/// one-element and uneven lengths, against [`reduce_parts`] of every rank's input.
pub fn reductions_of_every_dtype(pg: &dyn ProcessGroup, reductions: Reductions, what: &str) {
    let (rank, ws) = (pg.rank(), pg.world_size());
    let what = format!("{what} ({} rank {rank} of {ws})", pg.backend());
    let rank_order = reductions == Reductions::RankOrder;
    for dtype in DType::ALL {
        for op in ops_of(dtype) {
            if refuses(pg, dtype, op) {
                // A refused call fails the group for good (the argument-error tests check
                // the refusal itself), so the suite leaves these out.
                continue;
            }
            // Order matters only for float averages (a division per rank or at the end).
            let exact = rank_order || !is_float(dtype) || op != ReduceOp::Avg;
            for elems in [0usize, 1, 7, ws * 3 + 1] {
                let input = |r: usize| {
                    let v: Vec<f64> = (0..elems).map(|i| small(dtype, r, i)).collect();
                    encode(dtype, &v)
                };
                let all: Vec<Vec<u8>> = (0..ws).map(input).collect();
                let parts: Vec<&[u8]> = all.iter().map(Vec::as_slice).collect();
                let mut want = vec![0u8; all[rank].len()];
                reduce_parts(dtype, op, &parts, &mut want).unwrap();
                let mut buf = all[rank].clone();
                pg.all_reduce(&mut buf, dtype, op).unwrap();
                let case = format!("{what}: all_reduce {op} of {elems} {dtype}");
                assert_reduced(&buf, &want, dtype, exact, &case);
            }
            for per_rank in [0usize, 1, 5] {
                let input = |r: usize| {
                    let v: Vec<f64> = (0..per_rank * ws).map(|i| small(dtype, r, i)).collect();
                    encode(dtype, &v)
                };
                let all: Vec<Vec<u8>> = (0..ws).map(input).collect();
                let n = per_rank * dtype.size();
                let parts: Vec<&[u8]> = all.iter().map(|a| &a[rank * n..][..n]).collect();
                let mut want = vec![0u8; n];
                reduce_parts(dtype, op, &parts, &mut want).unwrap();
                let mut recv = vec![0u8; n];
                pg.reduce_scatter_into(&all[rank], &mut recv, dtype, op)
                    .unwrap();
                let case = format!("{what}: reduce_scatter_into {op} of {per_rank} {dtype}");
                assert_reduced(&recv, &want, dtype, exact, &case);
            }
        }
    }
    // Fractions, where the order of a float sum changes its last bits.
    let fractions = |r: usize| -> Vec<f64> {
        (0..ws * 5)
            .map(|i| (i * (r + 1)) as f64 * 0.37 - r as f64 / 3.0)
            .collect()
    };
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let all: Vec<Vec<u8>> = (0..ws).map(|r| encode(dtype, &fractions(r))).collect();
        let parts: Vec<&[u8]> = all.iter().map(Vec::as_slice).collect();
        let mut want = vec![0u8; all[rank].len()];
        reduce_parts(dtype, ReduceOp::Sum, &parts, &mut want).unwrap();
        let mut buf = all[rank].clone();
        pg.all_reduce(&mut buf, dtype, ReduceOp::Sum).unwrap();
        let case = format!("{what}: all_reduce sum of fractions in {dtype}");
        assert_reduced(&buf, &want, dtype, rank_order, &case);
    }
}

/// all_gather_object, broadcast_object from each end, and the agreement helpers of
/// `ProcessGroupExt` (one failing rank, two failing ranks, none).
pub fn objects_and_agreement(pg: &dyn ProcessGroup, what: &str) {
    let (rank, ws) = (pg.rank(), pg.world_size());
    let what = format!("{what} ({} rank {rank} of {ws})", pg.backend());
    let got: Vec<(String, usize)> = pg
        .all_gather_object(&(format!("rank{rank}"), rank * rank))
        .unwrap();
    let want: Vec<(String, usize)> = (0..ws).map(|r| (format!("rank{r}"), r * r)).collect();
    assert_eq!(got, want, "{what}: all_gather_object");
    for root in [0, ws - 1] {
        let v = vec![1.5f64, -2.0, root as f64];
        let got: Vec<f64> = pg
            .broadcast_object((rank == root).then_some(&v), root)
            .unwrap();
        assert_eq!(got, v, "{what}: broadcast_object from {root}");
    }

    let failure = |r: usize| Error::InvalidArgument {
        op: "conformance".into(),
        rank: r,
        reason: "cannot go on".into(),
    };
    let outcome = |failing: &[usize]| {
        if failing.contains(&rank) {
            Err(failure(rank))
        } else {
            Ok(rank)
        }
    };
    assert_eq!(
        pg.agree(outcome(&[])),
        Ok(rank),
        "{what}: agree, none fails"
    );
    assert_eq!(
        pg.agree(outcome(&[ws - 1])),
        Err(failure(ws - 1)),
        "{what}: agree, the last rank fails"
    );
    let two = [ws - 1, ws / 2];
    assert_eq!(
        pg.agree(outcome(&two)),
        Err(failure(ws / 2)),
        "{what}: agree, two ranks fail"
    );
    assert_eq!(
        pg.all_gather_agreed(outcome(&[])),
        Ok((0..ws).collect()),
        "{what}: all_gather_agreed"
    );
    assert_eq!(
        pg.all_gather_agreed(outcome(&two)),
        Err(failure(ws / 2)),
        "{what}: all_gather_agreed, two ranks fail"
    );
    let root = ws - 1;
    let root_outcome = outcome(&[root]);
    assert_eq!(
        pg.broadcast_agreed((rank == root).then_some(&root_outcome), root),
        Err(failure(root)),
        "{what}: broadcast_agreed of the root's error"
    );
}

/// new_subgroup: every rank in reversed order (sub-rank = position in the list), the last rank
/// alone, the even ranks; the sub-groups work on the same backend.
pub fn subgroups(pg: &dyn ProcessGroup, what: &str) {
    let (rank, ws) = (pg.rank(), pg.world_size());
    let what = format!("{what} ({} rank {rank} of {ws})", pg.backend());
    let reversed: Vec<usize> = (0..ws).rev().collect();
    let sub = pg
        .new_subgroup(&reversed)
        .unwrap()
        .expect("every rank is a member");
    assert_eq!(
        (sub.rank(), sub.world_size()),
        (ws - 1 - rank, ws),
        "{what}"
    );
    assert_eq!(sub.backend(), pg.backend(), "{what}");
    let got = sub.all_gather_bytes(&[rank as u8]).unwrap();
    let want: Vec<Vec<u8>> = reversed.iter().map(|&r| vec![r as u8]).collect();
    assert_eq!(got, want, "{what}: sub-group order");

    let last = pg.new_subgroup(&[ws - 1]).unwrap();
    assert_eq!(
        last.is_some(),
        rank == ws - 1,
        "{what}: singleton membership"
    );
    if let Some(last) = last {
        assert_eq!((last.rank(), last.world_size()), (0, 1), "{what}");
        last.barrier().unwrap();
    }
    let evens: Vec<usize> = (0..ws).step_by(2).collect();
    match pg.new_subgroup(&evens).unwrap() {
        Some(e) => {
            assert_eq!(
                (e.rank(), e.world_size()),
                (rank / 2, evens.len()),
                "{what}"
            );
            let got = e.all_gather_bytes(&[rank as u8]).unwrap();
            let want: Vec<Vec<u8>> = evens.iter().map(|&r| vec![r as u8]).collect();
            assert_eq!(got, want, "{what}: even ranks");
        }
        None => assert_eq!(rank % 2, 1, "{what}: only odd ranks are left out"),
    }
    pg.barrier().unwrap();
}

/// Asserts `result` is `Error::InvalidCollective` of `op` on `rank`.
#[track_caller]
pub fn assert_invalid<T: std::fmt::Debug>(result: fsdp::Result<T>, op: &str, rank: usize) {
    match result {
        Err(Error::InvalidCollective { op: o, rank: r, .. }) if o == op && r == rank => {}
        other => panic!("rank {rank}: expected InvalidCollective of `{op}`, got {other:?}"),
    }
}

/// Asserts `result` is `Error::CollectiveMismatch` on `rank`.
#[track_caller]
pub fn assert_mismatch<T: std::fmt::Debug>(result: fsdp::Result<T>, rank: usize) {
    match result {
        Err(Error::CollectiveMismatch { rank: r, .. }) if r == rank => {}
        other => panic!("rank {rank}: expected CollectiveMismatch, got {other:?}"),
    }
}

/// Each argument check of `collectives/args.rs` (and of the reductions) failing on one rank,
/// the last, in a fresh sub-group of every rank: every rank gets
/// `InvalidCollective { op, rank: itself }`. Then calls that cannot complete together: every
/// rank gets `CollectiveMismatch { rank: itself }`.
pub fn argument_errors(pg: &dyn ProcessGroup, what: &str) {
    let (rank, ws) = (pg.rank(), pg.world_size());
    let all: Vec<usize> = (0..ws).collect();
    // A failure may poison its group: one fresh sub-group per case.
    let fresh = || -> Arc<dyn ProcessGroup> {
        pg.new_subgroup(&all)
            .unwrap()
            .unwrap_or_else(|| panic!("{what}: rank {rank} is a member"))
    };
    let bad = ws - 1;
    let me_bad = rank == bad;

    // args::gathered: a receive buffer of the wrong length.
    let recv_len = if me_bad { 2 * ws + 1 } else { 2 * ws };
    let r = fresh().all_gather_into(&[1, 2], &mut vec![0u8; recv_len]);
    assert_invalid(r, "all_gather_into", rank);

    // args::root, in each rooted collective.
    let root = if me_bad { ws } else { 0 };
    assert_invalid(fresh().broadcast(&mut [0u8; 4], root), "broadcast", rank);
    let r = fresh().broadcast_bytes((rank == 0).then_some(&[1u8][..]), root);
    assert_invalid(r, "broadcast_bytes", rank);
    let mut recv = vec![0u8; 4 * ws];
    let r = fresh().gather_into(&[0u8; 4], (rank == 0).then_some(&mut recv[..]), root);
    assert_invalid(r, "gather_into", rank);
    let parts: Vec<&[u8]> = vec![&[7u8; 3][..]; ws];
    let r = fresh().scatter_into((rank == 0).then_some(&parts[..]), &mut [0u8; 3], root);
    assert_invalid(r, "scatter_into", rank);

    // A root without its buffer, bytes or parts (args::gather_root, args::scatter_root).
    let r = fresh().broadcast_bytes(None, bad);
    assert_invalid(r, "broadcast_bytes", rank);
    let r = fresh().gather_into(&[0u8; 4], None, bad);
    assert_invalid(r, "gather_into", rank);
    let short = if me_bad { 4 * ws - 1 } else { 4 * ws };
    let mut recv = vec![0u8; short];
    let r = fresh().gather_into(&[0u8; 4], me_bad.then_some(&mut recv[..]), bad);
    assert_invalid(r, "gather_into", rank);
    let r = fresh().scatter_into(None, &mut [0u8; 3], bad);
    assert_invalid(r, "scatter_into", rank);
    let r = fresh().scatter_into(me_bad.then_some(&parts[..ws - 1]), &mut [0u8; 3], bad);
    assert_invalid(r, "scatter_into", rank);

    // args::reduce_scattered and the reductions: a send length that is not one chunk per rank,
    // a partial element, a sum of bools.
    let send = vec![0u8; if me_bad { 4 * ws + 4 } else { 4 * ws }];
    let r = fresh().reduce_scatter_into(&send, &mut [0u8; 4], DType::F32, ReduceOp::Sum);
    assert_invalid(r, "reduce_scatter_into", rank);
    let recv_len = if me_bad { 3 } else { 4 };
    let send = vec![0u8; recv_len * ws];
    let r = fresh().reduce_scatter_into(&send, &mut vec![0u8; recv_len], DType::F32, ReduceOp::Sum);
    assert_invalid(r, "reduce_scatter_into", rank);
    let mut buf = vec![0u8; if me_bad { 5 } else { 8 }];
    let r = fresh().all_reduce(&mut buf, DType::F32, ReduceOp::Sum);
    assert_invalid(r, "all_reduce", rank);
    let r = fresh().all_reduce(&mut [0u8; 2], DType::Bool, ReduceOp::Sum);
    assert_invalid(r, "all_reduce", rank);
    let r = fresh().reduce_scatter_into(&vec![0u8; ws], &mut [0u8; 1], DType::Bool, ReduceOp::Avg);
    assert_invalid(r, "reduce_scatter_into", rank);

    // args::subgroup: no ranks, a rank out of range, a rank twice.
    let lists: [Vec<usize>; 3] = [vec![], vec![0, ws], vec![0, 0]];
    for ranks in lists {
        let r = fresh().new_subgroup(&ranks).map(|g| g.is_some());
        assert_invalid(r, "new_subgroup", rank);
    }

    // A root object that is not passed: the root joins the byte broadcast without bytes.
    let r = fresh().broadcast_object::<u32>(None, 0);
    assert_invalid(r, "broadcast_bytes", rank);

    if ws > 1 {
        mismatches(&fresh, rank, bad);
    }
    pg.barrier().unwrap();
}

/// Calls that are valid on each rank but cannot complete together.
fn mismatches(fresh: &dyn Fn() -> Arc<dyn ProcessGroup>, rank: usize, bad: usize) {
    let me_bad = rank == bad;
    let ws = bad + 1;
    let g = fresh();
    let r = if me_bad {
        g.barrier()
    } else {
        g.broadcast(&mut [0u8; 4], 0)
    };
    assert_mismatch(r, rank);

    let n = if me_bad { 2 } else { 1 };
    assert_mismatch(
        fresh().all_gather_into(&vec![0u8; n], &mut vec![0u8; n * ws]),
        rank,
    );
    assert_mismatch(fresh().broadcast(&mut vec![0u8; n], 0), rank);
    let root = if me_bad { 1 } else { 0 };
    let r = fresh().broadcast_bytes((rank == root).then_some(&[1u8][..]), root);
    assert_mismatch(r, rank);

    let dtype = if me_bad { DType::I32 } else { DType::F32 };
    assert_mismatch(
        fresh().all_reduce(&mut [0u8; 8], dtype, ReduceOp::Sum),
        rank,
    );
    let op = if me_bad { ReduceOp::Max } else { ReduceOp::Sum };
    let send = vec![0u8; 4 * ws];
    assert_mismatch(
        fresh().reduce_scatter_into(&send, &mut [0u8; 4], DType::F32, op),
        rank,
    );

    // A receive buffer that differs from the root's part for it.
    let parts: Vec<&[u8]> = vec![&[9u8; 4][..]; ws];
    let mut recv = vec![0u8; if me_bad { 3 } else { 4 }];
    let r = fresh().scatter_into((rank == 0).then_some(&parts[..]), &mut recv, 0);
    assert_mismatch(r, rank);

    let ranks: Vec<usize> = if me_bad { vec![0, bad] } else { vec![bad, 0] };
    assert_mismatch(fresh().new_subgroup(&ranks).map(|g| g.is_some()), rank);
}
