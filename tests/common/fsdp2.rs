//! FSDP2's collectives checked the way PyTorch's `test_fully_shard_comm.py` checks them, on any
//! `ProcessGroup`: its parameter sizes as one `nn.ParameterList` group sharded by
//! `fully_shard`, all-gathered back to the originals, and unsharded gradients reduce-scattered
//! and compared with an all-reduce of the same gradients, divided as
//! `_get_gradient_divide_factors` says.
//!
//! Run on thread ranks by tests/it/fsdp2_comm.rs and under `mpirun` by tests/mpi/worker.rs.
//! Every function is collective. Reductions must be in rank order (threads, MPI), so results
//! are compared bit for bit.

use fsdp::collectives::{ProcessGroup, ReduceOp};
use fsdp::fully_shard::{
    cast, div_if_needed, foreach_all_gather, foreach_all_gather_copy_out, foreach_reduce,
    gradient_divide_factors, GradReduceOp, ReduceOptions,
};
use fsdp::param_layout::{ParamLayout, ShardedParam};
use fsdp::{DType, HostTensor, ModelDesc, WrapPolicy};

/// `TestFullyShardCollectives._get_param_sizes`.
pub const PARAM_SIZES: [&[usize]; 8] = [
    &[17, 257],
    &[17],
    &[64, 312],
    &[64],
    &[64, 64],
    &[512, 64],
    &[256],
    &[64, 297],
];

/// The whole suite on `pg`.
pub fn run(pg: &dyn ProcessGroup, what: &str) {
    outputs(pg, what);
}

/// The whole suite on `pg`, returning what its collectives produced, in order (the
/// all-gathered parameters, then the reduce-scattered gradient shards): two backends at the
/// same world size must agree bit for bit (tests/nccl.rs compares NCCL with threads).
pub fn outputs(pg: &dyn ProcessGroup, what: &str) -> Vec<HostTensor> {
    let what = format!(
        "{what} ({} rank {} of {})",
        pg.backend(),
        pg.rank(),
        pg.world_size()
    );
    let mut out = all_gather_restores_the_parameters(pg, &[DType::F32; 8], &what);
    let mixed = [
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::F64,
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::F32,
    ];
    out.extend(all_gather_restores_the_parameters(pg, &mixed, &what));
    let mut reduce = |dtype, grads, factor| {
        out.extend(reduce_scatter_matches_all_reduce(
            pg, dtype, grads, factor, &what,
        ))
    };
    for reduce_dtype in [DType::F32, DType::F16, DType::BF16] {
        reduce(reduce_dtype, Grads::RankTimesOnes, None);
        reduce(reduce_dtype, Grads::Varied, None);
    }
    let ws = pg.world_size() as f64;
    for factor in [ws * 2.0, ws] {
        for reduce_dtype in [DType::F32, DType::F16, DType::BF16] {
            reduce(reduce_dtype, Grads::Varied, Some(factor));
        }
    }
    pg.barrier().unwrap();
    out
}

/// `nn.ParameterList` of the test's sizes (names `0`..`7`), `fully_shard` on it: one group.
pub fn param_list(dtypes: &[DType], world_size: usize) -> ParamLayout {
    let mut model = ModelDesc::new();
    for (i, (shape, &dtype)) in PARAM_SIZES.iter().zip(dtypes).enumerate() {
        model = model.param(&i.to_string(), shape, dtype);
    }
    let layout = ParamLayout::new(&model, &WrapPolicy::fully_shard(&[""]), world_size).unwrap();
    assert_eq!(layout.groups.len(), 1);
    assert_eq!(
        layout.groups[0].params,
        (0..PARAM_SIZES.len()).collect::<Vec<_>>()
    );
    layout
}

