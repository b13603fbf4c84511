//! The process-wide cache of large tensor buffers: reuse, zeroing and limits. One test, so no
//! other test of this binary allocates large tensors meanwhile.

use fsdp::tensor::{
    buffer_cache_limit, cached_buffer_bytes, release_cached_buffers, set_buffer_cache_limit,
};
use fsdp::{DType, HostTensor};

const MIB: usize = 1 << 20;

#[test]
fn dropped_large_buffers_are_reused_zeroed_and_bounded_by_the_limit() {
    set_buffer_cache_limit(64 * MIB);
    assert_eq!(buffer_cache_limit(), 64 * MIB);
    release_cached_buffers();
    assert_eq!(cached_buffer_bytes(), 0);

    // A 16 MiB tensor full of ones, dropped: its buffer goes to the cache.
    let numel = 4 * MIB; // f32
    let mut ones = HostTensor::zeros(DType::F32, &[numel]);
    ones.as_mut_slice::<f32>().unwrap().fill(1.0);
    let addr = ones.as_bytes().as_ptr();
    drop(ones);
    assert_eq!(cached_buffer_bytes(), 16 * MIB);

    // The next tensor of that size gets the same buffer, cleared.
    let zeros = HostTensor::zeros(DType::F32, &[numel]);
    assert_eq!(
        zeros.as_bytes().as_ptr(),
        addr,
        "the cached buffer was not reused"
    );
    assert!(zeros.as_slice::<f32>().unwrap().iter().all(|&x| x == 0.0));
    assert_eq!(cached_buffer_bytes(), 0);

    // A much smaller request does not take a much larger buffer.
    drop(zeros);
    let small = HostTensor::zeros(DType::F32, &[MIB + 1]);
    assert_ne!(small.as_bytes().as_ptr(), addr);
    assert_eq!(cached_buffer_bytes(), 16 * MIB);
    drop(small);

    // The limit is kept: the oldest buffers are released first.
    let big: Vec<HostTensor> = (0..5)
        .map(|_| HostTensor::zeros(DType::U8, &[16 * MIB]))
        .collect();
    drop(big);
    assert!(cached_buffer_bytes() <= 64 * MIB);
    set_buffer_cache_limit(20 * MIB);
    assert!(cached_buffer_bytes() <= 20 * MIB);

    // Limit 0 disables the cache; release empties it.
    set_buffer_cache_limit(0);
    drop(HostTensor::zeros(DType::U8, &[8 * MIB]));
    assert_eq!(cached_buffer_bytes(), 0);
    set_buffer_cache_limit(64 * MIB);
    drop(HostTensor::zeros(DType::U8, &[8 * MIB]));
    assert_eq!(cached_buffer_bytes(), 8 * MIB);
    release_cached_buffers();
    assert_eq!(cached_buffer_bytes(), 0);
}
