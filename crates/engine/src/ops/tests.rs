use super::*;
use candle_core::{Device, Var};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::sync::Arc;

const TOL: f64 = 1e-5;

/// Multi-head attention of `batch` sequences of `t` tokens, `heads` heads over width `d`.
fn mha(batch: usize, t: usize, heads: usize, d: usize) -> AttentionShape {
    AttentionShape::multi_head(batch, t, heads, d)
}

/// Uniform values in ±`std`, seeded (also used by the fused ops' tests).
pub(crate) fn random(shape: &[usize], std: f32, seed: u64) -> Tensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * std)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Relative L2 error of `a` against `reference`, in f64 whatever their dtypes (also used
/// by the fused ops' tests).
pub(crate) fn rel_err(a: &Tensor, reference: &Tensor) -> f64 {
    let f64s = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
    let norm = |t: &Tensor| {
        t.sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    let diff = (f64s(a) - f64s(reference)).unwrap();
    (norm(&diff) / norm(&f64s(reference)).max(f64::MIN_POSITIVE)).sqrt()
}

/// Value and gradients (w.r.t. `inputs`) of `sum(f(inputs) * weights)`.
fn value_and_grads(
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    seed: u64,
) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = f(&tensors).unwrap();
    let weights = random(out.dims(), 1.0, seed);
    let loss = (&out * &weights).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let g = tensors
        .iter()
        .map(|t| grads.get(t).expect("every input gets a gradient").clone())
        .collect();
    (out.detach(), g)
}

/// The fused and composite versions agree in value and in every input's gradient.
fn assert_equivalent(
    name: &str,
    fused: impl Fn(&[Tensor]) -> Result<Tensor>,
    composite: impl Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
) {
    let (vf, gf) = value_and_grads(fused, inputs, 99);
    let (vc, gc) = value_and_grads(composite, inputs, 99);
    let e = rel_err(&vf, &vc);
    assert!(e <= TOL, "{name}: value rel. error {e:e}");
    for (i, (a, b)) in gf.iter().zip(&gc).enumerate() {
        let e = rel_err(a, b);
        assert!(e <= TOL, "{name}: gradient of input {i} rel. error {e:e}");
    }
}

#[test]
fn fused_layer_norm_matches_composite() {
    // 3000 rows: several parallel units.
    for (rows, d) in [(6, 16), (3000, 32)] {
        let inputs = [
            random(&[rows, d], 2.0, 1)
                .broadcast_add(&random(&[rows, 1], 3.0, 2))
                .unwrap(),
            random(&[d], 1.0, 3),
            random(&[d], 1.0, 4),
        ];
        assert_equivalent(
            "layer_norm",
            |t| fused::layer_norm(&t[0], &t[1], &t[2], 1e-5),
            |t| composite::layer_norm(&t[0], &t[1], &t[2], 1e-5),
            &inputs,
        );
    }
}

#[test]
fn fused_linear_matches_composite() {
    for (n, i, o) in [(3, 5, 7), (700, 48, 40)] {
        let inputs = [
            random(&[n, i], 1.0, 21),
            random(&[i, o], 0.5, 22),
            random(&[o], 1.0, 23),
        ];
        assert_equivalent(
            "linear",
            |t| fused::linear(&t[0], &t[1], &t[2]),
            |t| composite::linear(&t[0], &t[1], &t[2]),
            &inputs,
        );
        assert_equivalent(
            "project",
            |t| fused::project(&t[0], &t[1]),
            |t| t[0].matmul(&t[1]),
            &inputs[..2],
        );
        assert_equivalent(
            "gelu_linear",
            |t| fused::gelu_linear(&t[0], &t[1], &t[2]),
            |t| composite::linear(&composite::gelu(&t[0])?, &t[1], &t[2]),
            &[
                random(&[n, i], 4.0, 24),
                inputs[1].clone(),
                inputs[2].clone(),
            ],
        );
    }
}

#[test]
fn fused_attention_matches_composite() {
    // (batch, tokens, heads, d_model): one head of one token; several heads, odd sizes; bands
    // of the T×T products (64 rows) with a short last one.
    for (b, t, h, d) in [(1, 1, 1, 4), (3, 9, 2, 12), (2, 40, 4, 32), (1, 150, 2, 16)] {
        let inputs = [random(&[b * t, 3 * d], 2.0, 31)];
        assert_equivalent(
            "causal_attention",
            |x| fused::causal_attention(&x[0], mha(b, t, h, d), None),
            |x| composite::causal_attention(&x[0], mha(b, t, h, d), None),
            &inputs,
        );
    }
}

/// A rotary table for head width `hd` over `t` positions (Llama 3 scaling, so every
/// frequency regime is exercised).
fn table(hd: usize, t: usize) -> Arc<RopeTable> {
    let rope = rope::Rope {
        theta: 10_000.0,
        head_dim: hd,
        scaling: Some(rope::Llama3Scaling {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_positions: 8.0,
        }),
    };
    Arc::new(rope.table(t))
}

#[test]
fn grouped_rotary_attention_matches_transformers_composite() {
    // (batch, tokens, heads, kv heads, head width): grouped 4/2 and 6/2, one kv head,
    // multi-head with rotary, a head width that is not d/heads, grouped over three bands.
    for (b, t, h, kv, hd) in [
        (2, 9, 4, 2, 8),
        (1, 7, 6, 2, 4),
        (2, 5, 3, 1, 6),
        (3, 8, 2, 2, 16),
        (1, 130, 4, 2, 8),
    ] {
        let shape = AttentionShape {
            batch: b,
            t,
            heads: h,
            kv_heads: kv,
            head_dim: hd,
        };
        let rope = table(hd, t);
        let inputs = [random(&[b * t, shape.qkv_width()], 2.0, 61)];
        for r in [None, Some(&rope)] {
            assert_equivalent(
                "fused attention",
                |x| fused::causal_attention(&x[0], shape, r),
                |x| composite::causal_attention(&x[0], shape, r),
                &inputs,
            );
            assert_equivalent(
                "lean attention",
                |x| lean::causal_attention(&x[0], shape, r),
                |x| composite::causal_attention(&x[0], shape, r),
                &inputs,
            );
        }
    }
}

#[test]
fn rms_norm_matches_transformers_composite() {
    for (rows, d) in [(6, 16), (3000, 32)] {
        let inputs = [random(&[rows, d], 2.0, 71), random(&[d], 1.0, 72)];
        assert_equivalent(
            "fused rms_norm",
            |t| fused::rms_norm(&t[0], &t[1], 1e-6),
            |t| composite::rms_norm(&t[0], &t[1], 1e-6),
            &inputs,
        );
        assert_equivalent(
            "lean rms_norm",
            |t| lean::rms_norm(&t[0], &t[1], 1e-6),
            |t| composite::rms_norm(&t[0], &t[1], 1e-6),
            &inputs,
        );
    }
}

#[test]
fn swiglu_linear_matches_the_composite_expression() {
    let (n, f, o) = (70, 24, 10);
    let inputs = [random(&[n, 2 * f], 3.0, 81), random(&[f, o], 0.5, 82)];
    let swiglu = |t: &[Tensor]| -> Result<Tensor> {
        let gate = t[0].narrow(1, 0, f)?;
        let up = t[0].narrow(1, f, f)?;
        (candle_nn::ops::silu(&gate)? * up)?.matmul(&t[1])
    };
    assert_equivalent(
        "fused swiglu",
        |t| fused::act_linear(&t[0], &t[1], None, Activation::SwiGlu),
        swiglu,
        &inputs,
    );
    // With a bias, whose gradient sits after dx (twice the product's width) and dw.
    let biased = [inputs[0].clone(), inputs[1].clone(), random(&[o], 1.0, 83)];
    assert_equivalent(
        "fused swiglu with a bias",
        |t| fused::act_linear(&t[0], &t[1], Some(&t[2]), Activation::SwiGlu),
        |t| swiglu(t)?.broadcast_add(&t[2]),
        &biased,
    );
}

#[test]
fn a_tied_head_computes_the_loss_through_the_embedding() {
    let (n, d, v) = (40, 8, 300);
    let (targets, mask) = labels(n, v, 5);
    // The embedding `[V, D]`, as a tied head stores it.
    let inputs = [random(&[n, d], 1.0, 91), random(&[v, d], 0.5, 92)];
    let reference = |t: &[Tensor]| composite::nll_sum(&t[0].matmul(&t[1].t()?)?, &targets, &mask);
    assert_equivalent(
        "fused tied head",
        |t| fused::linear_nll_sum(&t[0], &t[1], WeightLayout::OutIn, &targets, &mask, None),
        reference,
        &inputs,
    );
    assert_equivalent(
        "lean tied head",
        |t| lean::linear_nll_sum(&t[0], &t[1], WeightLayout::OutIn, &targets, &mask),
        reference,
        &inputs,
    );
}

/// A gradient held beside the graph, as `model::ParamGrads` holds one.
#[derive(Default)]
struct Held(std::sync::Mutex<Vec<f32>>);

impl GradTarget for Held {
    fn add_into(&self, len: usize, write: &mut crate::ops::GradWrite) -> Result<()> {
        let mut held = self.0.lock().unwrap();
        if held.is_empty() {
            *held = write(None).expect("a first gradient");
            assert_eq!(held.len(), len);
        } else {
            assert!(write(Some(&mut held)).is_none());
        }
        Ok(())
    }
}

#[test]
fn a_tied_weight_gradient_beside_the_graph_is_the_store_one_to_the_bit() {
    let (n, d, v) = (40, 8, 300);
    let (targets, mask) = labels(n, v, 6);
    let ids = Tensor::new(&[3u32, 0, 299, 3, 17, 299], &Device::Cpu).unwrap();
    let table = Var::from_tensor(&random(&[v, d], 0.5, 93)).unwrap();
    let x = Var::from_tensor(&random(&[n, d], 1.0, 94)).unwrap();
    let r = random(&[6, d], 1.0, 95);
    // The embedding's rows times fixed weights, plus the tied head's loss.
    let loss = |tok: Tensor, target: Option<Arc<dyn GradTarget>>| {
        let head = fused::linear_nll_sum(
            x.as_tensor(),
            table.as_tensor(),
            WeightLayout::OutIn,
            &targets,
            &mask,
            target,
        )?;
        (tok * &r)?.sum_all()? + head
    };
    let graph = loss(embedding(table.as_tensor(), &ids).unwrap(), None)
        .unwrap()
        .backward()
        .unwrap();
    let held = Arc::new(Held::default());
    let tok = embedding_beside(table.as_tensor(), &ids, DType::F32, held.clone(), None).unwrap();
    let beside = loss(tok, Some(held.clone())).unwrap().backward().unwrap();
    assert!(
        beside.get(table.as_tensor()).is_none(),
        "no gradient in the store"
    );
    let bits = |t: &Tensor| -> Vec<u32> {
        let values: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        values.iter().map(|f| f.to_bits()).collect()
    };
    let want = bits(graph.get(table.as_tensor()).unwrap());
    let got: Vec<u32> = held.0.lock().unwrap().iter().map(|f| f.to_bits()).collect();
    assert_eq!(got, want);
    assert_eq!(
        bits(beside.get(x.as_tensor()).unwrap()),
        bits(graph.get(x.as_tensor()).unwrap())
    );
}

#[test]
fn learned_positions_added_by_the_fused_embedding_are_the_graph_sum_and_its_gradients() {
    // Two sequences of three tokens; a position table of five rows (more than the sequence).
    let (t, d, v) = (3, 8, 20);
    let ids = Tensor::new(&[3u32, 0, 19, 3, 17, 19], &Device::Cpu).unwrap();
    let table = Var::from_tensor(&random(&[v, d], 0.5, 96)).unwrap();
    let positions = Var::from_tensor(&random(&[5, d], 0.5, 97)).unwrap();
    let r = random(&[2 * t, d], 1.0, 98);
    let bits = |t: &Tensor| -> Vec<u32> {
        let values: Vec<f32> = t
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        values.iter().map(|f| f.to_bits()).collect()
    };
    let mut want = None;
    for dtype in [DType::F32, DType::BF16] {
        // Candle's graph: each table cast, the token rows gathered, the positions sliced and
        // broadcast over the batch, the sum in the compute dtype.
        let tok = embedding(&table.as_tensor().to_dtype(dtype).unwrap(), &ids).unwrap();
        let pos = positions
            .as_tensor()
            .to_dtype(dtype)
            .unwrap()
            .narrow(0, 0, t)
            .unwrap();
        let sum = tok
            .reshape((2, t, d))
            .unwrap()
            .broadcast_add(&pos)
            .unwrap()
            .reshape((2 * t, d))
            .unwrap();
        let loss = |x: &Tensor| (x.to_dtype(DType::F32)? * &r)?.sum_all();
        let graph = loss(&sum).unwrap().backward().unwrap();
        let (held_tok, held_pos) = (Arc::new(Held::default()), Arc::new(Held::default()));
        let fused = embedding_beside(
            table.as_tensor(),
            &ids,
            dtype,
            held_tok.clone(),
            Some(fused::Positions {
                table: positions.as_tensor().clone(),
                len: t,
                target: held_pos.clone(),
            }),
        )
        .unwrap();
        assert_eq!(fused.dtype(), DType::F32, "the stream is stored in f32");
        assert_eq!(bits(&fused), bits(&sum), "{dtype:?}: values");
        let beside = loss(&fused).unwrap().backward().unwrap();
        assert!(beside.get(positions.as_tensor()).is_none());
        // The fused op's incoming gradient is f32, never rounded: in every dtype its tables'
        // gradients are the f32 graph's to the bit (the bf16 graph rounds each row and sum).
        let graph_f32 = want.get_or_insert_with(|| {
            [&table, &positions].map(|v| bits(graph.get(v.as_tensor()).unwrap()))
        });
        for (held, want) in [&held_tok, &held_pos].iter().zip(graph_f32.iter()) {
            let got: Vec<u32> = held.0.lock().unwrap().iter().map(|f| f.to_bits()).collect();
            assert_eq!(&got, want, "{dtype:?}: gradients");
        }
    }
}

#[test]
fn fused_attention_ignores_the_future() {
    // Changing the last token's keys and values leaves every earlier output unchanged, within
    // one band of rows and across three.
    for (t, d) in [(6, 8), (150, 8)] {
        let qkv = random(&[t, 3 * d], 1.0, 41);
        let mut changed: Vec<f32> = qkv.flatten_all().unwrap().to_vec1().unwrap();
        changed[(t - 1) * 3 * d + d..]
            .iter_mut()
            .for_each(|v| *v += 1.0);
        let changed = Tensor::from_vec(changed, (t, 3 * d), &Device::Cpu).unwrap();
        let y0 = fused::causal_attention(&qkv, mha(1, t, 2, d), None).unwrap();
        let y1 = fused::causal_attention(&changed, mha(1, t, 2, d), None).unwrap();
        let early = |y: &Tensor| y.narrow(0, 0, t - 1).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(early(&y0), early(&y1));
        assert_ne!(y0.to_vec2::<f32>().unwrap(), y1.to_vec2::<f32>().unwrap());
    }
}

#[test]
fn fused_nll_matches_composite() {
    let (n, v) = (70, 33);
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let targets: Vec<u32> = (0..n).map(|_| rng.random_range(0..v as u32)).collect();
    let mask: Vec<f32> = (0..n).map(|i| if i % 7 == 3 { 0.0 } else { 1.0 }).collect();
    let targets = Tensor::from_vec(targets, n, &Device::Cpu).unwrap();
    let mask = Tensor::from_vec(mask, n, &Device::Cpu).unwrap();
    let inputs = [random(&[n, v], 5.0, 9)];
    assert_equivalent(
        "nll_sum",
        |t| fused::nll_sum(&t[0], &targets, &mask),
        |t| composite::nll_sum(&t[0], &targets, &mask),
        &inputs,
    );
}

/// Targets in `0..v` and a mask with some rows uncounted.
fn labels(n: usize, v: usize, seed: u64) -> (Tensor, Tensor) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let targets: Vec<u32> = (0..n).map(|_| rng.random_range(0..v as u32)).collect();
    let mask: Vec<f32> = (0..n).map(|i| if i % 7 == 3 { 0.0 } else { 1.0 }).collect();
    (
        Tensor::from_vec(targets, n, &Device::Cpu).unwrap(),
        Tensor::from_vec(mask, n, &Device::Cpu).unwrap(),
    )
}

