//! The knob table: every knob a control can turn, declared once in [`KNOBS`]. The preset key,
//! the labels, the control kind, the values and their bounds, the `steps.csv` column, the
//! compare grid item, the place in the Controls pane and the keys that turn it are read from
//! here by `scenario` (keys, checks), `Control::describe`, `gaccwb compare`, the CSV export, the
//! terminal's keymap, footer and Controls pane, and the tests that hold the docs to it.
//!
//! A table of plain struct literals rather than a macro or strum attributes: each knob reads as
//! one block of named fields, rustdoc documents the fields once, and the compiler checks every
//! entry without macro expansion in the way. What a knob *does* (its `Control` variant, its
//! `Knobs` field, the trainer's reaction) stays ordinary code.

use super::{
    AccumPolicy, Checkpointing, Control, Dtype, Knobs, LossNorm, LrRule, SyncEvery,
    Zero2Accumulate, ZeroGrad,
};
use crate::limits::{MAX_ACCUM_STEPS, MAX_MICRO_BATCH};

/// One knob.
#[derive(Debug)]
pub struct Knob {
    /// Its key under `[train]`: presets, `--set train.KEY`, a recording's header; also the
    /// field of `Knobs` that holds it.
    pub key: &'static str,
    /// Its short name on screen: the Controls pane, a change (`B 32→4`), the footer.
    pub label: &'static str,
    /// Its name in the event log and `controls.csv` (`micro-batch=4`).
    pub name: &'static str,
    /// What it is, in words, for error messages (`accumulation steps must be at least 1`).
    pub what: &'static str,
    /// The control that sets it: `kind` in timelines, `--control` and recordings.
    pub kind: &'static str,
    /// Its values and their bounds.
    pub values: Values,
    /// Its `steps.csv` column, when the step event carries it.
    pub csv: Option<&'static str>,
    /// Its short item in a `gaccwb compare` grid, if it has one (besides `train.KEY=value`).
    pub grid: Option<Grid>,
    /// The line of the Controls pane it is shown on (0 first), if it is shown there.
    pub pane: Option<u8>,
    /// Changing it changes what a step holds, so a new memory estimate is due.
    pub moves_memory: bool,
    /// The keys that turn it in the workbench.
    pub actions: &'static [KnobAction],
}

/// What values a knob takes, how they read and what bounds them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Values {
    /// An integer from 1 to `max`.
    Count {
        /// The largest count allowed.
        max: usize,
    },
    /// A finite number ≥ 0, shown as `3.00e-3`.
    Rate,
    /// A positive number, or none: off.
    PositiveOrOff,
    /// `true` or `false`, shown as on and off.
    OnOff,
    /// An integer from 0 to `max` (a stage).
    Stage {
        /// The highest stage.
        max: u8,
    },
    /// One of these names, as presets write them (`every-N`: a pattern).
    Names(&'static [&'static str]),
}

/// A knob's item in a `gaccwb compare` grid.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Grid {
    /// `ITEM=VALUE`; `ITEM` alone means `bare`, when there is one.
    Item {
        /// The item's name (`K`, `ckpt`).
        item: &'static str,
        /// The value the bare item stands for (`ckpt` alone: `blocks`); `None`: a value is needed.
        bare: Option<&'static str>,
    },
    /// Each of the knob's value names is an item on its own (`bf16`).
    ValueNames,
}

/// A key action that turns a knob: its name in `keys.toml`, its default keys, its line in the
/// help overlay, and the control it sends given the knobs it will apply to and the knobs the
/// run was configured with (what a toggle turns back on).
#[derive(Debug)]
pub struct KnobAction {
    /// Its name in `keys.toml` (`accum_up`).
    pub name: &'static str,
    /// The keys bound to it unless `keys.toml` says otherwise.
    pub keys: &'static [&'static str],
    /// Its line in the help overlay.
    pub help: &'static str,
    /// The control it sends, from the knobs it will apply to and the knobs the run was
    /// configured with.
    pub turn: fn(now: &Knobs, configured: &Knobs) -> Control,
}

