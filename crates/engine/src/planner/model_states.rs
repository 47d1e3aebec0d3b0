//! Where the model states of 16-bit mixed-precision AdamW live under ZeRO stages 0–3 over W
//! ranks on one host, and with offload of the optimizer state, the gradients or the parameters.
//!
//! The accounting is DeepSpeed's (`estimate_zero2_model_states_mem_needs`,
//! `estimate_zero3_model_states_mem_needs`), per parameter: 16-bit weights (2 bytes), 16-bit
//! gradients (2), the fp32 gradient the optimizer reads (4) and the optimizer state proper
//! (12: fp32 master weights and the two moments). Stage ≥ 1 partitions the fp32 gradient and the
//! optimizer state over the ranks; stage 3 also the 16-bit weights and keeps 16-bit gradients
//! only for the module being computed, beside a gathered copy of its weights (the largest module
//! sizes that working set: 4 bytes per parameter). Like DeepSpeed's estimate, stages 1 and 2 hold
//! the same bytes (the 16-bit gradients whole); they differ in when gradients are reduced
//! (`step_time`).
//!
//! Under LoRA the trained parameters are the adapters, counted as above, and the frozen base is
//! one more piece: its bytes at its dtype, partitioned by stage 3 and offloaded with the
//! parameters like the 16-bit weights, with no gradient and no optimizer state.

use serde::Serialize;

/// Bytes per parameter of each piece.
const W16: u64 = 2;
const G16: u64 = 2;
const G32: u64 = 4;
const OPTIMIZER: u64 = 12;

/// What is moved to host memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Offload {
    /// fp32 master weights and moments (the update runs on the CPU). Implies `gradients`: the
    /// CPU optimizer reads the fp32 gradients where it runs.
    pub optimizer: bool,
    /// The fp32 gradients, streamed to the host as each micro-batch's are reduced.
    pub gradients: bool,
    /// The 16-bit weights (stage 3 only), fetched a module at a time.
    pub parameters: bool,
}

/// The most data-parallel ranks planned (one host's bytes for all of them stay in 64 bits).
pub(crate) const MAX_RANKS: u64 = 1 << 16;

/// The offload targets `--offload` accepts.
pub(crate) const TARGETS: [&str; 4] = ["optimizer", "gradients", "parameters", "none"];

/// Bad ZeRO settings.
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum PlacementError {
    #[error("--ranks 0: at least one rank")]
    /// `--ranks 0`.
    NoRanks,
    #[error("--ranks {0}: at most {MAX_RANKS}")]
    /// More ranks than any one plan needs (the host's bytes would overflow).
    TooManyRanks(u64),
    #[error("--zero {0}: stages are 0, 1, 2 and 3")]
    /// A stage other than 0–3.
    Stage(u8),
    #[error("--offload {0}: unknown target; targets: {targets}", targets = TARGETS.join(", "))]
    /// An unknown offload target.
    Target(String),
    #[error("--offload {0}: a target named twice")]
    /// A target given twice.
    Twice(String),
    #[error("--offload '{0}': an empty target; give targets separated by commas, or none")]
    /// An empty list or an empty item.
    Empty(String),
    #[error("--offload parameters needs --zero 3 (only stage 3 partitions the weights)")]
    /// Offloading parameters below stage 3.
    ParametersBelowStage3,
}

impl Offload {
    /// Parses a comma-separated list of targets (`optimizer,parameters`, or `none`).
    pub fn parse(text: &str) -> Result<Offload, PlacementError> {
        let mut o = Offload::default();
        let mut seen: Vec<&str> = Vec::new();
        for t in text.split(',').map(str::trim) {
            if seen.contains(&t) {
                return Err(PlacementError::Twice(t.to_string()));
            }
            seen.push(t);
            match t {
                "optimizer" => o.optimizer = true,
                "gradients" => o.gradients = true,
                "parameters" => o.parameters = true,
                "none" => {}
                "" => return Err(PlacementError::Empty(text.to_string())),
                other => return Err(PlacementError::Target(other.to_string())),
            }
        }
        o.gradients |= o.optimizer;
        Ok(o)
    }
}

/// A ZeRO configuration: stage, data-parallel ranks on one host, offload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Placement {
    /// 0 (none) to 3 (weights partitioned too).
    pub stage: u8,
    /// Data-parallel ranks.
    pub ranks: u64,
    /// What lives in host memory.
    pub offload: Offload,
}

impl Placement {
    /// A configuration, refused when the stage, ranks or offload do not go together.
    pub fn new(stage: u8, ranks: u64, offload: Offload) -> Result<Placement, PlacementError> {
        if ranks == 0 {
            return Err(PlacementError::NoRanks);
        }
        if ranks > MAX_RANKS {
            return Err(PlacementError::TooManyRanks(ranks));
        }
        if stage > 3 {
            return Err(PlacementError::Stage(stage));
        }
        if offload.parameters && stage < 3 {
            return Err(PlacementError::ParametersBelowStage3);
        }
        Ok(Placement {
            stage,
            ranks,
            offload,
        })
    }

