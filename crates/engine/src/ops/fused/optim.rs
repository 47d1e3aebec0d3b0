//! The optimizer's element-wise work on CPU f32 tensors, in place: AdamW's moment and weight
//! updates in one pass over storage that already exists (the composite version allocates a
//! dozen temporaries per parameter), the boundary's unscaling and clipping, and the sums of
//! squares behind the gradient norm and the pitfall's error.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};

use candle_core::{CpuStorage, InplaceOp1, InplaceOp2, Layout, Result, Tensor};

use super::f32_slice;
use crate::ops::vmath;

/// Values per partial sum of squares (`sum_squares` and the sums that must give its bits): each
/// block's sum is made in f32, then added in f64.
const BLOCK: usize = 1024;

/// One AdamW update's scalars (the caller's `AdamW::step` documents the maths).
#[derive(Clone, Copy, Debug)]
pub struct AdamWStep {
    /// β₁, the first moment's decay.
    pub beta1: f32,
    /// β₂, the second moment's decay.
    pub beta2: f32,
    /// ε, added to the root of the second moment.
    pub eps: f32,
    /// lr / (1 − β₁ᵗ).
    pub step_size: f32,
    /// 1 / (1 − β₂ᵗ).
    pub inv_bc2: f32,
    /// 1 − lr·weight_decay, or 1 without decay.
    pub decay: f32,
}

/// One parameter's AdamW update: its weight, moments, gradient and scalars.
pub struct AdamWJob<'a> {
    /// The weight, updated in place.
    pub w: &'a Tensor,
    /// The first moment, updated in place.
    pub m: &'a Tensor,
    /// The second moment, updated in place.
    pub v: &'a Tensor,
    /// The unscaled gradient, clipped already or clipped by `adamw_update_all`'s factor.
    pub g: Tensor,
    /// The update's scalars.
    pub step: AdamWStep,
}

/// Every job's `adamw_update`, parameters spread over the CPU pool, `ops::pool` (one hand-off for
/// the whole step instead of three per parameter). With `clip`, each gradient is first multiplied
/// by it (gradient clipping's factor: the product `scale_in_place` makes, in the same pass as the
/// update instead of a pass of its own), and each job's Σ (clip·g)² is returned, the sum
/// `sum_squares` gives for the clipped gradient (same blocks, same order: the same bits);
/// without, nothing is returned.
pub fn adamw_update_all(jobs: &[AdamWJob], clip: Option<f32>) -> Result<Vec<f64>> {
    let first_error = Mutex::new(None);
    let squares = Mutex::new(vec![0f64; jobs.len()]);
    super::for_each_unit(jobs.len(), |range| {
        for i in range {
            let j = &jobs[i];
            // A poisoned lock still holds its value: a panicking unit does not own it.
            match adamw_update(j.w, j.m, j.v, &j.g, j.step, clip) {
                Ok(sum) => squares.lock().unwrap_or_else(PoisonError::into_inner)[i] = sum,
                Err(e) => {
                    let mut first = first_error.lock().unwrap_or_else(PoisonError::into_inner);
                    first.get_or_insert(e);
                }
            }
        }
    });
    match first_error
        .into_inner()
        .unwrap_or_else(PoisonError::into_inner)
    {
        Some(e) => Err(e),
        None if clip.is_some() => Ok(squares.into_inner().unwrap_or_else(PoisonError::into_inner)),
        None => Ok(Vec::new()),
    }
}

/// `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)g²`, `w ← decay·w − step_size·m / (√(v·inv_bc2) + ε)`,
/// all in place, on the calling thread, in one pass over the four arrays (28 bytes per parameter
/// moved; a pass per array moved 40), with `g` first multiplied by `clip` when given. Candle
/// lends one writable storage per in-place op, so the op on `m` lends its slice to an op on `v`,
/// which lends both to an op on `w`. Returns Σ (clip·g)² (0 without `clip`).
fn adamw_update(
    w: &Tensor,
    m: &Tensor,
    v: &Tensor,
    g: &Tensor,
    s: AdamWStep,
    clip: Option<f32>,
) -> Result<f64> {
    let g = g.contiguous()?;
    let squares = Cell::new(0.0);
    let moments = Moments {
        v,
        w,
        step: s,
        clip,
        squares: &squares,
    };
    m.inplace_op2(&g, &moments)?;
    Ok(squares.get())
}

