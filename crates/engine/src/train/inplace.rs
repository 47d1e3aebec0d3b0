//! The boundary's gradient arithmetic without gradient-sized copies: unscaling and clipping
//! multiply the accumulation buffer where it lies (PyTorch's `GradScaler.unscale_` and
//! `clip_grad_norm_` do the same), and the pitfall's error is summed one parameter at a time.

use std::collections::HashSet;

use candle_core::{Result, Tensor};

use crate::ops::{fused, fused_domain};

/// `t ← factor · t` for every gradient. CPU f32 tensors are scaled in their own storage. Elsewhere
/// (CUDA, other dtypes) Candle has no in-place multiply, so each tensor is replaced by its scaled
/// copy and the old one freed before the next: at most one parameter's gradient is copied at a
/// time (`memory::estimate::boundary_copy_bytes`).
pub fn scale_in_place(grads: &mut [Tensor], factor: f64) -> Result<()> {
    own_storages(grads)?;
    for g in grads.iter_mut() {
        if fused_domain(&[g]) && g.is_contiguous() {
            fused::scale_in_place(g, factor as f32)?;
        } else {
            *g = g.affine(factor, 0.0)?;
        }
    }
    Ok(())
}

/// Give any gradient whose storage another one in `grads` also holds a storage of its own, so
/// scaling one storage in place cannot scale a gradient twice. Backward returns one fresh
/// storage per parameter, so this copies nothing in practice; it keeps the in-place path safe
/// if that ever changes.
fn own_storages(grads: &mut [Tensor]) -> Result<()> {
    let mut seen = HashSet::new();
    for g in grads.iter_mut() {
        let key = {
            let (storage, _) = g.storage_and_layout();
            &*storage as *const candle_core::Storage as usize
        };
        if !seen.insert(key) {
            *g = g.copy()?;
        }
    }
    Ok(())
}

/// Relative L2 error ‖a − r‖ / ‖r‖, one parameter's difference at a time (CPU f32: none at all).
pub fn relative_error(a: &[Tensor], reference: &[Tensor]) -> Result<f64> {
    let mut squared = 0f64;
    for (x, r) in a.iter().zip(reference) {
        squared += if fused_domain(&[x, r]) {
            fused::sum_squared_difference(x, r)?
        } else {
            super::global_norm(&[(x - r)?])?.powi(2)
        };
    }
    Ok(squared.sqrt() / super::global_norm(reference)?.max(f64::MIN_POSITIVE))
}
