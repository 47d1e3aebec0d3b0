//! The token embedding's lookup with the table's gradient beside the graph: the backward adds
//! each position's gradient row into the table's held f32 gradient (`ops::GradTarget`) in
//! position order, where Candle's `index_select` backward would zero-fill a `[V, D]` tensor in
//! the store and copy it to add the rows.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::{storage, u32_slice};
use crate::ops::GradTarget;

/// A learned position table added to the token rows, its gradient beside the graph too.
pub struct Positions {
    /// The f32 table, `[P, D]`, P at least the sequence length.
    pub table: Tensor,
    /// Positions per sequence: row `i` of the batch takes position `i % len`.
    pub len: usize,
    /// Where the table's gradient is added.
    pub target: Arc<dyn GradTarget>,
}

/// Rows `ids` (`[N]` u32) of the f32 `table` (`[V, D]`) rounded to `dtype`, plus with
/// `positions` their position rows rounded alike (the sum rounded once more, as adding the two
/// stored tensors would), stored in `store`: `dtype`, or f32 for the residual stream of a
/// half-precision forward (`ops::widen_stream`), so that the output's gradient joins Candle's
/// graph in f32. The tables' gradients are added into their targets, never returned to the graph.
pub fn embedding(
    table: &Tensor,
    ids: &Tensor,
    (dtype, store): (DType, DType),
    target: Arc<dyn GradTarget>,
    positions: Option<Positions>,
) -> Result<Tensor> {
    let d = table.dim(1)?;
    let tables = [Some(table), positions.as_ref().map(|p| &p.table)];
    for t in tables.into_iter().flatten() {
        if t.dtype() != DType::F32 || t.rank() != 2 || t.dim(1)? != d {
            candle_core::bail!(
                "embedding: the tables must be f32 [_, {d}], got {:?} {:?}",
                t.dtype(),
                t.dims()
            );
        }
    }
    if let Some(p) = &positions {
        if p.len == 0 || p.len > p.table.dim(0)? || !ids.elem_count().is_multiple_of(p.len) {
            candle_core::bail!(
                "embedding: {} ids in sequences of {} with {} positions",
                ids.elem_count(),
                p.len,
                p.table.dim(0)?
            );
        }
    }
    let positions = positions
        .map(|p| -> Result<Positions> {
            Ok(Positions {
                table: p.table.contiguous()?.detach(),
                ..p
            })
        })
        .transpose()?;
    let op = Embedding {
        dtype,
        store,
        target,
        positions,
    };
    table.contiguous()?.apply_op2(&ids.contiguous()?, op)
}

struct Embedding {
    dtype: DType,
    store: DType,
    target: Arc<dyn GradTarget>,
    positions: Option<Positions>,
}

impl Embedding {
    /// Each row plus its position's row, both rounded to the compute dtype, the sum rounded.
    fn add_positions(&self, rows: &mut [f32], d: usize) -> Result<()> {
        let Some(p) = &self.positions else {
            return Ok(());
        };
        let (guard, layout) = p.table.storage_and_layout();
        let table = storage::input(storage::cpu(&guard, self.name())?, layout, self.name())?;
        let round = storage::rounding(self.dtype);
        for (i, row) in rows.chunks_exact_mut(d).enumerate() {
            let at = (i % p.len) * d;
            for (x, &q) in row.iter_mut().zip(&table[at..at + d]) {
                *x = round(round(*x) + round(q));
            }
        }
        Ok(())
    }
}

impl CustomOp2 for Embedding {
    fn name(&self) -> &'static str {
        "gaccwb-embedding"
    }

    fn cpu_fwd(
        &self,
        ts: &CpuStorage,
        tl: &Layout,
        is: &CpuStorage,
        il: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let table = storage::input(ts, tl, self.name())?;
        let ids = u32_slice(is, il, self.name())?;
        let (v, d) = (tl.dims()[0], tl.dims()[1]);
        let mut rows = Vec::with_capacity(ids.len() * d);
        for &id in ids {
            let id = id as usize;
            if id >= v {
                candle_core::bail!("embedding: token id {id} outside the vocabulary of {v}");
            }
            rows.extend_from_slice(&table[id * d..(id + 1) * d]);
        }
        // Adding the positions rounds every value; without them, the rows are rounded here.
        match self.positions {
            Some(_) => self.add_positions(&mut rows, d)?,
            None => storage::round_in_place(&mut rows, self.dtype),
        }
        Ok((
            storage::in_dtype(rows, self.store)?,
            Shape::from((ids.len(), d)),
        ))
    }

    fn bwd(
        &self,
        table: &Tensor,
        ids: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (v, d) = table.dims2()?;
        let grad = grad.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let ids = ids.to_vec1::<u32>()?;
        // Positions in order: the same sums at any thread count.
        add_beside(&*self.target, v * d, |held| add_rows(held, &ids, &grad, d))?;
        if let Some(p) = &self.positions {
            let at: Vec<u32> = (0..ids.len()).map(|i| (i % p.len) as u32).collect();
            let len = p.table.elem_count();
            add_beside(&*p.target, len, |held| add_rows(held, &at, &grad, d))?;
        }
        Ok((None, None))
    }
}

/// `add` run on `target`'s held gradient of `len` values, or on zeros that become it.
fn add_beside(target: &dyn GradTarget, len: usize, add: impl Fn(&mut [f32])) -> Result<()> {
    target.add_into(len, &mut |held| match held {
        Some(held) => {
            add(held);
            None
        }
        None => {
            let mut first = vec![0f32; len];
            add(&mut first);
            Some(first)
        }
    })
}

/// Each position's gradient row added into its token's row of `table`, in position order.
fn add_rows(table: &mut [f32], ids: &[u32], grad: &[f32], d: usize) {
    for (&id, row) in ids.iter().zip(grad.chunks_exact(d)) {
        let id = id as usize;
        table[id * d..(id + 1) * d]
            .iter_mut()
            .zip(row)
            .for_each(|(h, g)| *h += g);
    }
}
