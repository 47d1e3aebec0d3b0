//! Bytes held by tensors, counted once per storage: views (reshape, transpose, narrow,
//! broadcast) share their parent's storage and must not be counted twice.

use std::collections::{HashMap, HashSet};
use std::sync::{LazyLock, Mutex, PoisonError};

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, Layout, Storage, Tensor, TensorId};

/// Storages already counted; a storage is identified by its address, stable while any tensor
/// holds it.
#[derive(Default)]
pub struct StorageSet {
    seen: HashSet<usize>,
}

impl StorageSet {
    /// Bytes of `t`'s storage if it has not been counted yet, else 0.
    pub fn add(&mut self, t: &Tensor) -> u64 {
        let (storage, layout) = t.storage_and_layout();
        let key = &*storage as *const Storage as usize;
        if !self.seen.insert(key) {
            return 0;
        }
        storage_bytes(&storage, layout)
    }

    /// Sum of `add` over `tensors`.
    pub fn add_all<'a>(&mut self, tensors: impl IntoIterator<Item = &'a Tensor>) -> u64 {
        tensors.into_iter().map(|t| self.add(t)).sum()
    }
}

/// Bytes of a storage: exact on the CPU (the vector's length); elsewhere the extent this view
/// reaches, which is the allocation for the contiguous tensors the model creates.
fn storage_bytes(storage: &Storage, layout: &Layout) -> u64 {
    match storage {
        Storage::Cpu(cpu) => cpu_bytes(cpu),
        _ => view_extent(layout) * storage.dtype().size_in_bytes() as u64,
    }
}

fn cpu_bytes(s: &CpuStorage) -> u64 {
    let bytes = match s {
        CpuStorage::U8(v)
        | CpuStorage::F6E2M3(v)
        | CpuStorage::F6E3M2(v)
        | CpuStorage::F4(v)
        | CpuStorage::F8E8M0(v) => std::mem::size_of_val(v.as_slice()),
        CpuStorage::U32(v) => std::mem::size_of_val(v.as_slice()),
        CpuStorage::I16(v) => std::mem::size_of_val(v.as_slice()),
        CpuStorage::I32(v) => std::mem::size_of_val(v.as_slice()),
        CpuStorage::I64(v) => std::mem::size_of_val(v.as_slice()),
        CpuStorage::BF16(v) => std::mem::size_of_val(v.as_slice()),
        CpuStorage::F16(v) => std::mem::size_of_val(v.as_slice()),
        CpuStorage::F32(v) => std::mem::size_of_val(v.as_slice()),
        CpuStorage::F64(v) => std::mem::size_of_val(v.as_slice()),
        CpuStorage::F8E4M3(v) => std::mem::size_of_val(v.as_slice()),
    };
    bytes as u64
}

/// Elements from the start of the storage to the last one this layout can address.
fn view_extent(layout: &Layout) -> u64 {
    let dims = layout.dims();
    if dims.contains(&0) {
        return 0;
    }
    let last: usize = dims
        .iter()
        .zip(layout.stride())
        .map(|(d, s)| (d - 1) * s)
        .sum();
    (layout.start_offset() + last + 1) as u64
}

/// Bytes of every gradient in a store, constants' gradients included.
pub fn grad_store_bytes(store: &GradStore, seen: &mut StorageSet) -> u64 {
    store
        .get_ids()
        .filter_map(|id| store.get_id(*id))
        .map(|g| seen.add(g))
        .sum()
}

/// Bytes of the tensors the graph behind `loss` keeps alive for backward, counting each storage
/// once and skipping storages already in `seen` (parameters, compute weights). Tensors an op
/// keeps in its own fields (`keep_beside`) count with the op's output.
pub fn activation_bytes(loss: &Tensor, seen: &mut StorageSet) -> u64 {
    let nodes = loss.sorted_nodes();
    let beside = BESIDE.lock().unwrap_or_else(PoisonError::into_inner);
    nodes
        .into_iter()
        .map(|t| seen.add(t) + beside.get(&t.id()).map_or(0, |kept| seen.add_all(kept)))
        .sum()
}

