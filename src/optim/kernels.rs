//! Element-wise optimizer kernels that reproduce PyTorch's CPU kernels bit for bit.
//!
//! Each torch op is one rounding to the storage dtype ([`rt`]); inside an op, arithmetic is in
//! the op type (`opmath`: f32 for f32/bf16/f16, f64 for f64), and Python scalars are converted
//! to it once, as `Scalar::to<opmath_t>()` does. Measured against PyTorch 2.13 (AVX512 build):
//! `add(other, alpha)` is `fma(other, alpha, self)`, `lerp` is `fma(w, end - self, self)` for
//! `|w| < 0.5` else `fma(w - 1, end - self, end)`, `addcmul` is `fma(value * t1, t2, self)`,
//! `addcdiv` is `self + (value * t1) / t2` and `div` by a scalar is a true division, in the
//! vectorized body and the scalar tail alike.
//!
//! bf16/f16 quirks of `add(other, alpha=)`: `alpha` is first converted to the tensor's dtype
//! (other scalars stay in f32), see [`alpha`]; and while the vectorized body computes
//! `fma(other, alpha, self)` in f32, the scalar tail of the CPU loop (the last
//! `numel % REDUCED_BLOCK` elements) uses `BFloat16`/`Half` operators, rounding `alpha * other`
//! before the add. [`add_alpha`] reproduces this for a tensor processed as one chunk, which is
//! what PyTorch does below 32768 elements (its grain size) or with one thread; larger tensors
//! on several threads get one tail per thread chunk there, so a few elements may differ. Fusing the ops of one step per element changes
//! nothing because every op is element-wise.

use crate::tensor::Element;
use half::{bf16, f16};
use std::ops::{Add, Div, Mul, Neg, Sub};

/// Arithmetic type of the kernels (`opmath`).
pub(crate) trait Real:
    Copy
    + PartialOrd
    + Neg<Output = Self>
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
{
    const ONE: Self;
    const HALF: Self;
    /// A Python float as a C++ `Scalar` converted to this type (round to nearest).
    fn from_f64(x: f64) -> Self;
    /// `self * a + b` with one rounding.
    fn fma(self, a: Self, b: Self) -> Self;
    /// IEEE square root (correctly rounded).
    fn sqrt(self) -> Self;
    fn abs(self) -> Self;
    fn is_nan(self) -> bool;
}

macro_rules! real {
    ($t:ty) => {
        impl Real for $t {
            const ONE: Self = 1.0;
            const HALF: Self = 0.5;
            #[inline]
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            #[inline]
            fn fma(self, a: Self, b: Self) -> Self {
                self.mul_add(a, b)
            }
            #[inline]
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
            #[inline]
            fn abs(self) -> Self {
                <$t>::abs(self)
            }
            #[inline]
            fn is_nan(self) -> bool {
                <$t>::is_nan(self)
            }
        }
    };
}
real!(f32);
real!(f64);

/// Elements per iteration of PyTorch's vectorized CPU loop for 2-byte types:
/// `2 * Vectorized<BFloat16>::size()` with the AVX512 CPU capability (32 with AVX2).
pub(crate) const REDUCED_BLOCK: usize = 64;

/// A storage element type and its `opmath` type.
pub(crate) trait Store: Element {
    type Op: Real;
    /// bf16/f16: scalar-tail arithmetic rounds every operator result (see the module docs).
    const REDUCED: bool = false;
    fn load(self) -> Self::Op;
    fn store(x: Self::Op) -> Self;
}

impl Store for f32 {
    type Op = f32;
    #[inline]
    fn load(self) -> f32 {
        self
    }
    #[inline]
    fn store(x: f32) -> f32 {
        x
    }
}

impl Store for f64 {
    type Op = f64;
    #[inline]
    fn load(self) -> f64 {
        self
    }
    #[inline]
    fn store(x: f64) -> f64 {
        x
    }
}

impl Store for bf16 {
    type Op = f32;
    const REDUCED: bool = true;
    #[inline]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline]
    fn store(x: f32) -> bf16 {
        bf16::from_f32(x)
    }
}

