//! The CPU's f32 FMA peak: the rate its cores issue fused multiply-adds when nothing else
//! (loads, packing, waiting) is in the way. A product can approach it, never pass it, so it is
//! the ceiling a step's FLOP/s is read against beside the best measured product.
//!
//! Each thread runs `CHAINS` independent `x = x·b + c` chains in vector registers (enough to
//! cover the FMA latency on every x86 core: four cycles on two pipes wants eight in flight) for a
//! fixed count of rounds; the rate is the FLOPs of all threads over the time from the first one's
//! start to the last one's end. The widest FMA the CPU has is timed: 16 lanes on AVX-512F, 8 on AVX2 with FMA. Other
//! CPUs have no figure.

use std::time::Instant;

/// Independent accumulator chains per thread.
const CHAINS: usize = 12;

/// The f32 FMA rate of `threads` threads at once.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FmaPeak {
    /// FLOPs per second, all threads together (an FMA is two).
    pub flops_per_s: f64,
    /// Threads that ran the FMAs at once.
    pub threads: usize,
    /// The instructions timed: `avx512f` or `avx2 fma`.
    pub isa: &'static str,
}

/// Vector width and name of the widest f32 FMA this CPU has.
fn widest() -> Option<(usize, &'static str)> {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            return Some((16, "avx512f"));
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return Some((8, "avx2 fma"));
        }
    }
    None
}

/// FLOPs one thread's `rounds` rounds at `lanes` lanes do: an FMA per chain and lane, two FLOPs
/// each.
fn flops(rounds: u64, lanes: usize) -> f64 {
    2.0 * (rounds as f64) * (CHAINS * lanes) as f64
}

/// The best of `samples` timings on `threads` threads started together, each sample long enough
/// to take `SAMPLE_S`; `None` on a CPU without a vector FMA this module times.
pub fn fma_peak(threads: usize, samples: usize) -> Option<FmaPeak> {
    let (lanes, isa) = widest()?;
    let threads = threads.max(1);
    let mut rounds = 1 << 16;
    while time(threads, lanes, rounds) < SAMPLE_S && rounds < 1 << 40 {
        rounds *= 2;
    }
    let best = (0..samples.max(1))
        .map(|_| time(threads, lanes, rounds))
        .fold(f64::INFINITY, f64::min);
    Some(FmaPeak {
        flops_per_s: threads as f64 * flops(rounds, lanes) / best,
        threads,
        isa,
    })
}

/// Seconds one timed sample takes at least: long against a thread's start, short beside a step.
const SAMPLE_S: f64 = 0.03;

/// Wall seconds from the first of `threads` threads' start, together, until the last has run
/// `rounds` rounds. Each thread reads its own clock: the spawning thread may wait for a core
/// while they run.
fn time(threads: usize, lanes: usize, rounds: u64) -> f64 {
    let barrier = std::sync::Barrier::new(threads);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    let start = Instant::now();
                    std::hint::black_box(chains(lanes, rounds));
                    (start, Instant::now())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
            .collect()
    });
    let first = spans.iter().map(|s| s.0).min();
    let last = spans.iter().map(|s| s.1).max();
    first
        .zip(last)
        .map_or(f64::INFINITY, |(first, last)| (last - first).as_secs_f64())
}

/// Runs the chains at `lanes` lanes for `rounds` rounds and returns their sum (so none is dead).
fn chains(lanes: usize, rounds: u64) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `widest` chose `lanes` from the features this CPU reports.
        unsafe {
            match lanes {
                16 => return x86::avx512(rounds),
                8 => return x86::avx2(rounds),
                _ => {}
            }
        }
    }
    unreachable!("no FMA kernel for {lanes} lanes")
}

