use super::*;

/// A block joins the graph as two nodes (its residual steps, one op each: fused on the CPU,
/// lean elsewhere) with no weight among their inputs, so the backward crosses Candle's add
/// in the compute dtype twice per block (an `[N, D]` tensor each) and never for a weight;
/// every weight still gets its gradient, in its own dtype. The plain composite reference
/// is op by op, with the weights among the ops' inputs.
#[test]
fn a_block_is_two_graph_nodes_and_its_weights_get_gradients() {
    let cfg = ModelConfig {
        vocab: 16,
        d_model: 16,
        layers: 1,
        heads: 2,
        seq_len: 8,
        path: None,
        adapter: None,
    };
    let gpt = Gpt::new(&cfg, 3, &Device::Cpu).unwrap();
    let dims = Dims {
        batch: 2,
        tokens: 8,
        rope: None,
        samples: None,
    };
    let block = &gpt.blocks[0];
    for (lean, plain, dtype) in [
        (false, false, DType::F32),
        (false, false, DType::BF16),
        (true, false, DType::F32),
        (true, true, DType::F32),
    ] {
        let _kernels = ops::force_lean(lean);
        let _plain = ops::force_plain(plain);
        let x = Tensor::randn(0f32, 1.0, (16, 16), &Device::Cpu).unwrap();
        let x = Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap();
        let grads = ParamGrads::default();
        let mut w = Weights::new(dtype, Some(&grads));
        let y = block.forward(x.as_tensor(), &dims, &mut w).unwrap();
        // The input, then the nodes the block made.
        let made = y.sorted_nodes().len() - 1;
        if plain {
            assert!(made > 2, "op by op: {made} nodes");
        } else {
            assert_eq!(made, 2, "{dtype:?}, lean {lean}");
        }
        let store = y.to_dtype(DType::F32).unwrap().sum_all().unwrap();
        let store = store.backward().unwrap();
        assert_eq!(store.get(x.as_tensor()).unwrap().dtype(), dtype);
        for var in block.vars() {
            assert_eq!(store.get(var.as_tensor()).is_some(), plain);
            let g = grads
                .get(&store, var)
                .unwrap()
                .expect("every weight gets a gradient");
            assert_eq!((g.dtype(), g.dims()), (var.dtype(), var.dims()));
            assert!(
                g.abs()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
                    > 0.0
            );
        }
    }
}