impl Store for f16 {
    type Op = f32;
    const REDUCED: bool = true;
    #[inline]
    fn load(self) -> f32 {
        self.to_f32()
    }
    #[inline]
    fn store(x: f32) -> f16 {
        f16::from_f32(x)
    }
}

/// Rounds an op result to the storage type (the end of one torch op); identity for f32/f64.
#[inline]
fn rt<S: Store>(x: S::Op) -> S::Op {
    S::store(x).load()
}

/// The `alpha` of `Tensor.add(other, alpha=)`: converted to the storage dtype (`alpha.to<scalar_t>()`,
/// via f32 for the half types), then computed with in `opmath`.
#[inline]
fn alpha<S: Store>(x: f64) -> S::Op {
    rt::<S>(<S::Op as Real>::from_f64(x))
}

/// `self.add(other, alpha=alpha)` (with `alpha` from [`alpha`]); `tail` = the element is in the
/// scalar tail of PyTorch's CPU loop.
#[inline]
fn add_alpha<S: Store>(this: S::Op, other: S::Op, alpha: S::Op, tail: bool) -> S::Op {
    if S::REDUCED && tail {
        rt::<S>(this + rt::<S>(alpha * other))
    } else {
        rt::<S>(other.fma(alpha, this))
    }
}

/// First index of the scalar tail of a 1-chunk CPU loop over `n` elements.
#[inline]
fn tail_start<S: Store>(n: usize) -> usize {
    if S::REDUCED {
        n - n % REDUCED_BLOCK
    } else {
        n
    }
}

/// `torch.maximum`: NaN-propagating.
#[inline]
fn maximum<T: Real>(a: T, b: T) -> T {
    if a.is_nan() {
        a
    } else if b.is_nan() || b > a {
        b
    } else {
        a
    }
}

/// Per-step scalars of one Adam parameter update, as Python computes them (in f64).
#[derive(Debug, Clone, Copy)]
pub(crate) struct AdamScalars {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    pub maximize: bool,
    pub decoupled: bool,
    /// `lr / (1 - beta1 ** step)`.
    pub step_size: f64,
    /// `(1 - beta2 ** step) ** 0.5`.
    pub bias_correction2_sqrt: f64,
}

/// `_single_tensor_adam` for one parameter (after `step_t += 1`).
pub(crate) fn adam<S: Store>(
    p: &mut [S],
    g: &[S],
    m: &mut [S],
    v: &mut [S],
    mut mx: Option<&mut [S]>,
    h: &AdamScalars,
) {
    let s = <S::Op as Real>::from_f64;
    let wd = alpha::<S>(h.weight_decay);
    let decay = s(1.0 - h.lr * h.weight_decay);
    let apply_wd = h.weight_decay != 0.0;
    // exp_avg.lerp_(grad, 1 - beta1)
    let w = s(1.0 - h.beta1);
    let w_small = w.abs() < <S::Op as Real>::HALF;
    let w_minus_one = w - <S::Op as Real>::ONE;
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    let beta2 = s(h.beta2);
    let one_minus_beta2 = s(1.0 - h.beta2);
    let bc2 = s(h.bias_correction2_sqrt);
    let eps = s(h.eps);
    let neg_step_size = s(-h.step_size);
    let tail = tail_start::<S>(p.len());
    for i in 0..p.len() {
        let mut param = p[i].load();
        let mut grad = g[i].load();
        if h.maximize {
            grad = -grad;
        }
        if apply_wd {
            if h.decoupled {
                param = rt::<S>(param * decay); // param.mul_(1 - lr * weight_decay)
            } else {
                grad = add_alpha::<S>(grad, param, wd, i >= tail); // grad.add(param, alpha=weight_decay)
            }
        }
        let avg = m[i].load();
        let diff = grad - avg;
        let avg = rt::<S>(if w_small {
            w.fma(diff, avg)
        } else {
            w_minus_one.fma(diff, grad)
        });
        m[i] = S::store(avg);
        let sq = rt::<S>(v[i].load() * beta2);
        let sq = rt::<S>((one_minus_beta2 * grad).fma(grad, sq));
        v[i] = S::store(sq);
        let second = match mx.as_deref_mut() {
            Some(mx) => {
                let x = maximum(mx[i].load(), sq);
                mx[i] = S::store(x);
                x
            }
            None => sq,
        };
        // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        let denom = rt::<S>(rt::<S>(rt::<S>(second.sqrt()) / bc2) + eps);
        // param.addcdiv_(exp_avg, denom, value=-step_size)
        param = rt::<S>(param + (neg_step_size * avg) / denom);
        p[i] = S::store(param);
    }
}

