//! The optimizer's element-wise work on CPU f32 tensors, in place: AdamW's moment and weight
//! updates as three passes over storage that already exists (the composite version allocates a
//! dozen temporaries per parameter), the boundary's unscaling and clipping, and the sums of
//! squares behind the gradient norm and the pitfall's error.

use candle_core::{CpuStorage, InplaceOp1, InplaceOp2, InplaceOp3, Layout, Result, Tensor};

use super::f32_slice;
use crate::ops::vmath;

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
    /// The (unscaled, clipped) gradient.
    pub g: Tensor,
    /// The update's scalars.
    pub step: AdamWStep,
}

/// Every job's `adamw_update`, parameters spread over the CPU pool, `ops::pool` (one hand-off for
/// the whole step instead of three per parameter).
pub fn adamw_update_all(jobs: &[AdamWJob]) -> Result<()> {
    let first_error = std::sync::Mutex::new(None);
    super::for_each_unit(jobs.len(), |range| {
        for j in &jobs[range] {
            if let Err(e) = adamw_update(j.w, j.m, j.v, &j.g, j.step) {
                // A poisoned lock still holds the first error: a panicking unit does not own it.
                let mut first = first_error.lock().unwrap_or_else(|p| p.into_inner());
                first.get_or_insert(e);
            }
        }
    });
    first_error
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .map_or(Ok(()), Err)
}

/// `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)g²`, `w ← decay·w − step_size·m / (√(v·inv_bc2) + ε)`,
/// all in place, on the calling thread.
fn adamw_update(w: &Tensor, m: &Tensor, v: &Tensor, g: &Tensor, s: AdamWStep) -> Result<()> {
    let g = g.contiguous()?;
    m.inplace_op2(
        &g,
        &Moment {
            beta: s.beta1,
            squared: false,
        },
    )?;
    v.inplace_op2(
        &g,
        &Moment {
            beta: s.beta2,
            squared: true,
        },
    )?;
    w.inplace_op3(m, v, &Update(s))
}

/// Σ x² of a CPU f32 tensor, accumulated in f64 per block of 1024 values.
pub fn sum_squares(t: &Tensor) -> Result<f64> {
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else {
        candle_core::bail!("sum_squares: expects a CPU tensor");
    };
    let x = f32_slice(cpu, layout, "sum_squares")?;
    Ok(x.chunks(1024)
        .map(|c| {
            vmath::widest(
                #[inline(always)]
                || f64::from(vmath::dot(c, c)),
            )
        })
        .sum())
}

/// Σ (a − b)² of two CPU f32 tensors of one shape, with no temporary tensor: the same blocks
/// of 1024 values and the same sums as `sum_squares` of the difference.
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
    let mut diff = [0f32; 1024];
    Ok(x.chunks(1024)
        .zip(y.chunks(1024))
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

/// `dst[i] = f(dst[i], a[i], b[i])`, vectorised, on the calling thread.
fn update_in_place(dst: &mut [f32], a: &[f32], b: &[f32], f: impl Fn(f32, f32, f32) -> f32) {
    assert!(a.len() == dst.len() && b.len() == dst.len());
    vmath::widest(
        #[inline(always)]
        || {
            for ((x, &a), &b) in dst.iter_mut().zip(a).zip(b) {
                *x = f(*x, a, b);
            }
        },
    )
}

struct Moment {
    beta: f32,
    squared: bool,
}

impl InplaceOp2 for Moment {
    fn name(&self) -> &'static str {
        "gaccwb-adamw-moment"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout, gs: &CpuStorage, gl: &Layout) -> Result<()> {
        let g = f32_slice(gs, gl, self.name())?;
        let m = slice_mut(s, l, self.name())?;
        if m.len() != g.len() {
            candle_core::bail!("adamw: moment of {} for a gradient of {}", m.len(), g.len());
        }
        let (beta, rest) = (self.beta, 1.0 - self.beta);
        if self.squared {
            update_in_place(m, g, g, |m, g, _| beta * m + rest * (g * g));
        } else {
            update_in_place(m, g, g, |m, g, _| beta * m + rest * g);
        }
        Ok(())
    }
}

struct Update(AdamWStep);

impl InplaceOp3 for Update {
    fn name(&self) -> &'static str {
        "gaccwb-adamw-update"
    }

    fn cpu_fwd(
        &self,
        ws: &mut CpuStorage,
        wl: &Layout,
        ms: &CpuStorage,
        ml: &Layout,
        vs: &CpuStorage,
        vl: &Layout,
    ) -> Result<()> {
        let m = f32_slice(ms, ml, self.name())?;
        let v = f32_slice(vs, vl, self.name())?;
        let w = slice_mut(ws, wl, self.name())?;
        let s = self.0;
        update_in_place(w, m, v, |w, m, v| {
            s.decay * w - s.step_size * m / ((v * s.inv_bc2).sqrt() + s.eps)
        });
        Ok(())
    }
}
