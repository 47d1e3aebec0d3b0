//! The token embedding's lookup with the table's gradient beside the graph: the backward adds
//! each position's gradient row into the table's held f32 gradient (`ops::GradTarget`) in
//! position order, where Candle's `index_select` backward would zero-fill a `[V, D]` tensor in
//! the store and copy it to add the rows.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use super::{storage, u32_slice};
use crate::ops::GradTarget;

/// Rows `ids` (`[N]` u32) of the f32 `table` (`[V, D]`), stored in `dtype`; the table's
/// gradient is added into `target`, never returned to the graph.
pub fn embedding(
    table: &Tensor,
    ids: &Tensor,
    dtype: DType,
    target: Arc<dyn GradTarget>,
) -> Result<Tensor> {
    if table.dtype() != DType::F32 || table.rank() != 2 {
        candle_core::bail!(
            "embedding: the table must be f32 [V, D], got {:?} {:?}",
            table.dtype(),
            table.dims()
        );
    }
    table
        .contiguous()?
        .apply_op2(&ids.contiguous()?, Embedding { dtype, target })
}

struct Embedding {
    dtype: DType,
    target: Arc<dyn GradTarget>,
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
        Ok((
            storage::in_dtype(rows, self.dtype)?,
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
        self.target.add_into(v * d, &mut |held| match held {
            Some(held) => {
                add_rows(held, &ids, &grad, d);
                None
            }
            None => {
                let mut first = vec![0f32; v * d];
                add_rows(&mut first, &ids, &grad, d);
                Some(first)
            }
        })?;
        Ok((None, None))
    }
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
