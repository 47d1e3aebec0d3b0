//! The weights one forward computes with: each `Var` cast once to the compute dtype.

use candle_core::{DType, Result, Tensor, Var};

use super::*;

/// The weights one forward computes with: the f32 Vars, detached when no graph is wanted, cast
/// once each to the compute dtype.
pub struct Weights {
    dtype: DType,
    track: bool,
    /// Where gradients computed outside the graph go (a graph is wanted).
    grads: Option<ParamGrads>,
    /// The casts made so far (the forward's compute weights).
    casts: Vec<Tensor>,
}

impl Weights {
    /// Weights for a forward in `dtype`. With `grads` they stay in the graph (training), and
    /// gradients computed outside it are left there; without, they are detached (evaluation).
    pub fn new(dtype: DType, grads: Option<&ParamGrads>) -> Weights {
        Weights {
            dtype,
            track: grads.is_some(),
            grads: grads.cloned(),
            casts: Vec::new(),
        }
    }

    /// A residual step's weights as this forward computes with them, and the sink the step
    /// hands their gradients to (none when the weights are detached). A gradient arrives rounded
    /// to the compute dtype (stored in it, or already widened to f32) and lands in the `Var`'s
    /// dtype exactly.
    pub(super) fn step(
        &mut self,
        norm: &Norm,
        (first, second): (&[Dense], &Dense),
        frozen: bool,
        dims: &Dims,
    ) -> Result<(StepWeights, Option<GradSink>)> {
        let base = |w: &mut Weights, var: &Var| match frozen {
            true => w.fixed(var),
            false => w.get(var),
        };
        let mut dense = |d: &Dense| -> Result<StepDense> {
            let adapter = match &d.adapter {
                Some(a) => Some(ops::step::Adapter {
                    a: self.get(&a.a)?,
                    b: self.get(&a.b)?,
                    scale: a.scale,
                    dropout: a.dropout(dims),
                }),
                None => None,
            };
            Ok(StepDense {
                w: base(self, &d.w)?,
                b: d.b.as_ref().map(|b| base(self, b)).transpose()?,
                adapter,
            })
        };
        let first_weights = first.iter().map(&mut dense).collect::<Result<Vec<_>>>()?;
        let second_weights = dense(second)?;
        let weights = StepWeights {
            gain: base(self, &norm.g)?,
            shift: norm.b.as_ref().map(|b| base(self, b)).transpose()?,
            first: first_weights,
            second: second_weights,
            frozen,
        };
        let sink = self.grads.clone().map(|grads| {
            let vars = step_vars(norm, first, second, frozen);
            Box::new(move |g: Vec<Tensor>| {
                for (var, g) in vars.iter().zip(g) {
                    grads.add(var, g.to_dtype(var.dtype())?)?;
                }
                Ok(())
            }) as GradSink
        });
        Ok((weights, sink))
    }

    /// The dtype this forward computes in.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// `var` as this forward computes with it.
    pub fn get(&mut self, var: &Var) -> Result<Tensor> {
        let w = if self.track {
            var.as_tensor().clone()
        } else {
            var.as_tensor().detach()
        };
        if w.dtype() == self.dtype {
            return Ok(w);
        }
        let cast = crate::ops::cast(&w, self.dtype)?;
        self.casts.push(cast.clone());
        Ok(cast)
    }

    /// A frozen `var` as this forward computes with it: never in the graph.
    pub fn fixed(&mut self, var: &Var) -> Result<Tensor> {
        let w = var.as_tensor().detach();
        if w.dtype() == self.dtype {
            return Ok(w);
        }
        let cast = crate::ops::cast(&w, self.dtype)?;
        self.casts.push(cast.clone());
        Ok(cast)
    }

    /// The casts made, which the ledger counts as compute weights.
    pub fn into_casts(self) -> Vec<Tensor> {
        self.casts
    }
}

/// A residual step's trained `Var`s in `StepWeights::trainable` order: with a frozen base the
/// adapters only.
fn step_vars(norm: &Norm, first: &[Dense], second: &Dense, frozen: bool) -> Vec<Var> {
    let mut vars = Vec::new();
    if !frozen {
        vars.push(norm.g.clone());
        vars.extend(norm.b.clone());
    }
    for d in first.iter().chain([second]) {
        if !frozen {
            vars.push(d.w.clone());
            vars.extend(d.b.clone());
        }
        if let Some(a) = &d.adapter {
            vars.extend([a.a.clone(), a.b.clone()]);
        }
    }
    vars
}