    /// The ranks a partitioned piece is split over at this stage.
    fn split(&self, from_stage: u8) -> u64 {
        if self.stage >= from_stage {
            self.ranks
        } else {
            1
        }
    }
}

/// One piece of the model states: bytes on each rank's device and on the host (all ranks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Placed {
    /// Bytes on each rank's device.
    pub device: u64,
    /// Bytes in host memory, all ranks together.
    pub host: u64,
}

impl Placed {
    /// `per_rank` bytes on each rank, on the host when `offloaded`.
    fn of(per_rank: u64, ranks: u64, offloaded: bool) -> Placed {
        if offloaded {
            Placed {
                device: 0,
                host: per_rank * ranks,
            }
        } else {
            Placed {
                device: per_rank,
                host: 0,
            }
        }
    }
}

/// The model states of one configuration, piece by piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ModelStates {
    /// The frozen base's weights at their dtype (LoRA); zero in a full fine-tune.
    pub frozen: Placed,
    /// 16-bit weights of the trained parameters.
    pub weights16: Placed,
    /// 16-bit gradients.
    pub gradients16: Placed,
    /// fp32 gradients.
    pub gradients32: Placed,
    /// fp32 master weights and AdamW's moments.
    pub optimizer: Placed,
    /// On each device: the largest module's gathered weights and gradients (stage 3).
    pub gathered: u64,
}

impl ModelStates {
    /// Bytes on each rank's device.
    pub fn device(&self) -> u64 {
        self.frozen.device
            + self.weights16.device
            + self.gradients16.device
            + self.gradients32.device
            + self.optimizer.device
            + self.gathered
    }

    /// Bytes in host memory, all ranks together.
    pub fn host(&self) -> u64 {
        self.frozen.host
            + self.weights16.host
            + self.gradients16.host
            + self.gradients32.host
            + self.optimizer.host
    }
}

/// What the model states are made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub(crate) struct Weights {
    /// Parameters AdamW trains: all of them in a full fine-tune, the adapters under LoRA.
    pub trained: u64,
    /// Bytes of the frozen weights (the base under LoRA, at its dtype); 0 in a full fine-tune.
    pub frozen_bytes: u64,
    /// Bytes stage 3 gathers on each device at once: the largest module's weights, and its
    /// gradients when it is trained.
    pub gathered: u64,
}

impl Weights {
    /// A full fine-tune of `params` parameters whose largest module has `largest`: its 16-bit
    /// weights and gradients are gathered (4 bytes per parameter).
    pub(crate) fn full(params: u64, largest: u64) -> Weights {
        Weights {
            trained: params,
            frozen_bytes: 0,
            gathered: (W16 + G16) * largest,
        }
    }
}