#[test]
fn blocked_linear_nll_matches_the_unblocked_head() {
    // 600 rows at V = 3000 are one block; at V = 50000 one block of rows by 15 slices of the
    // vocabulary (3495 wide, the last 1070); 1100 rows at V = 5000 two blocks of rows (1024,
    // 76) by three slices (2048, 2048, 904).
    for (n, d, v) in [
        (5, 8, 300),
        (600, 32, 3000),
        (600, 16, 50_000),
        (1100, 8, 5000),
    ] {
        let (rows, cols) = fused::head_block(n, v);
        assert!(
            v < 5000 || (cols < v && (n < 1000 || rows < n)),
            "several blocks"
        );
        let (targets, mask) = labels(n, v, 8);
        let inputs = [random(&[n, d], 1.0, 51), random(&[d, v], 0.5, 52)];
        // The previous fused path (head product, then the fused NLL) and the composite one.
        let blocked = |t: &[Tensor]| {
            fused::linear_nll_sum(&t[0], &t[1], WeightLayout::InOut, &targets, &mask, None)
        };
        assert_equivalent(
            "linear_nll_sum vs fused",
            blocked,
            |t| fused::nll_sum(&fused::project(&t[0], &t[1])?, &targets, &mask),
            &inputs,
        );
        assert_equivalent(
            "linear_nll_sum vs composite",
            blocked,
            |t| composite::nll_sum(&t[0].matmul(&t[1])?, &targets, &mask),
            &inputs,
        );
        // A tied head's `[V, D]` weight: slices of the vocabulary are blocks of its rows.
        let tied = [
            inputs[0].clone(),
            inputs[1].t().unwrap().contiguous().unwrap(),
        ];
        assert_equivalent(
            "tied linear_nll_sum vs composite",
            |t| fused::linear_nll_sum(&t[0], &t[1], WeightLayout::OutIn, &targets, &mask, None),
            |t| composite::nll_sum(&t[0].matmul(&t[1].t()?)?, &targets, &mask),
            &tied,
        );
    }
}

