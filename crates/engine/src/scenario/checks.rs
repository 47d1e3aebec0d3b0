//! The checks serde cannot express, each naming the key it concerns.

use super::*;

/// Data parallel's timeout (a collective must be given some time) and ZeRO stage.
pub(super) fn check_comm_timeout(t: &TrainConfig) -> Result<(), Invalid> {
    if t.ranks == 0 || t.ranks > crate::limits::MAX_RANKS {
        return Err(Invalid::new(
            "train.ranks",
            format!(
                "train.ranks ({}) must be from 1 to {}",
                t.ranks,
                crate::limits::MAX_RANKS
            ),
        ));
    }
    if t.zero > 2 {
        return Err(Invalid::new(
            "train.zero",
            format!(
                "train.zero ({}) must be 0, 1 or 2 (stage 3 is in `gaccwb estimate --zero 3`, \
                 not in training)",
                t.zero
            ),
        ));
    }
    if t.comm_timeout.is_finite() && t.comm_timeout > 0.0 {
        return Ok(());
    }
    Err(Invalid::new(
        "train.comm_timeout",
        format!(
            "train.comm_timeout ({}) must be a positive number of seconds, e.g. 60",
            t.comm_timeout
        ),
    ))
}

/// The noise scale's and the adaptive policy's keys.
pub(super) fn check_noise(t: &TrainConfig) -> Result<(), Invalid> {
    if !(0.0..1.0).contains(&t.noise_ema) {
        return Err(Invalid::new(
            "train.noise_ema",
            format!(
                "train.noise_ema ({}) must be in [0, 1), e.g. 0.95",
                t.noise_ema
            ),
        ));
    }
    if t.accum_min < 2 {
        return Err(Invalid::new(
            "train.accum_min",
            format!(
                "train.accum_min ({}) must be at least 2: the noise scale needs K ≥ 2",
                t.accum_min
            ),
        ));
    }
    if t.accum_max < t.accum_min {
        return Err(Invalid::new(
            "train.accum_max",
            format!(
                "train.accum_max ({}) must be at least train.accum_min ({})",
                t.accum_max, t.accum_min
            ),
        ));
    }
    if t.accum_patience == 0 {
        return Err(Invalid::new(
            "train.accum_patience",
            "train.accum_patience must be at least 1 window".into(),
        ));
    }
    if t.accum_policy == AccumPolicy::NoiseScale && !t.noise {
        return Err(Invalid::new(
            "train.accum_policy",
            "train.accum_policy = \"noise-scale\" needs train.noise = true".into(),
        ));
    }
    Ok(())
}

/// Every knob's preset value within the knob's bounds (`knob::Values`).
pub(super) fn check_knobs(t: &TrainConfig) -> Result<(), Invalid> {
    let values = serde_json::to_value(t).map_err(|e| Invalid::new("train", e.to_string()))?;
    for knob in KNOBS {
        let value = values.get(knob.key).filter(|v| !v.is_null());
        knob.check(value).map_err(|bound| {
            let key = format!("train.{}", knob.key);
            Invalid::new(&key, format!("{key} {bound}"))
        })?;
    }
    Ok(())
}

/// LoRA's settings: the adapters' scale must be finite, and dropout a probability below 1.
pub(super) fn check_lora(t: &TrainConfig) -> Result<(), Invalid> {
    if t.lora_rank > 0 && !t.lora_alpha.is_finite() {
        return Err(Invalid::new(
            "train.lora_alpha",
            format!(
                "train.lora_alpha ({}) must be a finite number",
                t.lora_alpha
            ),
        ));
    }
    if !(0.0..1.0).contains(&t.lora_dropout) {
        return Err(Invalid::new(
            "train.lora_dropout",
            format!(
                "train.lora_dropout ({}) must be at least 0 and below 1 (0.05 or 0.1 are usual)",
                t.lora_dropout
            ),
        ));
    }
    Ok(())
}

/// Value checks shared by presets, the command line and hotkeys: a knob's value within the
/// bounds its row in the knob table gives, and a positive loss scale.
pub fn validate_control(c: &Control) -> Result<(), ControlError> {
    if let Some(knob) = c.knob() {
        return knob
            .check(c.value().as_ref())
            .map_err(|bound| ControlError::Bounds {
                what: knob.what,
                bound,
            });
    }
    match c {
        Control::SetLossScale { value } if !positive(*value) => Err(ControlError::LossScale),
        _ => Ok(()),
    }
}

pub(super) fn positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

/// Largest BPE vocabulary accepted: Llama 3's is 128,256.
pub(super) const MAX_BPE_VOCAB: usize = 1 << 18;

/// A BPE needs text, and a trained one more tokens than the 256 bytes it starts from.
pub(super) fn check_bpe(d: &DataConfig) -> Result<(), Invalid> {
    if d.source == DataSource::Synthetic {
        return Err(Invalid::new(
            "data.tokenizer",
            "data.tokenizer = \"bpe\" needs text: set data.source = \"file\" (--data FILE) or \"docs\""
                .into(),
        ));
    }
    if d.tokenizer_file.is_none() && !(257..=MAX_BPE_VOCAB).contains(&d.vocab) {
        return Err(Invalid::new(
            "data.vocab",
            format!(
                "data.vocab ({}) must be between 257 and {MAX_BPE_VOCAB}: a byte-level BPE starts from the 256 bytes",
                d.vocab
            ),
        ));
    }
    Ok(())
}