/// Model states of `weights` under `z`.
pub(crate) fn model_states(weights: &Weights, z: &Placement) -> ModelStates {
    let w = z.ranks;
    let stage3 = z.stage == 3;
    let params = weights.trained;
    let frozen = Placed::of(
        weights.frozen_bytes.div_ceil(z.split(3)),
        w,
        z.offload.parameters,
    );
    let weights16 = Placed::of(W16 * params.div_ceil(z.split(3)), w, z.offload.parameters);
    // Stage 3 keeps 16-bit gradients for the module in flight only (in `gathered`); below it
    // they are whole on the device unless streamed to the host as they are reduced.
    let gradients16 = if stage3 || z.offload.gradients {
        Placed::default()
    } else {
        Placed::of(G16 * params, w, false)
    };
    let gradients32 = Placed::of(G32 * params.div_ceil(z.split(1)), w, z.offload.gradients);
    let optimizer = Placed::of(
        OPTIMIZER * params.div_ceil(z.split(1)),
        w,
        z.offload.optimizer,
    );
    ModelStates {
        frozen,
        weights16,
        gradients16,
        gradients32,
        optimizer,
        gathered: if stage3 { weights.gathered } else { 0 },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// DeepSpeed's estimates for Llama-3-8B (8,030,261,248 parameters, largest module the
    /// 525,336,576-parameter embedding), one host, evaluated from its
    /// `estimate_zero2_model_states_mem_needs` and `estimate_zero3_model_states_mem_needs`
    /// (zero_init, additional_buffer_factor 1.5): (GPUs, offload, CPU bytes, GPU bytes).
    const ZERO2: [(u64, bool, u64, u64); 4] = [
        (1, false, 48_181_567_488, 160_605_224_960),
        (1, true, 192_726_269_952, 16_060_522_496),
        (8, false, 385_452_539_904, 48_181_567_488),
        (8, true, 385_452_539_904, 16_060_522_496),
    ];
    /// (GPUs, offload optimizer, offload params, CPU bytes, GPU bytes).
    const ZERO3: [(u64, bool, bool, u64, u64); 6] = [
        (1, false, false, 3_152_019_456, 146_646_048_768),
        (1, true, false, 192_726_269_952, 18_161_868_800),
        (1, true, true, 216_817_053_696, 2_101_346_304),
        (8, false, false, 25_216_155_648, 20_169_434_112),
        (8, true, false, 192_726_269_952, 4_108_911_616),
        (8, true, true, 216_817_053_696, 2_101_346_304),
    ];
    const P: u64 = 8_030_261_248;
    const LARGEST: u64 = 525_336_576;

    fn offload(optimizer: bool, parameters: bool) -> Offload {
        Offload {
            optimizer,
            gradients: optimizer,
            parameters,
        }
    }

    #[test]
    fn device_bytes_match_deepspeed_for_one_and_eight_gpus() {
        for (w, off, _, gpu) in ZERO2 {
            for stage in [1, 2] {
                let z = Placement::new(stage, w, offload(off, false)).unwrap();
                assert_eq!(
                    model_states(&Weights::full(P, LARGEST), &z).device(),
                    gpu,
                    "zero{stage} w={w}"
                );
            }
        }
        for (w, opt, par, _, gpu) in ZERO3 {
            let z = Placement::new(3, w, offload(opt, par)).unwrap();
            assert_eq!(
                model_states(&Weights::full(P, LARGEST), &z).device(),
                gpu,
                "zero3 w={w}"
            );
        }
    }

    /// DeepSpeed's host figure with offload is the states on the host times its buffer factor
    /// 1.5; for ZeRO-2 at 8 GPUs it is instead each process's fp32 load of the whole model
    /// (4·8·P), larger than the 16·P held afterwards. Without offload its host figure is a
    /// loading buffer (no state lives there), so only the offload rows compare.
    #[test]
    fn host_bytes_match_deepspeed_with_offload() {
        let ds = |host: u64, load: u64| host.max(load) * 3 / 2;
        for (w, off, cpu, _) in ZERO2.into_iter().filter(|r| r.1) {
            let z = Placement::new(2, w, offload(off, false)).unwrap();
            let host = model_states(&Weights::full(P, LARGEST), &z).host();
            assert_eq!(host, 16 * P);
            assert_eq!(ds(host, 4 * w * P), cpu, "w={w}");
        }
        for (w, opt, par, cpu, _) in ZERO3.into_iter().filter(|r| r.1) {
            let z = Placement::new(3, w, offload(opt, par)).unwrap();
            assert_eq!(
                ds(model_states(&Weights::full(P, LARGEST), &z).host(), 0),
                cpu,
                "w={w}"
            );
        }
    }

    #[test]
    fn bad_settings_are_refused() {
        assert_eq!(
            Placement::new(0, 0, Offload::default()),
            Err(PlacementError::NoRanks)
        );
        assert_eq!(
            Placement::new(4, 1, Offload::default()),
            Err(PlacementError::Stage(4))
        );
        assert_eq!(
            Placement::new(2, 1, offload(true, true)),
            Err(PlacementError::ParametersBelowStage3)
        );
        assert_eq!(
            Offload::parse("optimizer,disk").unwrap_err().to_string(),
            "--offload disk: unknown target; targets: optimizer, gradients, parameters, none"
        );
        assert_eq!(
            Offload::parse("optimizer,optimizer"),
            Err(PlacementError::Twice("optimizer".into()))
        );
        assert_eq!(Offload::parse(""), Err(PlacementError::Empty("".into())));
        assert_eq!(
            Placement::new(0, MAX_RANKS + 1, Offload::default()),
            Err(PlacementError::TooManyRanks(MAX_RANKS + 1))
        );
        let o = Offload::parse("optimizer").unwrap();
        assert!(
            o.gradients,
            "the CPU optimizer reads the gradients on the host"
        );
    }

    #[test]
    fn stage_zero_keeps_everything_on_every_rank() {
        let z = Placement::new(0, 8, Offload::default()).unwrap();
        let s = model_states(&Weights::full(P, LARGEST), &z);
        assert_eq!(s.device(), 20 * P);
        let grads_only = Placement::new(1, 8, offload(false, false)).unwrap();
        let g = Placement {
            offload: Offload {
                gradients: true,
                ..Offload::default()
            },
            ..grads_only
        };
        let s = model_states(&Weights::full(P, LARGEST), &g);
        assert_eq!(s.device(), 2 * P + 12 * P / 8);
        assert_eq!(s.host(), 4 * P);
    }
}
