//! The linear layers of one block, named as each family's `transformers` class names them: what
//! the parameter count sums, what LoRA adapts (`--lora-targets` takes these names) and what the
//! activation count asks about ("is this layer's input kept for its weight gradient?").

use serde::Serialize;

use super::{Arch, Mlp};

/// Where a linear layer sits, which says how many copies there are and how many tokens each sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Place {
    /// In the attention of every layer.
    Attention,
    /// In the dense MLP of every layer without experts.
    Dense,
    /// In each expert of every layer with experts: a token meets `per_token` of them.
    Expert,
    /// In the shared expert of every layer with experts.
    Shared,
    /// The router (and the shared expert's gate) of every layer with experts.
    Router,
}

/// What a linear layer's input is, for the activations it keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// q, k or v (or the fused qkv): the attention norm's output.
    Qkv,
    /// The attention's output projection: the attention's output.
    Out,
    /// The MLP's first matrices (gate, up, fc): the MLP norm's output.
    MlpIn,
    /// The MLP's last matrix (down, fc2): the activation (or gated product).
    MlpOut,
    /// The router and the shared expert's gate: the MLP norm's output.
    Router,
}

/// One linear layer of a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Linear {
    /// The module name (`q_proj`, `c_attn`, `w1`, …).
    pub name: &'static str,
    /// Input width.
    pub inputs: u64,
    /// Output width.
    pub outputs: u64,
    /// With a bias.
    pub bias: bool,
    /// Where it sits.
    pub place: Place,
    /// What its input is.
    pub role: Role,
}

impl Linear {
    /// Weights and bias.
    pub fn params(&self) -> u64 {
        self.inputs * self.outputs + if self.bias { self.outputs } else { 0 }
    }
}

/// The module names that differ by family: the fused qkv, the output projection, the GELU MLP's
/// two matrices, and each expert's gate, up and down.
struct Names {
    qkv: &'static str,
    out: &'static str,
    fc: &'static str,
    fc2: &'static str,
    expert: [&'static str; 3],
}

fn names(family: &str) -> Names {
    match family {
        "gpt2" | "gpt3" | "gaccwb" => Names {
            qkv: "c_attn",
            out: "c_proj",
            fc: "c_fc",
            fc2: "c_proj",
            expert: ["gate_proj", "up_proj", "down_proj"],
        },
        "gpt_neox" => Names {
            qkv: "query_key_value",
            out: "dense",
            fc: "dense_h_to_4h",
            fc2: "dense_4h_to_h",
            expert: ["gate_proj", "up_proj", "down_proj"],
        },
        "mixtral" => Names {
            qkv: "qkv_proj",
            out: "o_proj",
            fc: "fc1",
            fc2: "fc2",
            expert: ["w1", "w3", "w2"],
        },
        _ => Names {
            qkv: "qkv_proj",
            out: "o_proj",
            fc: "fc1",
            fc2: "fc2",
            expert: ["gate_proj", "up_proj", "down_proj"],
        },
    }
}

impl Arch {
    /// The linear layers of a block, each once (copies are `Arch`'s to count).
    pub fn linears(&self) -> Vec<Linear> {
        let n = names(&self.family);
        let (h, q, kv) = (self.hidden, self.q_width(), self.kv_width());
        let lin = |name, inputs, outputs, bias, place, role| Linear {
            name,
            inputs,
            outputs,
            bias,
            place,
            role,
        };
        let mut out = if self.fused_qkv {
            vec![lin(
                n.qkv,
                h,
                q + 2 * kv,
                self.qkv_bias,
                Place::Attention,
                Role::Qkv,
            )]
        } else {
            ["q_proj", "k_proj", "v_proj"]
                .into_iter()
                .zip([q, kv, kv])
                .map(|(name, o)| lin(name, h, o, self.qkv_bias, Place::Attention, Role::Qkv))
                .collect()
        };
        out.push(lin(n.out, q, h, self.out_bias, Place::Attention, Role::Out));
        let f = self.intermediate;
        let b = self.mlp_bias;
        match (self.mlp, self.fused_mlp) {
            (Mlp::Gelu, _) => out.extend([
                lin(n.fc, h, f, b, Place::Dense, Role::MlpIn),
                lin(n.fc2, f, h, b, Place::Dense, Role::MlpOut),
            ]),
            (_, true) => out.extend([
                lin("gate_up_proj", h, 2 * f, b, Place::Dense, Role::MlpIn),
                lin("down_proj", f, h, b, Place::Dense, Role::MlpOut),
            ]),
            (_, false) => out.extend(gated(
                ["gate_proj", "up_proj", "down_proj"],
                h,
                f,
                b,
                Place::Dense,
            )),
        }
        if let Some(e) = self.experts {
            out.extend(gated(n.expert, h, e.intermediate, false, Place::Expert));
            if e.shared > 0 {
                out.extend(gated(
                    ["gate_proj", "up_proj", "down_proj"],
                    h,
                    e.shared,
                    false,
                    Place::Shared,
                ));
            }
            out.push(lin("gate", h, e.count, false, Place::Router, Role::Router));
            if e.shared_gate {
                out.push(lin(
                    "shared_expert_gate",
                    h,
                    1,
                    false,
                    Place::Router,
                    Role::Router,
                ));
            }
        }
        out
    }
}

/// A gated MLP's three matrices: gate and up (`h → f`), down (`f → h`).
fn gated(names: [&'static str; 3], h: u64, f: u64, bias: bool, place: Place) -> [Linear; 3] {
    let [gate, up, down] = names;
    [
        Linear {
            name: gate,
            inputs: h,
            outputs: f,
            bias,
            place,
            role: Role::MlpIn,
        },
        Linear {
            name: up,
            inputs: h,
            outputs: f,
            bias,
            place,
            role: Role::MlpIn,
        },
        Linear {
            name: down,
            inputs: f,
            outputs: h,
            bias,
            place,
            role: Role::MlpOut,
        },
    ]
}