/// Every knob, in the order the help overlay, the footer and the Controls pane list them.
pub static KNOBS: &[Knob] = &[
    Knob {
        key: "accum_steps",
        label: "K",
        name: "K",
        what: "accumulation steps",
        kind: "set_accum_steps",
        values: Values::Count {
            max: MAX_ACCUM_STEPS,
        },
        csv: Some("accum_steps"),
        grid: Some(Grid::Item {
            item: "K",
            bare: None,
        }),
        pane: Some(0),
        moves_memory: true,
        actions: &[
            KnobAction {
                name: "accum_up",
                keys: &["+"],
                help: "accumulation steps K ×2",
                turn: |k, _| Control::SetAccumSteps {
                    value: k.accum_steps.saturating_mul(2),
                },
            },
            KnobAction {
                name: "accum_down",
                keys: &["-"],
                help: "accumulation steps K ÷2",
                turn: |k, _| Control::SetAccumSteps {
                    value: (k.accum_steps / 2).max(1),
                },
            },
        ],
    },
    Knob {
        key: "micro_batch",
        label: "B",
        name: "micro-batch",
        what: "micro-batch",
        kind: "set_micro_batch",
        values: Values::Count {
            max: MAX_MICRO_BATCH,
        },
        csv: Some("micro_batch"),
        grid: Some(Grid::Item {
            item: "B",
            bare: None,
        }),
        pane: Some(0),
        moves_memory: true,
        actions: &[
            KnobAction {
                name: "micro_batch_down",
                keys: &["b"],
                help: "micro-batch ÷2",
                turn: |k, _| Control::SetMicroBatch {
                    value: (k.micro_batch / 2).max(1),
                },
            },
            KnobAction {
                name: "micro_batch_up",
                keys: &["B"],
                help: "micro-batch ×2",
                turn: |k, _| Control::SetMicroBatch {
                    value: k.micro_batch.saturating_mul(2),
                },
            },
        ],
    },
    Knob {
        key: "clip",
        label: "clip",
        name: "clip",
        what: "clip",
        kind: "set_clip",
        values: Values::PositiveOrOff,
        csv: Some("clip"),
        grid: None,
        pane: Some(1),
        moves_memory: true,
        actions: &[
            KnobAction {
                name: "clip_down",
                keys: &["c"],
                help: "clip norm ÷2",
                turn: |k, c| Control::SetClip {
                    value: Some(k.clip.unwrap_or(clip_on(c)) / 2.0),
                },
            },
            KnobAction {
                name: "clip_up",
                keys: &["C"],
                help: "clip norm ×2",
                turn: |k, c| Control::SetClip {
                    value: Some(k.clip.unwrap_or(clip_on(c)) * 2.0),
                },
            },
            KnobAction {
                name: "clip_toggle",
                keys: &["x"],
                help: "clipping off / on",
                turn: |k, c| Control::SetClip {
                    value: match k.clip {
                        Some(_) => None,
                        None => Some(clip_on(c)),
                    },
                },
            },
        ],
    },
    Knob {
        key: "lr",
        label: "lr",
        name: "lr",
        what: "lr",
        kind: "set_lr",
        values: Values::Rate,
        // The column is the scheduled LR of the step, not this base LR.
        csv: None,
        grid: None,
        // The pane shows the scheduled LR of the latest step instead.
        pane: None,
        moves_memory: false,
        actions: &[],
    },
    Knob {
        key: "lr_rule",
        label: "lr rule",
        name: "lr rule",
        what: "LR rule",
        kind: "set_lr_rule",
        values: Values::Names(<LrRule as strum::VariantNames>::VARIANTS),
        csv: None,
        grid: None,
        pane: Some(1),
        moves_memory: false,
        actions: &[KnobAction {
            name: "lr_rule_cycle",
            keys: &["l"],
            help: "LR rule none→linear→sqrt",
            turn: |k, _| Control::SetLrRule {
                value: k.lr_rule.next(),
            },
        }],
    },
    Knob {
        key: "dtype",
        label: "dtype",
        name: "dtype",
        what: "precision",
        kind: "set_dtype",
        values: Values::Names(<Dtype as strum::VariantNames>::VARIANTS),
        csv: Some("dtype"),
        grid: Some(Grid::ValueNames),
        pane: Some(2),
        moves_memory: true,
        actions: &[KnobAction {
            name: "precision_cycle",
            keys: &["p"],
            help: "precision f32→bf16→f16",
            turn: |k, _| Control::SetDtype {
                value: k.dtype.next(),
            },
        }],
    },
    Knob {
        key: "offload",
        label: "offload",
        name: "offload",
        what: "offload",
        kind: "set_offload",
        values: Values::OnOff,
        csv: Some("offload"),
        grid: Some(Grid::Item {
            item: "offload",
            bare: Some("true"),
        }),
        pane: Some(2),
        moves_memory: true,
        actions: &[KnobAction {
            name: "offload_toggle",
            keys: &["o"],
            help: "optimizer offload on / off",
            turn: |k, _| Control::SetOffload { value: !k.offload },
        }],
    },
    Knob {
        key: "checkpointing",
        label: "ckpt",
        name: "checkpointing",
        what: "activation checkpointing",
        kind: "set_checkpointing",
        values: Values::Names(Checkpointing::NAMES),
        csv: None,
        grid: Some(Grid::Item {
            item: "ckpt",
            bare: Some("blocks"),
        }),
        pane: Some(2),
        moves_memory: true,
        actions: &[KnobAction {
            name: "checkpoint_toggle",
            keys: &["k"],
            help: "checkpointing on / off",
            turn: |k, _| Control::SetCheckpointing {
                value: match k.checkpointing {
                    Checkpointing::None => Checkpointing::Blocks,
                    _ => Checkpointing::None,
                },
            },
        }],
    },
    Knob {
        key: "accum_policy",
        label: "K policy",
        name: "K policy",
        what: "K policy",
        kind: "set_accum_policy",
        values: Values::Names(<AccumPolicy as strum::VariantNames>::VARIANTS),
        csv: None,
        grid: None,
        // The noise line of the pane shows it beside the critical batch.
        pane: None,
        moves_memory: false,
        actions: &[KnobAction {
            name: "accum_policy_toggle",
            keys: &["a"],
            help: "K policy fixed / noise",
            turn: |k, _| Control::SetAccumPolicy {
                value: k.accum_policy.toggled(),
            },
        }],
    },
    Knob {
        key: "loss_norm",
        label: "loss norm",
        name: "loss norm",
        what: "loss normalisation",
        kind: "set_loss_norm",
        values: Values::Names(<LossNorm as strum::VariantNames>::VARIANTS),
        csv: None,
        grid: None,
        pane: None,
        moves_memory: true,
        actions: &[],
    },
    Knob {
        key: "zero_grad",
        label: "zero-grad",
        name: "zero-grad",
        what: "zero-grad",
        kind: "set_zero_grad",
        values: Values::Names(<ZeroGrad as strum::VariantNames>::VARIANTS),
        csv: None,
        grid: None,
        pane: None,
        moves_memory: true,
        actions: &[],
    },
    Knob {
        key: "sync",
        label: "sync",
        name: "sync",
        what: "gradient sync",
        kind: "set_sync",
        values: Values::Names(<SyncEvery as strum::VariantNames>::VARIANTS),
        csv: None,
        grid: None,
        pane: None,
        moves_memory: false,
        actions: &[KnobAction {
            name: "sync_toggle",
            keys: &["y"],
            help: "grad sync window / micro",
            turn: |k, _| Control::SetSync {
                value: match k.sync {
                    SyncEvery::Window => SyncEvery::MicroBatch,
                    SyncEvery::MicroBatch => SyncEvery::Window,
                },
            },
        }],
    },
    Knob {
        key: "zero",
        label: "ZeRO",
        name: "ZeRO",
        what: "ZeRO stage",
        kind: "set_zero",
        values: Values::Stage { max: 2 },
        csv: None,
        grid: None,
        pane: None,
        moves_memory: true,
        actions: &[KnobAction {
            name: "zero_cycle",
            keys: &["w"],
            help: "ZeRO stage 0 → 1 → 2",
            turn: |k, _| Control::SetZero {
                value: (k.zero + 1) % 3,
            },
        }],
    },
    Knob {
        key: "zero2_accumulate",
        label: "ZeRO-2 sums",
        name: "ZeRO-2 accumulate",
        what: "ZeRO-2 accumulation",
        kind: "set_zero2_accumulate",
        values: Values::Names(<Zero2Accumulate as strum::VariantNames>::VARIANTS),
        csv: None,
        grid: None,
        pane: None,
        moves_memory: true,
        actions: &[],
    },
];

