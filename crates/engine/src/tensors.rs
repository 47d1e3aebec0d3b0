//! Bytes held by tensors, counted once per storage: views (reshape, transpose, narrow,
//! broadcast) share their parent's storage and must not be counted twice.

use std::collections::HashSet;

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, Layout, Storage, Tensor};

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
/// once and skipping storages already in `seen` (parameters, compute weights).
pub fn activation_bytes(loss: &Tensor, seen: &mut StorageSet) -> u64 {
    loss.sorted_nodes().into_iter().map(|t| seen.add(t)).sum()
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
    fn non_cpu_extent_covers_strided_views() {
        let l = Layout::contiguous((3, 5));
        assert_eq!(view_extent(&l), 15);
        assert_eq!(view_extent(&l.transpose(0, 1).unwrap()), 15);
        assert_eq!(view_extent(&l.narrow(0, 1, 2).unwrap()), 15);
    }
}
