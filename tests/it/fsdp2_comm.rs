//! FSDP2 (`fully_shard`) collectives on thread ranks at the world sizes the issue names, with
//! `test_fully_shard_comm.py`'s parameter sizes: all-gather (copy-in, all-gather, copy-out),
//! reduce-scatter in fp32, fp16 and bf16 with upcast to the fp32 parameters, custom divide
//! factors; and ranks that disagree failing together.

use crate::common;

use common::fsdp2::{self, param_list, rows_of, tensor, value};
use fsdp::collectives::{ProcessGroup, ThreadGroup};
use fsdp::fully_shard::{foreach_all_gather, foreach_reduce, ReduceOptions};
use fsdp::{DType, Error, HostTensor};

#[test]
fn fully_shard_collectives_at_2_ranks() {
    ThreadGroup::run(2, |pg| fsdp2::run(&pg, "threads"));
}

#[test]
fn fully_shard_collectives_at_3_ranks() {
    ThreadGroup::run(3, |pg| fsdp2::run(&pg, "threads"));
}

#[test]
fn fully_shard_collectives_at_8_ranks() {
    ThreadGroup::run(8, |pg| fsdp2::run(&pg, "threads"));
}

#[test]
fn fully_shard_collectives_at_1_rank_copy_without_communicating() {
    ThreadGroup::run(1, |pg| fsdp2::run(&pg, "threads"));
}

#[test]
fn a_rank_with_a_wrongly_shaped_shard_fails_every_rank_with_its_error() {
    let results = ThreadGroup::run(3, |pg| {
        let layout = param_list(&[DType::F32; 8], 3);
        let params = layout.group_params(0);
        let mut shards: Vec<HostTensor> = params
            .iter()
            .enumerate()
            .map(|(k, p)| rows_of(&tensor(&p.shape, p.dtype, |i| value(k, i, 0)), p, pg.rank()))
            .collect();
        if pg.rank() == 2 {
            // The whole parameter instead of rank 2's rows.
            shards[0] = tensor(&params[0].shape, DType::F32, |_| 0.0);
        }
        foreach_all_gather(&pg, &params, &shards).map(|_| ())
    });
    for r in results {
        let e = r.unwrap_err();
        assert!(
            matches!(&e, Error::ShapeMismatch { context, expected, found }
                if context.contains("`0`") && context.contains("rank 2")
                    && expected == &vec![5, 257] && found == &vec![17, 257]),
            "{e}"
        );
    }
}

#[test]
fn gradients_of_two_dtypes_in_one_group_are_refused_on_every_rank() {
    let results = ThreadGroup::run(2, |pg| {
        let layout = param_list(&[DType::F32; 8], 2);
        let params = layout.group_params(0);
        let grads: Vec<HostTensor> = params
            .iter()
            .enumerate()
            .map(|(k, p)| {
                let dtype = if k == 3 && pg.rank() == 1 {
                    DType::BF16
                } else {
                    DType::F32
                };
                tensor(&p.shape, dtype, |_| 1.0)
            })
            .collect();
        foreach_reduce(&pg, &params, &grads, &ReduceOptions::default()).map(|_| ())
    });
    for r in results {
        let e = r.unwrap_err();
        assert!(
            matches!(&e, Error::DtypeMismatch { context, expected, found }
                if context.contains("`3`") && context.contains("rank 1")
                    && expected == "torch.float32" && found == "torch.bfloat16"),
            "{e}"
        );
    }
}

#[test]
fn a_divide_factor_that_is_not_positive_is_refused() {
    let results = ThreadGroup::run(2, |pg| {
        let layout = param_list(&[DType::F32; 8], 2);
        let params = layout.group_params(0);
        let grads: Vec<HostTensor> = params
            .iter()
            .map(|p| tensor(&p.shape, DType::F32, |_| 1.0))
            .collect();
        let options = ReduceOptions {
            divide_factor: Some(0.0),
            ..Default::default()
        };
        foreach_reduce(&pg, &params, &grads, &options).map(|_| pg.rank())
    });
    for r in results {
        assert!(
            matches!(r, Err(Error::InvalidArgument { ref reason, .. }) if reason.contains("divide factor 0")),
            "{r:?}"
        );
    }
}
