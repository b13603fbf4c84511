//! Collectives on device buffers: `CudaSlice`s of this rank's context, no host staging.
//!
//! The calls are enqueued on the group's stream ([`NcclProcessGroup::stream`]) and return
//! without waiting; cudarc's event tracking makes later uses of the buffers on other streams
//! wait for them. Unlike the host-buffer methods there is no cross-rank agreement step: as in
//! NCCL (and `torch.distributed`), every rank must pass matching lengths. Local arguments are
//! checked (lengths, root, buffers of this rank's context).

use super::codes::nccl_error;
use super::NcclProcessGroup;
use crate::collectives::ReduceOp;
use crate::error::Result;
use crate::tensor::DType;
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use cudarc::nccl::{result, sys};
use half::{bf16, f16};

/// An element type NCCL can move and reduce: `f32`, `f64`, `f16`, `bf16`, `i32`, `i64`, `u8`.
pub trait NcclElement: DeviceRepr {
    /// The crate's dtype of the element.
    const DTYPE: DType;
    /// NCCL's datatype of the element.
    fn nccl_type() -> sys::ncclDataType_t;
}

macro_rules! element {
    ($t:ty, $dtype:ident, $nccl:ident) => {
        impl NcclElement for $t {
            const DTYPE: DType = DType::$dtype;
            fn nccl_type() -> sys::ncclDataType_t {
                sys::ncclDataType_t::$nccl
            }
        }
    };
}

element!(f32, F32, ncclFloat32);
element!(f64, F64, ncclFloat64);
element!(f16, F16, ncclFloat16);
element!(bf16, BF16, ncclBfloat16);
element!(i32, I32, ncclInt32);
element!(i64, I64, ncclInt64);
element!(u8, U8, ncclUint8);

fn nccl_reduce_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

impl NcclProcessGroup {
    fn check_context<T>(&self, op: &str, what: &str, buf: &CudaSlice<T>) -> Result<()> {
        if buf.context().cu_ctx() == self.ctx.cu_ctx() {
            Ok(())
        } else {
            Err(self.invalid(
                op,
                format!(
                    "the {what} buffer lives on CUDA device {}, this rank's group on device {}",
                    buf.ordinal(),
                    self.ctx.ordinal()
                ),
            ))
        }
    }

    /// `all_gather_into_tensor` on the device: rank `r`'s `send` lands at
    /// `recv[r * send.len()..]`. `recv.len()` must be `send.len() * world_size()`.
    pub fn all_gather_device<T: NcclElement>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
    ) -> Result<()> {
        let op = "all_gather_device";
        self.check_context(op, "send", send)?;
        self.check_context(op, "recv", recv)?;
        if send.len().checked_mul(self.world_size) != Some(recv.len()) {
            return Err(self.invalid(
                op,
                format!(
                    "recv has {} elements, expected send length {} x world size {}",
                    recv.len(),
                    send.len(),
                    self.world_size
                ),
            ));
        }
        let comm = self.lock(op)?;
        let (s, _rs) = send.device_ptr(&self.stream);
        let (r, _rr) = recv.device_ptr_mut(&self.stream);
        // SAFETY: both buffers belong to this context and have the checked lengths.
        unsafe {
            result::all_gather(
                s as _,
                r as _,
                send.len(),
                T::nccl_type(),
                comm.0,
                self.stream.cu_stream() as _,
            )
        }
        .map(drop)
        .map_err(|e| nccl_error("ncclAllGather", self.rank, e))
    }

    /// Broadcasts root's `buf` into every rank's `buf`, in place.
    pub fn broadcast_device<T: NcclElement>(
        &self,
        buf: &mut CudaSlice<T>,
        root: usize,
    ) -> Result<()> {
        let op = "broadcast_device";
        self.check_context(op, "broadcast", buf)?;
        self.check_root(root)
            .map_err(|reason| self.invalid(op, reason))?;
        let comm = self.lock(op)?;
        let count = buf.len();
        let (p, _rp) = buf.device_ptr_mut(&self.stream);
        // SAFETY: in-place broadcast of the whole buffer; root checked.
        unsafe {
            result::broadcast(
                p as _,
                p as _,
                count,
                T::nccl_type(),
                root as i32,
                comm.0,
                self.stream.cu_stream() as _,
            )
        }
        .map(drop)
        .map_err(|e| nccl_error("ncclBroadcast", self.rank, e))
    }

    /// `reduce_scatter_tensor` on the device: chunk `r` of every rank's `send`, reduced with
    /// `op`, lands in rank `r`'s `recv`. `send.len()` must be `recv.len() * world_size()`.
    pub fn reduce_scatter_device<T: NcclElement>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        let name = "reduce_scatter_device";
        self.check_context(name, "send", send)?;
        self.check_context(name, "recv", recv)?;
        if recv.len().checked_mul(self.world_size) != Some(send.len()) {
            return Err(self.invalid(
                name,
                format!(
                    "send has {} elements, expected recv length {} x world size {}",
                    send.len(),
                    recv.len(),
                    self.world_size
                ),
            ));
        }
        let comm = self.lock(name)?;
        let count = recv.len();
        let (s, _rs) = send.device_ptr(&self.stream);
        let (r, _rr) = recv.device_ptr_mut(&self.stream);
        // SAFETY: lengths checked above; both buffers belong to this context.
        unsafe {
            result::reduce_scatter(
                s as _,
                r as _,
                count,
                T::nccl_type(),
                nccl_reduce_op(op),
                comm.0,
                self.stream.cu_stream() as _,
            )
        }
        .map(drop)
        .map_err(|e| nccl_error("ncclReduceScatter", self.rank, e))
    }

    /// All-reduces `buf` in place with `op`.
    pub fn all_reduce_device<T: NcclElement>(
        &self,
        buf: &mut CudaSlice<T>,
        op: ReduceOp,
    ) -> Result<()> {
        let name = "all_reduce_device";
        self.check_context(name, "buffer", buf)?;
        let comm = self.lock(name)?;
        let count = buf.len();
        let (p, _rp) = buf.device_ptr_mut(&self.stream);
        // SAFETY: in place over the whole buffer.
        unsafe {
            result::all_reduce(
                p as _,
                p as _,
                count,
                T::nccl_type(),
                nccl_reduce_op(op),
                comm.0,
                self.stream.cu_stream() as _,
            )
        }
        .map(drop)
        .map_err(|e| nccl_error("ncclAllReduce", self.rank, e))
    }

    /// Waits until every collective enqueued on the group's stream has finished, reporting a
    /// failed kernel or copy as [`crate::Error::CudaDriver`].
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| super::codes::driver_error("cuStreamSynchronize", self.rank, e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn elements_name_their_dtype_and_a_same_sized_nccl_type() {
        fn check<T: NcclElement>() {
            assert_eq!(std::mem::size_of::<T>(), T::DTYPE.size(), "{}", T::DTYPE);
            assert_eq!(super::super::nccl_dtype(T::DTYPE), Some(T::nccl_type()));
        }
        check::<f32>();
        check::<f64>();
        check::<f16>();
        check::<bf16>();
        check::<i32>();
        check::<i64>();
        check::<u8>();
        assert_eq!(nccl_reduce_op(ReduceOp::Max), sys::ncclRedOp_t::ncclMax);
    }
}
