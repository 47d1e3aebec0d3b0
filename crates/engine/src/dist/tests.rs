use super::*;
use candle_core::Device;

#[test]
fn the_share_of_the_step_is_rank_zeros_and_never_above_the_whole() {
    let rank = |comm_ms| RankComm {
        comm_ms,
        ..RankComm::default()
    };
    let c = CommEvent {
        ranks: 2,
        per_rank: vec![rank(30.0), rank(150.0)],
        ..CommEvent::default()
    };
    assert_eq!(c.share_of_step(100.0), 0.3);
    assert_eq!(c.comm_ms(), 150.0, "the slowest rank, in milliseconds");
    let late = CommEvent {
        per_rank: vec![rank(153.0)],
        ..c
    };
    assert_eq!(late.share_of_step(100.0), 1.0);
}

#[test]
fn ring_rule_moves_twice_the_share_of_the_others() {
    assert_eq!(ring_all_reduce_bytes(1000, 1), 0);
    assert_eq!(ring_all_reduce_bytes(1000, 2), 1000);
    assert_eq!(ring_all_reduce_bytes(1200, 4), 1800);
}

#[test]
fn one_rank_moves_nothing_and_changes_nothing() {
    let mut g = Group::solo();
    let mut t = vec![Tensor::new(&[1f32, 2.0], &Device::Cpu).unwrap()];
    g.sum_tensors(&mut t, true).unwrap();
    assert_eq!(t[0].to_vec1::<f32>().unwrap(), [1.0, 2.0]);
    assert_eq!(g.sum_tokens(7), 7);
    assert!(g.agree(3, true, 9).unwrap());
    let e = g.finish_window(SyncEvery::Window, 5);
    assert_eq!(e.sent_bytes(), 0);
    assert_eq!(e.peak_bytes, [5]);
}

/// Two ranks where the other rank always holds what this one holds: every sum doubles.
struct Twin;

impl Transport for Twin {
    fn rank(&self) -> usize {
        0
    }
    fn ranks(&self) -> usize {
        2
    }
    fn sum_f32(&mut self, values: &mut [f32]) {
        values.iter_mut().for_each(|v| *v *= 2.0);
    }
    fn sum_f64(&mut self, _: &mut [f64]) {}
    fn sum_u64(&mut self, _: &mut [u64]) {}
    fn max_u64(&mut self, _: &mut [u64]) {}
    fn gather_u64(&mut self, values: &[u64]) -> Vec<u64> {
        [values, values].concat()
    }
    fn gather_f32(&mut self, values: &[f32]) -> Vec<f32> {
        [values, values].concat()
    }
    fn reduce_scatter_f32(&mut self, values: &[f32]) -> Vec<f32> {
        values[..values.len() / 2].iter().map(|v| v * 2.0).collect()
    }
    fn broadcast_bytes(&mut self, _: &mut Vec<u8>) {}
    fn collectives(&self) -> Collectives {
        Collectives::Mpi
    }
}

#[test]
fn summed_tensors_keep_their_shapes_and_dtypes_in_one_reduce() {
    let mut g = Group::new(Box::new(Twin), None);
    let cpu = Device::Cpu;
    let mut t = vec![
        Tensor::new(&[[1f32, 2.0], [3.0, 4.0]], &cpu).unwrap(),
        Tensor::new(&[0.5f32, -1.0, 8.0], &cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap(),
    ];
    let before = t[0].clone();
    g.sum_tensors(&mut t, true).unwrap();
    assert_eq!(t[0].dims(), [2, 2]);
    assert_eq!(t[0].to_vec2::<f32>().unwrap(), [[2.0, 4.0], [6.0, 8.0]]);
    assert_eq!(t[1].dtype(), DType::BF16);
    let second = t[1].to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(second, [1.0, -2.0, 16.0]);
    assert_eq!(before.to_vec2::<f32>().unwrap(), [[1.0, 2.0], [3.0, 4.0]]);
    let e = g.finish_window(SyncEvery::Window, 0);
    assert_eq!(e.per_rank[0].gradient_reduces, 1);
    // Seven f32 values, all-reduced over two ranks: 2·(W−1)/W·28 bytes.
    assert_eq!(e.per_rank[0].sent_bytes, 28);
}

#[test]
fn one_rank_sums_scalars_to_themselves() {
    let mut g = Group::solo();
    let mut v = [std::f64::consts::PI * 1e3];
    g.sum_scalars(&mut v);
    assert_eq!(v[0], std::f64::consts::PI * 1e3);
}