/// A deterministic value in [-2, 2) for element `i` of parameter `p` (the same on every rank,
/// like `torch.randn` after a broadcast from rank 0), salted per rank for gradients.
pub fn value(p: usize, i: usize, salt: usize) -> f64 {
    let mut x = (p as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ (i as u64).wrapping_mul(0xBF58_476D_1CE4_E5B9)
        ^ (salt as u64).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^= x >> 31;
    x = x.wrapping_mul(0xD6E8_FEB8_6659_FD93);
    x ^= x >> 29;
    ((x >> 11) as f64 / (1u64 << 53) as f64) * 4.0 - 2.0
}

/// A tensor of `shape` and `dtype` with element `i` = `f(i)` (rounded to `dtype`).
pub fn tensor(shape: &[usize], dtype: DType, f: impl Fn(usize) -> f64) -> HostTensor {
    let n: usize = shape.iter().product();
    let wide: Vec<u8> = (0..n).flat_map(|i| f(i).to_le_bytes()).collect();
    let bytes = cast(&wide, DType::F64, dtype).unwrap();
    HostTensor::from_bytes(dtype, shape, &bytes).unwrap()
}

/// Rows `rows` of a tensor of `shape`, as their own tensor.
pub fn rows_of(t: &HostTensor, p: &ShardedParam, rank: usize) -> HostTensor {
    let r = p.rows(rank);
    let n = p.row_numel();
    t.narrow_flat(r.start * n, r.len() * n)
        .unwrap()
        .reshape(&p.local_shape(rank))
        .unwrap()
}

/// `_test_all_gather`: the original parameters, each rank holding its `torch.chunk` rows,
/// all-gathered (copy-in, all-gather, copy-out) equal the originals bit for bit. Returns them.
pub fn all_gather_restores_the_parameters(
    pg: &dyn ProcessGroup,
    dtypes: &[DType],
    what: &str,
) -> Vec<HostTensor> {
    let layout = param_list(dtypes, pg.world_size());
    let params = layout.group_params(0);
    let originals: Vec<HostTensor> = params
        .iter()
        .enumerate()
        .map(|(k, p)| tensor(&p.shape, p.dtype, |i| value(k, i, 0)))
        .collect();
    let shards: Vec<HostTensor> = params
        .iter()
        .zip(&originals)
        .map(|(p, t)| rows_of(t, p, pg.rank()))
        .collect();
    let result = foreach_all_gather(pg, &params, &shards).unwrap();
    let unsharded = foreach_all_gather_copy_out(&result, &params).unwrap();
    for ((p, got), want) in params.iter().zip(&unsharded).zip(&originals) {
        assert!(
            got.bit_eq(want),
            "{what}: all-gathered `{}` ({}) differs",
            p.name,
            p.dtype
        );
    }
    unsharded
}

/// Which unsharded gradients each rank contributes.
#[derive(Debug, Clone, Copy)]
pub enum Grads {
    /// `torch.ones_like(param) * self.rank`, as the PyTorch test.
    RankTimesOnes,
    /// Different values on every rank and element.
    Varied,
}

/// `_test_reduce_scatter` (and, with a factor, `_test_set_reduce_scatter_divide_factor`):
/// fp32 parameters and gradients reduce-scattered in `reduce_dtype`; each rank's sharded
/// gradient equals its rows of the reference. The reference is computed as the test does it:
/// the gradients (cast to the reduce dtype) divided by the pre-factor, all-reduced with `AVG`
/// when there is none and `SUM` otherwise, divided by the post-factor; with a custom factor,
/// multiplied by `1 / factor` and all-reduced with `SUM` when the op is `PREMUL_SUM`. At one
/// rank, as `foreach_reduce`'s single-rank branch: no collective, a division by the factor.
/// Returns this rank's sharded gradients.
pub fn reduce_scatter_matches_all_reduce(
    pg: &dyn ProcessGroup,
    reduce_dtype: DType,
    grads: Grads,
    factor: Option<f64>,
    what: &str,
) -> Vec<HostTensor> {
    let (rank, ws) = (pg.rank(), pg.world_size());
    let layout = param_list(&[DType::F32; 8], ws);
    let params = layout.group_params(0);
    let unsharded: Vec<HostTensor> = params
        .iter()
        .enumerate()
        .map(|(k, p)| match grads {
            Grads::RankTimesOnes => tensor(&p.shape, DType::F32, |_| rank as f64),
            Grads::Varied => tensor(&p.shape, DType::F32, |i| value(k, i, rank + 1)),
        })
        .collect();
    let options = ReduceOptions {
        reduce_dtype: Some(reduce_dtype),
        orig_dtype: Some(DType::F32),
        divide_factor: factor,
        ..Default::default()
    };
    let sharded = foreach_reduce(pg, &params, &unsharded, &options).unwrap();
    let factors = gradient_divide_factors(Some(ws), None, reduce_dtype, factor, false);
    let what = format!("{what}: reduce dtype {reduce_dtype}, {grads:?}, factor {factor:?}");
    for ((p, grad), got) in params.iter().zip(&unsharded).zip(&sharded) {
        let mut reduced = cast(grad.as_bytes(), DType::F32, reduce_dtype).unwrap();
        div_if_needed(&mut reduced, reduce_dtype, factors.pre).unwrap();
        if ws == 1 {
            // `foreach_reduce` at one rank runs no collective: it copies the pre-divided
            // input divided by the custom factor (then post-divides, below).
            div_if_needed(&mut reduced, reduce_dtype, factor).unwrap();
        }
        let op = match factors.reduce_scatter_op {
            GradReduceOp::PremulSum(s) if ws > 1 => {
                // `param.grad.mul_(1.0 / divide_factor)`, then `dist.all_reduce(param.grad)`.
                let w = tensor(&p.shape, reduce_dtype, |i| {
                    f64::from(read_as_f32(&reduced, reduce_dtype, i)) * f64::from(s as f32)
                });
                reduced = w.as_bytes().to_vec();
                ReduceOp::Sum
            }
            _ if factors.pre.is_none() && factor.is_none() => ReduceOp::Avg,
            GradReduceOp::Avg => ReduceOp::Avg,
            _ => ReduceOp::Sum,
        };
        if ws > 1 {
            pg.all_reduce(&mut reduced, reduce_dtype, op).unwrap();
        }
        div_if_needed(&mut reduced, reduce_dtype, factors.post).unwrap();
        let full = HostTensor::from_bytes(
            DType::F32,
            &p.shape,
            &cast(&reduced, reduce_dtype, DType::F32).unwrap(),
        )
        .unwrap();
        let want = rows_of(&full, p, rank);
        assert_eq!(got.shape(), want.shape(), "{what}: `{}` shape", p.name);
        assert!(
            got.bit_eq(&want),
            "{what}: sharded gradient of `{}` differs",
            p.name
        );
    }
    sharded
}

/// Element `i` of a float buffer, widened to f32 (exact for f32, f16, bf16).
fn read_as_f32(bytes: &[u8], dtype: DType, i: usize) -> f32 {
    let wide = cast(
        &bytes[i * dtype.size()..(i + 1) * dtype.size()],
        dtype,
        DType::F64,
    )
    .unwrap();
    f64::from_le_bytes(wide.try_into().unwrap()) as f32
}
