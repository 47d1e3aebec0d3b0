//! Element-wise math that vectorises: a branch-free `exp` (Cephes' polynomial, within 2 ulp of
//! libm on the range it is used on) and a dispatcher that compiles a kernel for the widest
//! instruction set the CPU has. Floating-point contraction stays off (Rust never fuses `a*b+c`
//! on its own), so every instruction set computes the same bits.

const LOG2_E: f32 = std::f32::consts::LOG2_E;
const LN_2_HI: f32 = 0.693_359_4;
const LN_2_LO: f32 = -2.121_944_4e-4;

/// `e^x` for `x` in [-87, 88] (clamped outside: 1.6e-38 below, 1.7e38 above).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    // Round x·log2(e) to the nearest integer n by adding 1.5·2²³: n then sits in the low
    // mantissa bits, which become 2ⁿ's exponent field with integer ops that vectorise (a float
    // to int cast does not, on every target).
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.0, 88.0);
    let shifted = x * LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = x - n * LN_2_HI - n * LN_2_LO;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let e = p * r * r + r + 1.0;
    let two_n = (shifted
        .to_bits()
        .wrapping_sub(ROUND.to_bits())
        .wrapping_add(127))
        << 23;
    e * f32::from_bits(two_n)
}

/// Runs `kernel` compiled for AVX-512 or AVX2 when the CPU has them, else as built.
/// Closures passed here should be `#[inline(always)]` so their loops are compiled inside.
#[inline(always)]
pub(crate) fn widest<R>(kernel: impl FnOnce() -> R) -> R {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU supports the features the function is compiled for.
            return unsafe { avx512(kernel) };
        }
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: as above.
            return unsafe { avx2(kernel) };
        }
    }
    kernel()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,avx")]
unsafe fn avx512<R>(kernel: impl FnOnce() -> R) -> R {
    kernel()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,avx")]
unsafe fn avx2<R>(kernel: impl FnOnce() -> R) -> R {
    kernel()
}

/// Σ a·b with 16 independent partial sums (vectorises; a fixed order, so deterministic).
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let (ac, bc) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = ac
        .remainder()
        .iter()
        .zip(bc.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..16 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// Σ a, as `dot`.
#[inline(always)]
pub(crate) fn sum(a: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    let chunks = a.chunks_exact(16);
    let tail: f32 = chunks.remainder().iter().sum();
    for x in chunks {
        for i in 0..16 {
            acc[i] += x[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// max over a (−∞ when empty).
#[inline(always)]
pub(crate) fn max(a: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; 16];
    let chunks = a.chunks_exact(16);
    let tail = chunks
        .remainder()
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    for x in chunks {
        for i in 0..16 {
            acc[i] = acc[i].max(x[i]);
        }
    }
    acc.iter().fold(tail, |m, &v| m.max(v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_libm() {
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let (a, b) = (exp(x) as f64, (x as f64).exp());
            worst = worst.max(((a - b) / b).abs());
            x += 0.001_3;
        }
        assert!(worst < 2.5e-7, "worst relative error {worst:e}");
        assert_eq!(exp(0.0), 1.0);
        assert!(exp(-1e4) < 1e-37 && exp(-1e4) >= 0.0);
    }

    #[test]
    fn reductions_match_the_plain_sums() {
        let v: Vec<f32> = (0..101).map(|i| (i as f32 * 0.37).sin()).collect();
        let close = |a: f32, b: f32| (a - b).abs() <= 1e-6 * b.abs().max(1.0);
        assert!(close(sum(&v), v.iter().sum()));
        assert!(close(dot(&v, &v), v.iter().map(|x| x * x).sum()));
        assert_eq!(max(&v), v.iter().cloned().fold(f32::MIN, f32::max));
        assert_eq!(widest(|| sum(&v)), sum(&v));
    }
}