/// The chains in inline assembly, so that the loop is the same instructions at every
/// optimisation level (a debug build's intrinsics would time their calls, not the FMAs).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;
    use std::arch::x86_64::*;

    /// Defines `$name(rounds) -> f32`: twelve chains of `vfmadd213ps` (x = x·b + c) in `$class`
    /// registers of type `$vector`, for `rounds` rounds, then the sum of every lane.
    macro_rules! chains {
        ($name:ident, $feature:literal, $vector:ty, $class:ident, $lanes:literal, $set1:ident) => {
            /// # Safety
            #[doc = concat!("The CPU has `", $feature, "`.")]
            #[target_feature(enable = $feature)]
            pub(super) unsafe fn $name(rounds: u64) -> f32 {
                let (b, c): ($vector, $vector) = ($set1(0.99), $set1(0.01));
                // Seeds the compiler cannot see, so it folds no chains together.
                let mut x: [$vector; 12] =
                    std::array::from_fn(|i| $set1(std::hint::black_box(1.0) + i as f32));
                let [x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11] = &mut x;
                // SAFETY: registers only: no memory, no stack; `rounds` ≥ 1 so the count ends
                // at zero.
                unsafe {
                    asm!(
                        "2:",
                        "vfmadd213ps {x0}, {b}, {c}",
                        "vfmadd213ps {x1}, {b}, {c}",
                        "vfmadd213ps {x2}, {b}, {c}",
                        "vfmadd213ps {x3}, {b}, {c}",
                        "vfmadd213ps {x4}, {b}, {c}",
                        "vfmadd213ps {x5}, {b}, {c}",
                        "vfmadd213ps {x6}, {b}, {c}",
                        "vfmadd213ps {x7}, {b}, {c}",
                        "vfmadd213ps {x8}, {b}, {c}",
                        "vfmadd213ps {x9}, {b}, {c}",
                        "vfmadd213ps {x10}, {b}, {c}",
                        "vfmadd213ps {x11}, {b}, {c}",
                        "dec {n}",
                        "jnz 2b",
                        x0 = inout($class) *x0,
                        x1 = inout($class) *x1,
                        x2 = inout($class) *x2,
                        x3 = inout($class) *x3,
                        x4 = inout($class) *x4,
                        x5 = inout($class) *x5,
                        x6 = inout($class) *x6,
                        x7 = inout($class) *x7,
                        x8 = inout($class) *x8,
                        x9 = inout($class) *x9,
                        x10 = inout($class) *x10,
                        x11 = inout($class) *x11,
                        b = in($class) b,
                        c = in($class) c,
                        n = inout(reg) rounds.max(1) => _,
                        options(nomem, nostack),
                    );
                }
                // SAFETY: a vector of this type is `$lanes` f32 lanes, any bits of which are
                // an f32.
                let lanes: [[f32; $lanes]; 12] = unsafe { std::mem::transmute(x) };
                lanes.iter().flatten().sum()
            }
        };
    }

    chains!(avx2, "avx2,fma", __m256, ymm_reg, 8, _mm256_set1_ps);
    chains!(avx512, "avx512f", __m512, zmm_reg, 16, _mm512_set1_ps);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_fma_counts_two_flops_per_lane_and_chain() {
        assert_eq!(flops(1, 8), 192.0);
        assert_eq!(flops(1000, 16), 384_000.0);
    }

    #[test]
    fn the_peak_names_the_widest_fma_and_counts_every_thread() {
        let Some((lanes, isa)) = widest() else {
            assert!(fma_peak(1, 1).is_none());
            return;
        };
        let peak = fma_peak(2, 1).expect("a vector FMA");
        assert_eq!((peak.threads, peak.isa), (2, isa));
        assert!(peak.flops_per_s.is_finite() && peak.flops_per_s > 0.0);
        // The chains converge to 1 (b·1 + c = 1 within rounding): no overflow, no denormals.
        let sum = chains(lanes, 10_000);
        let expected = (CHAINS * lanes) as f32;
        assert!((sum - expected).abs() < 1e-2 * expected, "{sum}");
    }
}