#[test]
fn blocked_linear_nll_gives_the_same_bits_on_one_thread_and_on_the_pool() {
    // Two blocks of rows (1024, 76) by three slices of the vocabulary, a tied head's layout.
    // With one CPU the pool is the calling thread too, and both runs take the same path.
    let (n, d, v) = (1100, 8, 5000);
    let (targets, mask) = labels(n, v, 9);
    let inputs = [random(&[n, d], 1.0, 53), random(&[v, d], 0.5, 54)];
    let bits = |serial: bool| {
        let _pool = pool::serial(serial);
        let head = |t: &[Tensor]| {
            fused::linear_nll_sum(&t[0], &t[1], WeightLayout::OutIn, &targets, &mask, None)
        };
        let (value, grads) = value_and_grads(head, &inputs, 7);
        let mut bits = vec![value.to_scalar::<f32>().unwrap().to_bits()];
        for g in grads {
            let g = g.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            bits.extend(g.iter().map(|x| x.to_bits()));
        }
        bits
    };
    assert_eq!(bits(true), bits(false));
}

#[test]
fn kept_logits_give_the_bits_of_logits_made_again() {
    // With a gradient wanted and the products on `gemm` (f32, or bf16 where the CPU has no bf16
    // tiles or `GACCWB_BF16_PRODUCTS=gemm`) the forward keeps the logits, and the first backward
    // reads them; a second backward over the same graph finds them taken and makes each block
    // again. On bf16 tiles nothing is kept. Both layouts, 600 rows by two slices of the
    // vocabulary (3495, 1505).
    let (n, d, v) = (600, 16, 5000);
    let (targets, mask) = labels(n, v, 10);
    let on_tiles = fused::bf16_kernel() != fused::Bf16Kernel::Gemm;
    for (dtype, keeps) in [(DType::F32, true), (DType::BF16, !on_tiles)] {
        let x = Var::from_tensor(&random(&[n, d], 1.0, 55).to_dtype(dtype).unwrap()).unwrap();
        for (layout, shape) in [(WeightLayout::InOut, [d, v]), (WeightLayout::OutIn, [v, d])] {
            let w = random(&shape, 0.5, 56).to_dtype(dtype).unwrap();
            let w = Var::from_tensor(&w).unwrap();
            let loss = fused::linear_nll_sum(&x, &w, layout, &targets, &mask, None).unwrap();
            let bits = |store: &candle_core::backprop::GradStore| {
                [x.as_tensor(), w.as_tensor()].map(|t| {
                    let g = store.get(t).unwrap().flatten_all().unwrap();
                    g.to_dtype(DType::F32)
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap()
                        .iter()
                        .map(|v| v.to_bits())
                        .collect::<Vec<_>>()
                })
            };
            // The graph holds the logits (booked with the loss) until the first backward ends.
            let logits = (n * v * 4) as u64;
            let held = || crate::tensors::activation_bytes(&loss, &mut Default::default());
            assert_eq!(
                held() >= logits,
                keeps,
                "{dtype:?} {layout:?}: {} held",
                held()
            );
            let kept = loss.backward().unwrap();
            assert!(
                held() < logits,
                "{dtype:?} {layout:?}: {} bytes held",
                held()
            );
            let made = loss.backward().unwrap();
            assert_eq!(bits(&kept), bits(&made), "{dtype:?} {layout:?}");
        }
    }
}