/// The clip a key turns clipping back on with: the run's configured clip, else 1.0.
fn clip_on(configured: &Knobs) -> f64 {
    configured.clip.unwrap_or(1.0)
}

impl Knob {
    /// The knob with preset key `key` (`accum_steps`).
    pub fn by_key(key: &str) -> Option<&'static Knob> {
        KNOBS.iter().find(|k| k.key == key)
    }

    /// The knob control `kind` sets (`set_accum_steps`).
    pub fn by_kind(kind: &str) -> Option<&'static Knob> {
        KNOBS.iter().find(|k| k.kind == kind)
    }

    /// The key action named `name` (`accum_up`), with its knob.
    pub fn action(name: &str) -> Option<(&'static Knob, &'static KnobAction)> {
        KNOBS
            .iter()
            .flat_map(|k| k.actions.iter().map(move |a| (k, a)))
            .find(|(_, a)| a.name == name)
    }

    /// Its value in `k`, in the user's words.
    pub fn show(&self, k: &Knobs) -> String {
        self.values.show(knob_value(k, self.key).as_ref())
    }

    /// `value` (as serde writes it; absent: none) within this knob's bounds; the error says
    /// what is allowed and what was given.
    pub fn check(&self, value: Option<&serde_json::Value>) -> Result<(), OutOfBounds> {
        self.values.check(value)
    }
}

