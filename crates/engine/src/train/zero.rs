//! ZeRO stages 1 and 2 over the data-parallel ranks: each rank keeps the AdamW moments of one
//! W-th of the parameters (stage 1), and with stage 2 the summed gradient of that W-th only.
//!
//! The parameters, flattened and concatenated in order, are cut into W equal blocks (the last
//! padded); rank r owns block r, which crosses parameter boundaries, so each parameter has a
//! piece (maybe empty) on each rank. The update runs the fused AdamW kernel on the pieces, in
//! place in the weights, with the same scalars as the unsharded step (so every element gets the
//! same arithmetic), then an all-gather of the blocks gives every rank the whole updated
//! weights. Stage 2 gets its gradient pieces from a reduce-scatter: of the whole window's buffer
//! (`zero2_accumulate = "buffer"`), or of each micro-batch's gradients, accumulating only the
//! piece (`"reduce-scatter"`: 1/W of the buffer, K× the gradient traffic).

use candle_core::{DType, Device, Result, Tensor};

use super::adamw::AdamW;
use crate::dist::Group;
use crate::model::Param;
use crate::ops::fused::{adamw_update_all, AdamWJob};
use crate::ops::fused_domain;

/// This rank's block of the flattened parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct Shard {
    /// Per parameter, in order: the first element of its piece and the piece's length.
    pieces: Vec<(usize, usize)>,
    /// Elements in each rank's block (the last rank's padded).
    block: usize,
    /// Elements of every parameter together.
    total: usize,
}

impl Shard {
    /// Rank `rank`'s block of parameters with `sizes` elements each, over `ranks` ranks.
    pub fn new(sizes: &[usize], rank: usize, ranks: usize) -> Shard {
        let total: usize = sizes.iter().sum();
        let block = total.div_ceil(ranks.max(1));
        let (lo, hi) = ((rank * block).min(total), ((rank + 1) * block).min(total));
        let mut offset = 0;
        let pieces = sizes
            .iter()
            .map(|&n| {
                let (start, end) = (lo.max(offset), hi.min(offset + n));
                let piece = if start < end {
                    (start - offset, end - start)
                } else {
                    (0, 0)
                };
                offset += n;
                piece
            })
            .collect();
        Shard {
            pieces,
            block,
            total,
        }
    }

    /// The shard of `params` for this process's place in `group`.
    pub fn of(params: &[Param], group: &Group) -> Shard {
        let sizes: Vec<usize> = params.iter().map(|p| p.var.elem_count()).collect();
        Shard::new(&sizes, group.rank(), group.ranks())
    }

    /// Elements this rank owns.
    pub fn len(&self) -> usize {
        self.pieces.iter().map(|p| p.1).sum()
    }

    /// Whether this rank owns nothing (more ranks than elements).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// This rank's piece of each whole tensor, as 1-D views (no copy).
    pub fn pieces_of(&self, tensors: &[Tensor]) -> Result<Vec<Tensor>> {
        tensors
            .iter()
            .zip(&self.pieces)
            .map(|(t, &(start, len))| t.flatten_all()?.narrow(0, start, len))
            .collect()
    }