#[test]
fn lean_ops_match_the_plain_composite_ops() {
    for (rows, d) in [(6, 16), (300, 32)] {
        let inputs = [
            random(&[rows, d], 2.0, 1)
                .broadcast_add(&random(&[rows, 1], 3.0, 2))
                .unwrap(),
            random(&[d], 1.0, 3),
            random(&[d], 1.0, 4),
        ];
        assert_equivalent(
            "lean layer_norm",
            |t| lean::layer_norm(&t[0], &t[1], &t[2], 1e-5),
            |t| composite::layer_norm(&t[0], &t[1], &t[2], 1e-5),
            &inputs,
        );
    }
    for (n, i, o) in [(3, 5, 7), (70, 48, 40)] {
        let inputs = [
            random(&[n, i], 4.0, 21),
            random(&[i, o], 0.5, 22),
            random(&[o], 1.0, 23),
        ];
        assert_equivalent(
            "lean linear",
            |t| lean::linear(&t[0], &t[1], &t[2]),
            |t| composite::linear(&t[0], &t[1], &t[2]),
            &inputs,
        );
        assert_equivalent(
            "lean gelu_linear",
            |t| lean::gelu_linear(&t[0], &t[1], &t[2]),
            |t| composite::linear(&composite::gelu(&t[0])?, &t[1], &t[2]),
            &inputs,
        );
    }
    // The last shape is two chunks of one sequence each (`sequences_per_chunk`).
    for (b, t, h, d) in [(1, 1, 1, 4), (3, 9, 2, 12), (2, 40, 4, 32), (2, 600, 3, 12)] {
        assert!(t < 600 || lean::sequences_per_chunk(t, h) == 1);
        assert_equivalent(
            "lean causal_attention",
            |x| lean::causal_attention(&x[0], mha(b, t, h, d), None),
            |x| composite::causal_attention(&x[0], mha(b, t, h, d), None),
            &[random(&[b * t, 3 * d], 2.0, 31)],
        );
    }
    // 200 rows at V = 33000 are two chunks of 128 rows, the last one 72.
    for (n, d, v) in [(5, 8, 300), (200, 16, 33_000)] {
        let (targets, mask) = labels(n, v, 8);
        assert_equivalent(
            "lean linear_nll_sum",
            |t| lean::linear_nll_sum(&t[0], &t[1], WeightLayout::InOut, &targets, &mask),
            |t| composite::nll_sum(&t[0].matmul(&t[1])?, &targets, &mask),
            &[random(&[n, d], 1.0, 51), random(&[d, v], 0.5, 52)],
        );
    }
}

