//! The parallel product's cuts: blocks chosen by shape, and the same product whichever side is
//! cut; AdamW with clipping inside its pass.

use super::*;

/// `a·b` by the textbook loop, in f64.
fn reference(a: &[f32], b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let sum: f64 = (0..k)
                .map(|p| a[i * k + p] as f64 * b[p * n + j] as f64)
                .sum();
            c[i * n + j] = sum as f32;
        }
    }
    c
}

fn values(len: usize, seed: u32) -> Vec<f32> {
    (0..len as u32)
        .map(|i| ((i.wrapping_mul(2_654_435_761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
        .collect()
}

#[test]
fn a_wide_product_is_cut_into_column_blocks_and_a_tall_one_into_row_blocks() {
    let wide = matmul_split(64, 576, 49_152);
    assert_eq!((wide.by, wide.blocks, wide.size), (Cut::Columns, 4, 12_288));
    let tall = matmul_split(768, 768, 512);
    assert_eq!((tall.by, tall.blocks, tall.size), (Cut::Rows, 4, 192));
    // Too little work to split: one block.
    assert_eq!(matmul_split(8, 8, 40).blocks, 1);
    // The blocks cover the cut side exactly, in order.
    let covered: Vec<usize> = (0..wide.blocks).flat_map(|i| wide.block(i)).collect();
    assert_eq!(covered, (0..49_152).collect::<Vec<_>>());
    // Each column block packs only its columns of the right-hand matrix.
    assert_eq!(rhs_packing(64, 576, 49_152), (576 * 12_288 * 4, 4));
    assert_eq!(rhs_packing(768, 768, 512), (768 * 512 * 4, 4));
}

/// Column blocks compute the product (into a strided destination, added to what it holds, and
/// from a transposed right-hand view, as the tied LM head reads its embedding).
#[test]
fn a_product_cut_into_column_blocks_equals_the_textbook_product() {
    let (m, k, n) = (40, 24, 300);
    assert_eq!(matmul_split(m, k, n).by, Cut::Columns);
    let a = values(m * k, 1);
    let b = values(k * n, 2);
    // The same matrix stored [n, k]: the embedding's layout.
    let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
    let expected = reference(&a, &b, m, k, n);
    for transposed in [false, true] {
        let right = match transposed {
            false => Mat::rows(&b, n),
            true => Mat::rows(&bt, k).t(),
        };
        assert_added(Mat::rows(&a, k), right, &expected, "column blocks");
    }
}

/// `left·right` added into a destination of ones with a spare column on each row: every value
/// is `expected` + 1 (to 1e-4), and the spare column is untouched.
fn assert_added(left: Mat, right: Mat, expected: &[f32], what: &str) {
    let (m, n) = (left.rows, right.cols);
    let width = n + 1;
    let mut dst = vec![1f32; m * width];
    // SAFETY: the caller's views lie inside live buffers apart from `dst`.
    unsafe {
        matmul(
            MatMut::new(dst.as_mut_ptr(), m, n, width),
            left,
            right,
            true,
            true,
        )
    };
    for i in 0..m {
        for j in 0..n {
            let (got, want) = (dst[i * width + j], expected[i * n + j] + 1.0);
            assert!(
                (got - want).abs() < 1e-4,
                "{what} ({i}, {j}) {got} vs {want}"
            );
        }
        assert_eq!(dst[i * width + n], 1.0, "{what} row {i}: the spare column");
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

/// The gradient norm's sums made on the pool are each tensor's serial `sum_squares`, to the bit:
/// empty tensors, sizes off the 1024-value blocks, blocks whose order changes the f64 sum, a
/// transposed view, and more blocks than the pool has threads.
#[test]
fn sums_of_squares_on_the_pool_give_the_bits_of_each_serial_sum() {
    let dev = candle_core::Device::Cpu;
    let mut ts: Vec<Tensor> = [0, 1, 1023, 1024, 1025, 0, 40_000, 7]
        .iter()
        .enumerate()
        .map(|(i, &n)| Tensor::from_vec(values(n, 50 + i as u32), n, &dev).unwrap())
        .collect();
    // Blocks' sums 2^80 apart from first to last: added in another order, f64 rounds them
    // differently.
    let spread: Vec<f32> = values(40_960, 70)
        .iter()
        .enumerate()
        .map(|(j, x)| x * 2f32.powi((j / 1024) as i32 - 20) * (1.0 + j as f32 * 1e-7))
        .collect();
    ts.push(Tensor::from_vec(spread, 40_960, &dev).unwrap());
    let square = Tensor::from_vec(values(60 * 70, 90), (60, 70), &dev).unwrap();
    ts.push(square.t().unwrap());
    let refs: Vec<&Tensor> = ts.iter().collect();
    let pooled = sums_of_squares(&refs).unwrap();
    let serial: Vec<f64> = ts.iter().map(|t| sum_squares(t).unwrap()).collect();
    assert_eq!(
        pooled.iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
        serial.iter().map(|s| s.to_bits()).collect::<Vec<_>>()
    );
    assert!(serial[6] > 0.0 && serial[8] > 0.0 && serial[9] > 0.0);
}

/// Clipping folded into the update gives the bits of clipping first: the weights, both moments
/// and the clipped gradient's sum of squares, over sizes off the 1024-value blocks.
#[test]
fn adamw_with_the_clip_inside_gives_the_bits_of_scaling_the_gradient_first() {
    let dev = candle_core::Device::Cpu;
    let sizes = [1, 1023, 1024, 2500];
    let make = |seed: u32| -> Vec<Tensor> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| Tensor::from_vec(values(n, seed + i as u32), n, &dev).unwrap())
            .collect()
    };
    let step = AdamWStep {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        step_size: 3e-4,
        inv_bc2: 1.7,
        decay: 0.9999,
    };
    let clip = 0.37f32;
    let state = || {
        let copy =
            |ts: Vec<Tensor>| -> Vec<Tensor> { ts.iter().map(|t| t.copy().unwrap()).collect() };
        let v: Vec<Tensor> = make(30).iter().map(|t| t.abs().unwrap()).collect();
        (copy(make(10)), copy(make(20)), v)
    };
    let run = |w: &[Tensor], m: &[Tensor], v: &[Tensor], g: &[Tensor], clip| {
        let jobs: Vec<AdamWJob> = (0..sizes.len())
            .map(|i| AdamWJob {
                w: &w[i],
                m: &m[i],
                v: &v[i],
                g: g[i].clone(),
                step,
            })
            .collect();
        adamw_update_all(&jobs, clip).unwrap()
    };
    // The old way: scale in place, measure, then update.
    let (w1, m1, v1) = state();
    let g1: Vec<Tensor> = make(40).iter().map(|t| t.copy().unwrap()).collect();
    g1.iter().for_each(|g| scale_in_place(g, clip).unwrap());
    let measured: Vec<f64> = g1.iter().map(|g| sum_squares(g).unwrap()).collect();
    assert!(run(&w1, &m1, &v1, &g1, None).is_empty());
    // Folded.
    let (w2, m2, v2) = state();
    let g2 = make(40);
    let squares = run(&w2, &m2, &v2, &g2, Some(clip));
    assert_eq!(
        squares.iter().map(|s| s.to_bits()).collect::<Vec<_>>(),
        measured.iter().map(|s| s.to_bits()).collect::<Vec<_>>()
    );
    for i in 0..sizes.len() {
        assert_eq!(bits(&w1[i]), bits(&w2[i]), "w {i}");
        assert_eq!(bits(&m1[i]), bits(&m2[i]), "m {i}");
        assert_eq!(bits(&v1[i]), bits(&v2[i]), "v {i}");
    }
    // The gradient itself is left as it was.
    assert_eq!(bits(&g2[3]), bits(&make(40)[3]));
}

/// bf16 products on packed blocks (AMX or AVX-512 BF16), where the CPU has them: the f32 sums
/// of the bf16-rounded operands, for shapes off the 32-row, 32-column and 32-deep blocks, cut
/// into row and column blocks, from transposed views and added into a strided destination.
/// Without either no product goes to tiles.
#[test]
fn tile_products_sum_the_bf16_rounded_operands() {
    let _bf16 = tiles::scope_if(true);
    if !tiles::available() {
        assert!(!tiles::fit(768), "tiles without AMX or AVX-512 BF16");
        return;
    }
    let round = storage::rounding(candle_core::DType::BF16);
    for (m, k, n) in [
        (300, 100, 300),
        (64, 1100, 1000),
        (97, 70, 2000),
        (200, 33, 5000),
    ] {
        let a = values(m * k, 3);
        let b = values(k * n, 4);
        let (ar, br): (Vec<f32>, Vec<f32>) = (
            a.iter().map(|&x| round(x)).collect(),
            b.iter().map(|&x| round(x)).collect(),
        );
        assert!(tiles::fit(k), "{m}x{k}x{n} must go to tiles");
        let expected = reference(&ar, &br, m, k, n);
        let unrounded = reference(&a, &b, m, k, n);
        let apart = expected
            .iter()
            .zip(&unrounded)
            .any(|(x, y)| (x - y).abs() > 1e-2);
        assert!(
            apart,
            "{m}x{k}x{n}: rounding must show, or the test cannot tell the paths"
        );
        let at: Vec<f32> = (0..m * k).map(|i| a[(i % m) * k + i / m]).collect();
        let bt: Vec<f32> = (0..n * k).map(|i| b[(i % k) * n + i / k]).collect();
        for transposed in [false, true] {
            let (left, right) = match transposed {
                false => (Mat::rows(&a, k), Mat::rows(&b, n)),
                true => (Mat::rows(&at, m).t(), Mat::rows(&bt, k).t()),
            };
            assert_added(left, right, &expected, &format!("{m}x{k}x{n}"));
        }
    }
}

/// A tile product's bits do not depend on how it is cut (so tile products may be cut by the
/// thread count): rows and columns cut off the 32-wide blocks, adding into values already there,
/// over three inner passes, give the bits of the uncut product.
#[test]
fn tile_products_give_the_same_bits_however_they_are_cut() {
    if !tiles::available() {
        return;
    }
    let (m, k, n) = (100, 1100, 150);
    let (a, b) = (values(m * k, 5), values(k * n, 6));
    let (left, right) = (Mat::rows(&a, k), Mat::rows(&b, n));
    let start = values(m * n, 7);
    let product = |cut: &dyn Fn(&MatMut)| -> Vec<u32> {
        let mut dst = start.clone();
        cut(&MatMut::new(dst.as_mut_ptr(), m, n, n));
        dst.iter().map(|x| x.to_bits()).collect()
    };
    // SAFETY: the views lie inside `a`, `b` and the fresh `dst`, on this thread, a packed kernel available.
    let whole = product(&|d| unsafe { tiles::gemm_block(d, left, right, true, 0..m) });
    // SAFETY: as above.
    let rows = product(&|d| unsafe {
        tiles::gemm_block(d, left, right, true, 0..37);
        tiles::gemm_block(d, left, right, true, 37..m);
    });
    // SAFETY: as above; the column views lie inside dst and `b`.
    let columns = product(&|d| unsafe {
        tiles::gemm_block(&d.columns(0..45), left, right.columns(0..45), true, 0..m);
        tiles::gemm_block(&d.columns(45..n), left, right.columns(45..n), true, 0..m);
    });
    assert!(whole != start.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
    assert!(rows == whole, "cut into rows 0..37, 37..{m}");
    assert!(columns == whole, "cut into columns 0..45, 45..{n}");
}

/// bf16 operands read as stored (`Values::Bf16`: on tiles, or widened for `gemm` where the
/// product is shallower than a tile or the CPU has no packed kernel) give the bits of the same
/// values in f32, from row-major and transposed views. The shapes include whole blocks (no padding, so
/// the packing alone writes the slab, which holds the products' before it).
#[test]
fn bf16_operands_read_as_stored_give_the_bits_of_their_f32_values() {
    let _bf16 = tiles::scope_if(true);
    for (m, k, n) in [(97, 70, 300), (40, 8, 50), (64, 64, 96), (128, 384, 64)] {
        let round =
            |v: Vec<f32>| -> Vec<half::bf16> { v.into_iter().map(half::bf16::from_f32).collect() };
        let (a, b) = (round(values(m * k, 8)), round(values(k * n, 9)));
        let wide = |v: &[half::bf16]| -> Vec<f32> { v.iter().map(|x| x.to_f32()).collect() };
        let (af, bf) = (wide(&a), wide(&b));
        let turned = |v: &[half::bf16], rows: usize, cols: usize| -> Vec<half::bf16> {
            (0..rows * cols)
                .map(|i| v[(i % rows) * cols + i / rows])
                .collect()
        };
        let (at, bt) = (turned(&a, m, k), turned(&b, k, n));
        let (atf, btf) = (wide(&at), wide(&bt));
        let product = |left: Mat, right: Mat| -> Vec<u32> {
            let mut dst = values(m * n, 10);
            // SAFETY: the views lie inside this test's live buffers, apart from `dst`.
            unsafe { matmul(MatMut::rows(&mut dst, n), left, right, true, true) };
            dst.iter().map(|x| x.to_bits()).collect()
        };
        let f32s = product(Mat::rows(&af, k), Mat::rows(&bf, n));
        let stored = product(Mat::of(Values::Bf16(&a), k), Mat::of(Values::Bf16(&b), n));
        assert!(stored == f32s, "{m}x{k}x{n}");
        let stored_t = product(
            Mat::of(Values::Bf16(&at), m).t(),
            Mat::of(Values::Bf16(&bt), k).t(),
        );
        let f32s_t = product(Mat::rows(&atf, m).t(), Mat::rows(&btf, k).t());
        assert!(stored_t == f32s_t, "{m}x{k}x{n} transposed");
    }
}