/// A knob value outside its bounds.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum OutOfBounds {
    /// A count of 0.
    #[error("must be at least 1 (got {0})")]
    BelowOne(u64),
    /// A value above the knob's largest.
    #[error("must be at most {max} (got {got})")]
    AboveMax {
        /// The value given.
        got: u64,
        /// The largest allowed.
        max: usize,
    },
    /// A rate that is negative or not finite.
    #[error("must be a finite number ≥ 0 (got {0})")]
    Negative(f64),
    /// A value that must be positive or left out (off), given as 0, negative or not finite.
    #[error("must be positive (got {0}); leave it out to turn it off")]
    NotPositive(f64),
}

impl Values {
    /// A value as the event log and the Controls pane show it.
    pub fn show(&self, value: Option<&serde_json::Value>) -> String {
        use serde_json::Value as J;
        match (self, value) {
            (_, None | Some(J::Null)) => "off".into(),
            (Values::OnOff, Some(J::Bool(b))) => if *b { "on" } else { "off" }.into(),
            (Values::Rate, Some(v)) => format!("{:.2e}", v.as_f64().unwrap_or(f64::NAN)),
            (_, Some(J::String(s))) => s.clone(),
            (_, Some(J::Number(n))) => match n.as_u64() {
                Some(u) => u.to_string(),
                None => n.as_f64().unwrap_or(f64::NAN).to_string(),
            },
            (_, Some(v)) => v.to_string(),
        }
    }

    fn check(&self, value: Option<&serde_json::Value>) -> Result<(), OutOfBounds> {
        let number = value.and_then(serde_json::Value::as_f64);
        match (*self, number) {
            (Values::Count { max }, Some(x)) => {
                let n = x as u64;
                if n == 0 {
                    Err(OutOfBounds::BelowOne(n))
                } else if n > max as u64 {
                    Err(OutOfBounds::AboveMax { got: n, max })
                } else {
                    Ok(())
                }
            }
            (Values::Stage { max }, Some(x)) if x > f64::from(max) => Err(OutOfBounds::AboveMax {
                got: x as u64,
                max: usize::from(max),
            }),
            (Values::Rate, Some(x)) if !(x.is_finite() && x >= 0.0) => {
                Err(OutOfBounds::Negative(x))
            }
            (Values::PositiveOrOff, Some(x)) if !(x.is_finite() && x > 0.0) => {
                Err(OutOfBounds::NotPositive(x))
            }
            _ => Ok(()),
        }
    }
}

/// The value of the knob `key` in `k`, as serde writes it (`None`: absent, i.e. off).
fn knob_value(k: &Knobs, key: &str) -> Option<serde_json::Value> {
    serde_json::to_value(k)
        .ok()?
        .get(key)
        .cloned()
        .filter(|v| !v.is_null())
}

impl Control {
    /// The knob this control sets; `None` for the loss scale and flow controls.
    pub fn knob(&self) -> Option<&'static Knob> {
        Knob::by_kind(self.kind())
    }

    /// The control's `kind`, as timelines, `--control` and recordings write it.
    pub fn kind(&self) -> &'static str {
        self.into()
    }

    /// The control's `value` as serde writes it (`None`: no value, or none given).
    pub fn value(&self) -> Option<serde_json::Value> {
        serde_json::to_value(self)
            .ok()?
            .get("value")
            .cloned()
            .filter(|v| !v.is_null())
    }
}

#[cfg(test)]
mod tests;