/// Σ x² of a CPU f32 tensor, accumulated in f64 per block of `BLOCK` values.
pub fn sum_squares(t: &Tensor) -> Result<f64> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        candle_core::bail!("sum_squares: expects a CPU tensor");
    };
    let x = f32_slice(cpu, layout, "sum_squares")?;
    Ok(x.chunks(BLOCK).map(block_squares).sum())
}

/// Σ x² of one block (at most `BLOCK` values), as `sum_squares` and `sums_of_squares` add it.
fn block_squares(c: &[f32]) -> f64 {
    vmath::widest(
        #[inline(always)]
        || f64::from(vmath::dot(c, c)),
    )
}

/// `sum_squares` of each tensor, to the bit, with the blocks' sums made on the CPU pool (the
/// gradient norm reads every gradient: one thread alone is bound by its share of the memory
/// bandwidth) and then added in order, as `sum_squares` adds them.
pub fn sums_of_squares(ts: &[&Tensor]) -> Result<Vec<f64>> {
    let ts = ts
        .iter()
        .map(|t| t.contiguous())
        .collect::<Result<Vec<_>>>()?;
    let guards: Vec<_> = ts.iter().map(|t| t.storage_and_layout()).collect();
    let slices = guards
        .iter()
        .map(|(s, l)| match &**s {
            candle_core::Storage::Cpu(cpu) => f32_slice(cpu, l, "sum_squares"),
            _ => candle_core::bail!("sum_squares: expects a CPU tensor"),
        })
        .collect::<Result<Vec<_>>>()?;
    // Block b of the whole list lies in tensor i where starts[i] <= b < starts[i + 1].
    let mut starts = vec![0];
    for x in &slices {
        starts.push(starts[starts.len() - 1] + x.len().div_ceil(BLOCK));
    }
    let blocks: Vec<AtomicU64> = (0..starts[slices.len()])
        .map(|_| AtomicU64::new(0))
        .collect();
    super::for_each_unit(blocks.len(), |range| {
        for b in range {
            let i = starts.partition_point(|&s| s <= b) - 1;
            let x = slices[i];
            let at = (b - starts[i]) * BLOCK;
            let sum = block_squares(&x[at..(at + BLOCK).min(x.len())]);
            blocks[b].store(sum.to_bits(), Ordering::Relaxed);
        }
    });
    Ok(starts
        .windows(2)
        .map(|w| {
            blocks[w[0]..w[1]]
                .iter()
                .map(|s| f64::from_bits(s.load(Ordering::Relaxed)))
                .sum()
        })
        .collect())
}

/// Σ (a − b)² of two CPU f32 tensors of one shape, with no temporary tensor: the same blocks
/// of `BLOCK` values and the same sums as `sum_squares` of the difference.
pub fn sum_squared_difference(a: &Tensor, b: &Tensor) -> Result<f64> {
    let (a, b) = (a.contiguous()?, b.contiguous()?);
    let (sa, la) = a.storage_and_layout();
    let (sb, lb) = b.storage_and_layout();
    let (candle_core::Storage::Cpu(ca), candle_core::Storage::Cpu(cb)) = (&*sa, &*sb) else {
        candle_core::bail!("sum_squared_difference: expects CPU tensors");
    };
    let x = f32_slice(ca, la, "sum_squared_difference")?;
    let y = f32_slice(cb, lb, "sum_squared_difference")?;
    if x.len() != y.len() {
        candle_core::bail!("sum_squared_difference: {} vs {} values", x.len(), y.len());
    }
    let mut diff = [0f32; BLOCK];
    Ok(x.chunks(BLOCK)
        .zip(y.chunks(BLOCK))
        .map(|(x, y)| {
            let d = &mut diff[..x.len()];
            d.iter_mut()
                .zip(x.iter().zip(y))
                .for_each(|(d, (x, y))| *d = x - y);
            vmath::widest(
                #[inline(always)]
                || f64::from(vmath::dot(d, d)),
            )
        })
        .sum())
}

/// `t ← factor · t` in the tensor's own storage (gradients at the boundary: unscaling and
/// clipping). Every tensor sharing that storage sees the change.
pub fn scale_in_place(t: &Tensor, factor: f32) -> Result<()> {
    t.inplace_op1(&ScaleInPlace(factor))
}

struct ScaleInPlace(f32);

impl InplaceOp1 for ScaleInPlace {
    fn name(&self) -> &'static str {
        "gaccwb-scale-in-place"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        let x = slice_mut(s, l, self.name())?;
        let k = self.0;
        vmath::widest(
            #[inline(always)]
            || x.iter_mut().for_each(|x| *x *= k),
        );
        Ok(())
    }
}