#[test]
fn lean_ops_in_half_precision_stay_near_f32() {
    let (b, t, h, d) = (2, 16, 2, 16);
    let (targets, mask) = labels(b * t, 40, 3);
    let block = |t_: &[Tensor], dtype: DType, plain: bool| -> Result<Tensor> {
        let _plain = force_plain(plain);
        // On the CPU half precision takes the fused ops unless the lean ones are forced.
        let _lean = force_lean(dtype != DType::F32);
        let c = |x: &Tensor| x.to_dtype(dtype);
        let x = layer_norm(&c(&t_[0])?, &c(&t_[1])?, &c(&t_[2])?, 1e-5)?;
        let qkv = linear(&x, &c(&t_[3])?, &c(&t_[4])?)?;
        let y = causal_attention(&qkv, b, t, h)?;
        let y = gelu_linear(&y, &c(&t_[5])?, &c(&t_[6])?)?;
        linear_nll_sum(&y, &c(&t_[7])?, WeightLayout::InOut, &targets, &mask, None)?
            .to_dtype(DType::F32)
    };
    let inputs = [
        random(&[b * t, d], 2.0, 1),
        random(&[d], 1.0, 2),
        random(&[d], 1.0, 3),
        random(&[d, 3 * d], 0.5, 4),
        random(&[3 * d], 0.5, 5),
        random(&[d, d], 0.5, 6),
        random(&[d], 0.5, 7),
        random(&[d, 40], 0.5, 8),
    ];
    let (reference, ref_grads) = value_and_grads(|x| block(x, DType::F32, true), &inputs, 9);
    for (dtype, bound) in [(DType::BF16, 2e-2), (DType::F16, 5e-3)] {
        let (value, grads) = value_and_grads(|x| block(x, dtype, false), &inputs, 9);
        let e = rel_err(&value, &reference);
        assert!(e <= bound, "{dtype:?}: loss rel. error {e:e}");
        for (i, (g, r)) in grads.iter().zip(&ref_grads).enumerate() {
            let e = rel_err(g, r);
            assert!(
                e <= bound,
                "{dtype:?}: gradient of input {i} rel. error {e:e}"
            );
        }
    }
}

