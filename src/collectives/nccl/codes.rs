//! NCCL and CUDA driver status codes as crate errors.
//!
//! cudarc's `NcclError` wraps an `ncclResult_t` and prints only `NcclError` (no `Display`), and
//! `DriverError`'s `Display` calls back into the driver; so both are turned into
//! [`Error::Nccl`] / [`Error::CudaDriver`] here from their numeric codes alone.

use crate::error::Error;
use cudarc::driver::DriverError;
use cudarc::nccl::result::NcclError;

/// The symbolic name of an `ncclResult_t` value (NCCL 2.30 numbering).
pub fn nccl_code_name(code: u32) -> &'static str {
    match code {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => "unknown ncclResult_t",
    }
}

/// What an `ncclResult_t` value means, after NCCL's documentation, with the usual remedy.
pub fn nccl_code_reason(code: u32) -> &'static str {
    match code {
        0 => "success",
        1 => "a CUDA call inside NCCL failed (driver or device error, out of device memory)",
        2 => "a system call failed (socket, shared memory, file descriptors; check NCCL_SOCKET_IFNAME and /dev/shm)",
        3 => "NCCL internal error (a bug in NCCL, or memory corruption)",
        4 => "an argument is invalid (null or misaligned pointer, bad count, datatype or rank)",
        5 => "NCCL was used wrongly (e.g. ranks called different collectives, or one communicator from two threads)",
        6 => "a remote rank failed or the network went down (set NCCL_DEBUG=WARN for details)",
        7 => "the operation is still in progress (non-blocking communicator)",
        8 => "the operation timed out",
        _ => "an NCCL status code this crate does not know (newer NCCL?)",
    }
}

/// `NcclError` → [`Error::Nccl`] naming the call, the rank and the code.
pub fn nccl_error(op: &str, rank: usize, err: NcclError) -> Error {
    nccl_error_from_code(op, rank, err.0 as u32)
}

/// [`nccl_error`] from a raw `ncclResult_t` value.
pub fn nccl_error_from_code(op: &str, rank: usize, code: u32) -> Error {
    let name = nccl_code_name(code);
    let code_text = if name.starts_with("unknown") {
        format!("{name} {code}")
    } else {
        name.to_string()
    };
    Error::Nccl {
        op: op.into(),
        rank,
        code: code_text,
        reason: nccl_code_reason(code).into(),
    }
}

/// `DriverError` → [`Error::CudaDriver`] with the symbolic `CUresult` name (taken from the
/// enum itself, so without calling into a driver that may be broken).
pub fn driver_error(op: &str, rank: usize, err: DriverError) -> Error {
    Error::CudaDriver {
        op: op.into(),
        rank,
        code: format!("{:?}", err.0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUresult;
    use cudarc::nccl::sys::ncclResult_t;

    #[test]
    fn every_nccl_error_code_gets_its_symbolic_name() {
        let cases = [
            (
                ncclResult_t::ncclUnhandledCudaError,
                "ncclUnhandledCudaError",
            ),
            (ncclResult_t::ncclSystemError, "ncclSystemError"),
            (ncclResult_t::ncclInternalError, "ncclInternalError"),
            (ncclResult_t::ncclInvalidArgument, "ncclInvalidArgument"),
            (ncclResult_t::ncclInvalidUsage, "ncclInvalidUsage"),
            (ncclResult_t::ncclRemoteError, "ncclRemoteError"),
            (ncclResult_t::ncclInProgress, "ncclInProgress"),
            (ncclResult_t::ncclTimeout, "ncclTimeout"),
        ];
        for (code, name) in cases {
            let err = nccl_error("all_gather_into", 3, NcclError(code));
            match &err {
                Error::Nccl {
                    op,
                    rank,
                    code,
                    reason,
                } => {
                    assert_eq!(
                        (op.as_str(), *rank, code.as_str()),
                        ("all_gather_into", 3, name)
                    );
                    assert!(!reason.is_empty());
                }
                other => panic!("expected Error::Nccl, got {other:?}"),
            }
            let text = err.to_string();
            assert!(
                text.starts_with(&format!(
                    "NCCL `all_gather_into` failed on rank 3: {name}: "
                )),
                "{text}"
            );
        }
    }

    #[test]
    fn unknown_codes_keep_their_number() {
        let err = nccl_error_from_code("broadcast", 0, 42);
        assert!(
            matches!(&err, Error::Nccl { code, .. } if code == "unknown ncclResult_t 42"),
            "{err:?}"
        );
    }

    #[test]
    fn driver_errors_get_the_cuda_error_name() {
        let err = driver_error("cuInit", 1, DriverError(CUresult::CUDA_ERROR_NO_DEVICE));
        assert_eq!(
            err,
            Error::CudaDriver {
                op: "cuInit".into(),
                rank: 1,
                code: "CUDA_ERROR_NO_DEVICE".into(),
            }
        );
        assert_eq!(
            err.to_string(),
            "CUDA driver call `cuInit` failed on rank 1: CUDA_ERROR_NO_DEVICE"
        );
        let err = driver_error("memcpy", 0, DriverError(CUresult::CUDA_ERROR_OUT_OF_MEMORY));
        assert!(err.to_string().ends_with("CUDA_ERROR_OUT_OF_MEMORY"));
    }
}