/// Bytes of what ops keep beside the graph behind `loss` (`keep_beside`), each storage once: the
/// part of its activations an op may free before the graph is dropped (the logits the f32 head
/// keeps, freed by the head's backward).
pub fn beside_bytes(loss: &Tensor) -> u64 {
    let mut seen = StorageSet::default();
    let beside = BESIDE.lock().unwrap_or_else(PoisonError::into_inner);
    loss.sorted_nodes()
        .into_iter()
        .filter_map(|t| beside.get(&t.id()))
        .map(|kept| seen.add_all(kept))
        .sum()
}

/// Tensors custom ops keep for their backward outside the graph's nodes, by the id of the op's
/// output. A graph walk sees only nodes; without this a layer norm's row statistics or
/// attention's log-sum-exp would be held and never counted.
static BESIDE: LazyLock<Mutex<HashMap<TensorId, Vec<Tensor>>>> = LazyLock::new(Default::default);

/// Books `kept` with the graph node `node` until the handle drops. The op that keeps them holds
/// the handle, so the books close when the graph that owns the op is dropped.
pub fn keep_beside(node: &Tensor, kept: Vec<Tensor>) -> KeptBeside {
    let id = node.id();
    BESIDE
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .insert(id, kept);
    KeptBeside { id }
}

/// The booking `keep_beside` made; dropping it removes the booking (and its references).
pub struct KeptBeside {
    id: TensorId,
}

impl Drop for KeptBeside {
    fn drop(&mut self) {
        BESIDE
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn views_share_their_parent_storage() {
        let t = Tensor::zeros((4, 8), candle_core::DType::F32, &Device::Cpu).unwrap();
        let mut seen = StorageSet::default();
        assert_eq!(seen.add(&t), 128);
        assert_eq!(seen.add(&t.t().unwrap()), 0);
        assert_eq!(seen.add(&t.reshape(32).unwrap()), 0);
        assert_eq!(seen.add(&t.t().unwrap().contiguous().unwrap()), 128);
    }

    #[test]
    fn activations_skip_what_is_already_counted() {
        let w = Var::zeros((8, 8), candle_core::DType::F32, &Device::Cpu).unwrap();
        let x = Tensor::ones((2, 8), candle_core::DType::F32, &Device::Cpu).unwrap();
        // x·w [2,8] = 64 B, its square 64 B, the sum 4 B; w itself is a parameter.
        let loss = x
            .matmul(w.as_tensor())
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap();
        let mut seen = StorageSet::default();
        seen.add(w.as_tensor());
        assert_eq!(activation_bytes(&loss, &mut seen), 64 + 64 + 4);
    }

    #[test]
    fn tensors_kept_beside_a_node_count_while_booked() {
        let x = Var::ones((2, 8), candle_core::DType::F32, &Device::Cpu).unwrap();
        let y = x.as_tensor().sqr().unwrap();
        let stats = Tensor::zeros(2, candle_core::DType::F32, &Device::Cpu).unwrap();
        let booked = keep_beside(&y, vec![stats]);
        // x (64 B) and y (64 B) are nodes; the statistics (8 B) are counted with y.
        assert_eq!(activation_bytes(&y, &mut StorageSet::default()), 136);
        drop(booked);
        assert_eq!(activation_bytes(&y, &mut StorageSet::default()), 128);
    }

    #[test]
    fn non_cpu_extent_covers_strided_views() {
        let l = Layout::contiguous((3, 5));
        assert_eq!(view_extent(&l), 15);
        assert_eq!(view_extent(&l.transpose(0, 1).unwrap()), 15);
        assert_eq!(view_extent(&l.narrow(0, 1, 2).unwrap()), 15);
    }
}