fn slice_mut<'a>(s: &'a mut CpuStorage, l: &Layout, op: &str) -> Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(v), Some((a, b))) => Ok(&mut v[a..b]),
        _ => candle_core::bail!("{op}: expects contiguous f32 storage"),
    }
}

/// The first stage: `m` is lent by Candle; `v` and `w` are still to borrow.
struct Moments<'a> {
    v: &'a Tensor,
    w: &'a Tensor,
    step: AdamWStep,
    clip: Option<f32>,
    squares: &'a Cell<f64>,
}

impl InplaceOp2 for Moments<'_> {
    fn name(&self) -> &'static str {
        "gaccwb-adamw"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout, gs: &CpuStorage, gl: &Layout) -> Result<()> {
        let g = f32_slice(gs, gl, self.name())?;
        let m = slice_mut(s, l, self.name())?;
        let second = SecondMoment {
            m: RefCell::new(m),
            g,
            w: self.w,
            step: self.step,
            clip: self.clip,
            squares: self.squares,
        };
        self.v.inplace_op1(&second)
    }
}

/// The second stage: `m` from the first, `v` lent by Candle; `w` still to borrow.
struct SecondMoment<'a> {
    m: RefCell<&'a mut [f32]>,
    g: &'a [f32],
    w: &'a Tensor,
    step: AdamWStep,
    clip: Option<f32>,
    squares: &'a Cell<f64>,
}

impl InplaceOp1 for SecondMoment<'_> {
    fn name(&self) -> &'static str {
        "gaccwb-adamw"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        let v = slice_mut(s, l, self.name())?;
        let mut m = self.m.borrow_mut();
        let update = Update {
            m: RefCell::new(&mut m),
            v: RefCell::new(v),
            g: self.g,
            step: self.step,
            clip: self.clip,
            squares: self.squares,
        };
        self.w.inplace_op1(&update)
    }
}

/// The last stage: all four arrays at hand, `w` lent by Candle.
struct Update<'a> {
    m: RefCell<&'a mut [f32]>,
    v: RefCell<&'a mut [f32]>,
    g: &'a [f32],
    step: AdamWStep,
    clip: Option<f32>,
    squares: &'a Cell<f64>,
}

impl InplaceOp1 for Update<'_> {
    fn name(&self) -> &'static str {
        "gaccwb-adamw"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        let w = slice_mut(s, l, self.name())?;
        let (mut m, mut v) = (self.m.borrow_mut(), self.v.borrow_mut());
        let (m, v, g) = (&mut **m, &mut **v, self.g);
        if m.len() != w.len() || v.len() != w.len() || g.len() != w.len() {
            candle_core::bail!(
                "adamw: weight of {}, moments of {} and {}, gradient of {}",
                w.len(),
                m.len(),
                v.len(),
                g.len()
            );
        }
        let s = self.step;
        let Some(k) = self.clip else {
            vmath::widest(
                #[inline(always)]
                || adamw_block(w, m, v, g, s),
            );
            return Ok(());
        };
        // Clipped: block by block (`sum_squares`' blocks), the block's clipped gradient made
        // once, squared and summed as `sum_squares` sums it, then used for the update.
        let mut clipped = [0f32; BLOCK];
        let sum = vmath::widest(
            #[inline(always)]
            || {
                let mut sum = 0f64;
                let blocks = w.chunks_mut(BLOCK).zip(m.chunks_mut(BLOCK));
                for ((w, m), (v, g)) in blocks.zip(v.chunks_mut(BLOCK).zip(g.chunks(BLOCK))) {
                    let c = &mut clipped[..g.len()];
                    c.iter_mut().zip(g).for_each(|(c, &g)| *c = g * k);
                    sum += f64::from(vmath::dot(c, c));
                    adamw_block(w, m, v, c, s);
                }
                sum
            },
        );
        self.squares.set(sum);
        Ok(())
    }
}

/// AdamW on one block of the four arrays (inlined into the caller's SIMD target).
#[inline(always)]
fn adamw_block(w: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], s: AdamWStep) {
    let (b1, r1, b2, r2) = (s.beta1, 1.0 - s.beta1, s.beta2, 1.0 - s.beta2);
    for (((w, m), v), &g) in w.iter_mut().zip(m.iter_mut()).zip(v.iter_mut()).zip(g) {
        *m = b1 * *m + r1 * g;
        *v = b2 * *v + r2 * (g * g);
        *w = s.decay * *w - s.step_size * *m / ((*v * s.inv_bc2).sqrt() + s.eps);
    }
}