/// One op in half precision against the composite op in f32, both on the same values (the
/// inputs rounded to `dtype` first): value and every input's gradient within `bound`.
fn assert_half_matches_f32(
    name: &str,
    dtype: DType,
    bound: f64,
    half: impl Fn(&[Tensor]) -> Result<Tensor>,
    composite: impl Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
) {
    let rounded: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_dtype(dtype)?.to_dtype(DType::F32))
        .collect::<Result<_>>()
        .unwrap();
    let in_half = |t: &[Tensor]| {
        let t: Vec<Tensor> = t.iter().map(|x| x.to_dtype(dtype)).collect::<Result<_>>()?;
        half(&t)?.to_dtype(DType::F32)
    };
    let (vh, gh) = value_and_grads(in_half, &rounded, 99);
    let (vc, gc) = value_and_grads(composite, &rounded, 99);
    let e = rel_err(&vh, &vc);
    assert!(e <= bound, "{name} {dtype:?}: value rel. error {e:e}");
    for (i, (a, b)) in gh.iter().zip(&gc).enumerate() {
        let e = rel_err(a, b);
        assert!(
            e <= bound,
            "{name} {dtype:?}: gradient of input {i} rel. error {e:e}"
        );
    }
}

#[test]
fn fused_ops_in_half_precision_compute_in_f32_and_round_once() {
    // The fused ops on bf16/f16 storage differ from the f32 composite ops on the same values
    // only by rounding their results (and the incoming gradient) once: well under the
    // composite ops' own error in the half type, which rounds every intermediate.
    let (b, t, h, d, v) = (2, 24, 2, 16, 40);
    let (targets, mask) = labels(b * t, v, 3);
    for (dtype, bound) in [(DType::BF16, 6e-3), (DType::F16, 1e-3)] {
        let rows = random(&[b * t, d], 2.0, 1)
            .broadcast_add(&random(&[b * t, 1], 3.0, 2))
            .unwrap();
        let (gain, bias) = (random(&[d], 1.0, 3), random(&[d], 1.0, 4));
        assert_half_matches_f32(
            "layer_norm",
            dtype,
            bound,
            |t| fused::layer_norm(&t[0], &t[1], &t[2], 1e-5),
            |t| composite::layer_norm(&t[0], &t[1], &t[2], 1e-5),
            &[rows.clone(), gain, bias],
        );
        let (w, bias) = (random(&[d, 3 * d], 0.5, 5), random(&[3 * d], 0.5, 6));
        assert_half_matches_f32(
            "linear",
            dtype,
            bound,
            |t| fused::linear(&t[0], &t[1], &t[2]),
            |t| composite::linear(&t[0], &t[1], &t[2]),
            &[rows.clone(), w.clone(), bias.clone()],
        );
        assert_half_matches_f32(
            "gelu_linear",
            dtype,
            bound,
            |t| fused::gelu_linear(&t[0], &t[1], &t[2]),
            |t| composite::linear(&composite::gelu(&t[0])?, &t[1], &t[2]),
            &[rows.clone(), w.clone(), bias],
        );
        assert_half_matches_f32(
            "project",
            dtype,
            bound,
            |t| fused::project(&t[0], &t[1]),
            |t| t[0].matmul(&t[1]),
            &[rows.clone(), w],
        );
        // One band of rows, and three (the products on the packed kernels where the CPU has
        // them).
        for (b, t, d) in [(b, t, d), (1, 150, 4 * d)] {
            assert_half_matches_f32(
                "causal_attention",
                dtype,
                bound,
                |x| fused::causal_attention(&x[0], mha(b, t, h, d), None),
                |x| composite::causal_attention(&x[0], mha(b, t, h, d), None),
                &[random(&[b * t, 3 * d], 2.0, 7)],
            );
        }
        let head = random(&[d, v], 0.5, 8);
        assert_half_matches_f32(
            "linear_nll_sum",
            dtype,
            bound,
            |t| fused::linear_nll_sum(&t[0], &t[1], WeightLayout::InOut, &targets, &mask, None),
            |t| composite::nll_sum(&t[0].matmul(&t[1])?, &targets, &mask),
            &[rows.clone(), head],
        );
        assert_half_matches_f32(
            "nll_sum",
            dtype,
            bound,
            |t| fused::nll_sum(&t[0], &targets, &mask),
            |t| composite::nll_sum(&t[0], &targets, &mask),
            &[random(&[b * t, v], 5.0, 9)],
        );
    }
}