    /// The whole tensors flattened into one f32 vector of W blocks, padded.
    fn flat(&self, tensors: &[Tensor], ranks: usize) -> Result<Vec<f32>> {
        let mut flat = Vec::with_capacity(self.block * ranks);
        for t in tensors {
            flat.extend(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
        }
        flat.resize(self.block * ranks, 0.0);
        Ok(flat)
    }

    /// This rank's pieces of the sum over the ranks of `tensors` (whole gradients), as 1-D
    /// tensors on `device`: one reduce-scatter.
    pub fn reduce_scatter(
        &self,
        tensors: &[Tensor],
        group: &mut Group,
        device: &Device,
    ) -> Result<Vec<Tensor>> {
        let flat = self.flat(tensors, group.ranks())?;
        let mine = group.reduce_scatter(&flat);
        let mut at = 0;
        self.pieces
            .iter()
            .map(|&(_, len)| {
                let piece = Tensor::from_slice(&mine[at..at + len], len, device);
                at += len;
                piece
            })
            .collect()
    }

    /// Every rank's pieces (`pieces`: this rank's, one per parameter) gathered into whole
    /// tensors shaped like `params`: one all-gather.
    fn gather_whole(
        &self,
        pieces: &[Tensor],
        params: &[Param],
        group: &mut Group,
    ) -> Result<Vec<Tensor>> {
        let mut block = Vec::with_capacity(self.block);
        for piece in pieces {
            block.extend(piece.to_vec1::<f32>()?);
        }
        block.resize(self.block, 0.0);
        let all = group.all_gather(&block);
        let mut offset = 0;
        let whole = params
            .iter()
            .map(|p| {
                let n = p.var.elem_count();
                let t = Tensor::from_slice(&all[offset..offset + n], p.var.shape(), p.var.device());
                offset += n;
                t
            })
            .collect();
        debug_assert_eq!(offset, self.total);
        whole
    }

    /// Every rank's updated pieces (`pieces`: this rank's) gathered into the whole weights.
    fn gather_weights(&self, pieces: &[Tensor], params: &[Param], group: &mut Group) -> Result<()> {
        let whole = self.gather_whole(pieces, params, group)?;
        for (p, w) in params.iter().zip(&whole) {
            p.var.set(w)?;
        }
        Ok(())
    }
}

/// Keep only this rank's pieces of whole AdamW moments (from stage 0), values unchanged:
/// 8 bytes per owned element.
pub(crate) fn cut_moments(opt: &mut AdamW, shard: &Shard) -> Result<()> {
    let cut = |whole: &[Tensor]| -> Result<Vec<Tensor>> {
        // A copy of each piece alone: a view would keep the whole moment's storage alive.
        shard
            .pieces_of(whole)?
            .iter()
            .map(|p| Tensor::from_vec(p.to_vec1::<f32>()?, p.elem_count(), p.device()))
            .collect()
    };
    opt.m = cut(&opt.m)?;
    opt.v = cut(&opt.v)?;
    Ok(())
}

/// Whole AdamW moments again (to stage 0), from every rank's pieces.
pub(crate) fn gather_moments(
    opt: &mut AdamW,
    shard: &Shard,
    params: &[Param],
    group: &mut Group,
) -> Result<()> {
    (opt.m, opt.v) = whole_moments(opt, shard, params, group)?;
    Ok(())
}

/// Whole copies of the AdamW moments (`m`, then `v`), shaped like `params`, from every rank's
/// pieces, leaving `opt` sharded: what a checkpoint saves. Two all-gathers, on every rank.
pub(crate) fn whole_moments(
    opt: &AdamW,
    shard: &Shard,
    params: &[Param],
    group: &mut Group,
) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
    let m = shard.gather_whole(&opt.m, params, group)?;
    Ok((m, shard.gather_whole(&opt.v, params, group)?))
}

/// One AdamW update of this rank's pieces from their gradients (`grads`: one piece per
/// parameter, unscaled and clipped), then the all-gather. The scalars are `AdamW::step`'s, so
/// each element is updated as the unsharded step would update it: on the CPU in f32 by the
/// fused kernel, in place in the weights; elsewhere (a GPU, or the lean kernels) by the
/// same Candle ops as the unsharded step, into new pieces that the all-gather assembles.
pub(crate) fn step(
    opt: &mut AdamW,
    shard: &Shard,
    params: &[Param],
    grads: &[Tensor],
    lr: f64,
    group: &mut Group,
) -> Result<()> {
    let scalars = opt.begin_step(lr);
    let weights: Vec<Tensor> = params.iter().map(|p| p.var.as_tensor().clone()).collect();
    let mut pieces = shard.pieces_of(&weights)?;
    let grads = grads
        .iter()
        .map(|g| g.contiguous())
        .collect::<Result<Vec<_>>>()?;
    let mut fused = Vec::new();
    for (i, p) in params.iter().enumerate() {
        if pieces[i].elem_count() == 0 {
            continue;
        }
        if fused_domain(&[&pieces[i], &opt.m[i], &opt.v[i], &grads[i]]) {
            fused.push(i);
            continue;
        }
        let updated = scalars.update_by_ops(p, &pieces[i], &opt.m[i], &opt.v[i], &grads[i])?;
        (opt.m[i], opt.v[i], pieces[i]) = (updated.m, updated.v, updated.w);
    }
    let jobs: Vec<AdamWJob> = fused
        .into_iter()
        .map(|i| AdamWJob {
            w: &pieces[i],
            m: &opt.m[i],
            v: &opt.v[i],
            g: grads[i].clone(),
            step: scalars.fused(&params[i]),
        })
        .collect();
    adamw_update_all(&jobs, None)?;
    drop(jobs);
    shard.gather_weights(&pieces, params, group)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_cover_every_element_once_across_parameter_boundaries() {
        let sizes = [5, 3, 4];
        let shards: Vec<Shard> = (0..3).map(|r| Shard::new(&sizes, r, 3)).collect();
        assert_eq!(shards[0].pieces, [(0, 4), (0, 0), (0, 0)]);
        assert_eq!(shards[1].pieces, [(4, 1), (0, 3), (0, 0)]);
        assert_eq!(shards[2].pieces, [(0, 0), (0, 0), (0, 4)]);
        assert_eq!(shards.iter().map(Shard::len).sum::<usize>(), 12);
    }

    #[test]
    fn the_last_block_is_padded_and_a_surplus_rank_owns_nothing() {
        let s = Shard::new(&[10], 3, 4);
        assert_eq!((s.block, s.pieces[0].1), (3, 1));
        let empty = Shard::new(&[2], 3, 4);
        assert!(empty.is_empty());
    }

    #[test]
    fn one_rank_owns_everything() {
        let s = Shard::new(&[5, 3], 0, 1);
        assert_eq!(s.pieces, [(0, 5), (0, 3)]);
    }
}