/// Per-group scalars of an SGD update.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SgdScalars {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
    pub maximize: bool,
}

/// `_single_tensor_sgd` for one parameter. `buf` is the momentum buffer (when momentum != 0)
/// and whether it is new (`buf = grad.clone()`) or existing.
pub(crate) fn sgd<S: Store>(
    p: &mut [S],
    g: &[S],
    mut buf: Option<(&mut [S], bool)>,
    h: &SgdScalars,
) {
    let s = <S::Op as Real>::from_f64;
    let wd = alpha::<S>(h.weight_decay);
    let apply_wd = h.weight_decay != 0.0;
    let momentum = s(h.momentum); // buf.mul_(momentum)
    let momentum_alpha = alpha::<S>(h.momentum); // grad.add(buf, alpha=momentum)
    let one_minus_dampening = alpha::<S>(1.0 - h.dampening);
    let neg_lr = alpha::<S>(-h.lr);
    let tail_from = tail_start::<S>(p.len());
    for i in 0..p.len() {
        let tail = i >= tail_from;
        let param = p[i].load();
        let mut grad = g[i].load();
        if h.maximize {
            grad = -grad;
        }
        if apply_wd {
            grad = add_alpha::<S>(grad, param, wd, tail); // grad.add(param, alpha=weight_decay)
        }
        if let Some((b, fresh)) = buf.as_mut() {
            let value = if *fresh {
                grad // buf = grad.detach().clone()
            } else {
                // buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                let scaled = rt::<S>(b[i].load() * momentum);
                add_alpha::<S>(scaled, grad, one_minus_dampening, tail)
            };
            b[i] = S::store(value);
            grad = if h.nesterov {
                add_alpha::<S>(grad, value, momentum_alpha, tail) // grad.add(buf, alpha=momentum)
            } else {
                value
            };
        }
        // param.add_(grad, alpha=-lr)
        p[i] = S::store(add_alpha::<S>(param, grad, neg_lr, tail));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lerp_branches_match_torch_formulas() {
        // weight >= 0.5 uses `end - (end - self) * (1 - weight)`, fused.
        let h = AdamScalars {
            lr: 0.0,
            beta1: 0.25,
            beta2: 0.5,
            eps: 1.0,
            weight_decay: 0.0,
            maximize: false,
            decoupled: false,
            step_size: 0.0,
            bias_correction2_sqrt: 1.0,
        };
        let mut p = [0.0f32];
        let mut m = [1.0f32];
        let mut v = [0.0f32];
        adam(&mut p, &[3.0f32], &mut m, &mut v, None, &h);
        assert_eq!(m[0], (0.75f32 - 1.0).mul_add(2.0, 3.0));
        assert_eq!(v[0], 4.5);
    }

    #[test]
    fn maximum_propagates_nan() {
        assert!(maximum(f32::NAN, 1.0).is_nan());
        assert!(maximum(1.0, f32::NAN).is_nan());
        assert_eq!(maximum(1.0f32, 2.0), 2.0);
    }

    #[test]
    fn bf16_rounds_after_each_op() {
        let h = SgdScalars {
            lr: 0.1,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            maximize: false,
        };
        let mut p = [bf16::from_f32(1.0)];
        sgd(&mut p, &[bf16::from_f32(1.0)], None, &h);
        // alpha=-lr is rounded to bf16; one element is PyTorch's scalar tail: the product is
        // rounded to bf16 before the add.
        let lr = bf16::from_f32(-0.1).to_f32();
        let prod = bf16::from_f32(lr * 1.0).to_f32();
        assert_eq!(p[0], bf16::from_f32(1.0 + prod));
    }
}