#[test]
fn half_precision_takes_the_fused_ops_on_the_cpu() {
    let x = random(&[6, 8], 1.0, 1).to_dtype(DType::BF16).unwrap();
    let (w, b) = (
        random(&[8, 8], 1.0, 2).to_dtype(DType::BF16).unwrap(),
        random(&[8], 1.0, 3).to_dtype(DType::BF16).unwrap(),
    );
    assert!(fused_model_domain(&[&x, &w, &b]));
    assert!(!fused_model_domain(&[&x, &w.to_dtype(DType::F32).unwrap()]));
    let _lean = force_lean(true);
    assert!(!fused_model_domain(&[&x, &w, &b]));
}

#[test]
fn fused_half_gradients_are_summed_in_f32_and_rounded_once() {
    // 4096 rows into one bias, gain or weight gradient: summed in bf16 that loses several
    // percent (`ops::half`'s test); summed in f32 and rounded once it stays within bf16's
    // rounding (2⁻⁹ relative).
    let (rows, d) = (4096usize, 8usize);
    let dev = Device::Cpu;
    // 1 + k/128: exact in bf16, so only the reduction can err.
    let grad: Vec<f32> = (0..rows * d)
        .map(|i| 1.0 + (i % 7) as f32 / 128.0)
        .collect();
    let grad = Tensor::from_vec(grad, (rows, d), &dev).unwrap();
    let exact = grad.sum(0).unwrap();
    let within = |g: &Tensor, what: &str| {
        let e = rel_err(&g.to_dtype(DType::F32).unwrap(), &exact);
        assert!(e < 2f64.powi(-9), "{what}: {e:e} off the exact sum");
    };
    let var = |shape: (usize, usize), value: f32| {
        let t = Tensor::full(value, shape, &dev).unwrap();
        Var::from_tensor(&t.to_dtype(DType::BF16).unwrap()).unwrap()
    };
    let (x, w) = (var((rows, d), 1.0), var((d, d), 0.0));
    let b = Var::from_tensor(&Tensor::zeros(d, DType::BF16, &dev).unwrap()).unwrap();
    let y = fused::linear(x.as_tensor(), w.as_tensor(), b.as_tensor()).unwrap();
    let loss = (y.to_dtype(DType::F32).unwrap() * &grad).unwrap().sum_all();
    let g = loss.unwrap().backward().unwrap();
    within(g.get(b.as_tensor()).unwrap(), "linear bias");
    // x is all ones, so every row of dW is the same column sums.
    let dw = g.get(w.as_tensor()).unwrap();
    within(&dw.get(3).unwrap(), "linear weight row");
    let (gain, beta) = (
        Var::from_tensor(&Tensor::ones(d, DType::BF16, &dev).unwrap()).unwrap(),
        Var::from_tensor(&Tensor::zeros(d, DType::BF16, &dev).unwrap()).unwrap(),
    );
    let y = fused::layer_norm(x.as_tensor(), gain.as_tensor(), beta.as_tensor(), 1e-5).unwrap();
    let loss = (y.to_dtype(DType::F32).unwrap() * &grad).unwrap().sum_all();
    let g = loss.unwrap().backward().unwrap();
    within(g.get(beta.as_tensor()).unwrap(), "layer norm bias");
}

#[test]
fn linear_nll_rejects_a_target_outside_the_vocabulary() {
    let targets = Tensor::new(&[0u32, 7, 1, 2], &Device::Cpu).unwrap();
    let mask = Tensor::ones(4, DType::F32, &Device::Cpu).unwrap();
    let (x, w) = (random(&[4, 8], 1.0, 2), random(&[8, 5], 1.0, 3));
    let err =
        fused::linear_nll_sum(&x, &w, WeightLayout::InOut, &targets, &mask, None).unwrap_err();
    assert!(err.to_string().contains("outside vocab 5"), "{err}");
}

#[test]
fn low_precision_inputs_take_a_differentiable_path() {
    let x = random(&[4, 8], 1.0, 10);
    for dtype in [DType::BF16, DType::F16] {
        let (g, b) = (random(&[8], 1.0, 11), random(&[8], 1.0, 12));
        let f = |t: &[Tensor]| {
            let h = t[0].to_dtype(dtype)?;
            let h = layer_norm(&h, &t[1].to_dtype(dtype)?, &t[2].to_dtype(dtype)?, 1e-5)?;
            let h = composite::gelu(&h)?;
            let h = composite::causal_softmax(&h.reshape((2, 4, 4))?, 0.5)?;
            h.to_dtype(DType::F32)
        };
        let (low, grads) = value_and_grads(f, &[x.clone(), g.clone(), b.clone()], 13);
        let (reference, _) = value_and_grads(
            |t| {
                let h = composite::layer_norm(&t[0], &t[1], &t[2], 1e-5)?;
                composite::causal_softmax(&composite::gelu(&h)?.reshape((2, 4, 4))?, 0.5)
            },
            &[x.clone(), g, b],
            13,
        );
        assert!(rel_err(&low, &reference) < 3e-2, "{dtype:?}");
        assert!(grads.iter().all(|g| g.dtype() == DType::F32));
    }
}
