//! `gaccwb eval`: a model's perplexity on a text, as transformers reports it with
//! `labels = input_ids` (consecutive windows of `--seq-len` tokens; `model::perplexity`).

use std::path::PathBuf;

use clap::Args;

use gaccwb::control::Dtype;
use gaccwb::device::DeviceChoice;
use gaccwb::model::hf::{self, ModelDir};
use gaccwb::model::perplexity;

use super::usage;

#[derive(Args, Debug)]
pub struct EvalArgs {
    /// The model: a directory holding config.json, model.safetensors and tokenizer.json, or
    /// ORG/NAME[@REVISION] from the local Hugging Face cache.
    #[arg(long, value_name = "PATH")]
    model: String,
    /// The text: plain text, or JSON Lines with a `text` field (documents joined by the
    /// model's end-of-text token).
    #[arg(long, value_name = "FILE")]
    data: PathBuf,
    /// Tokens per window (default: 1024, or the model's positions when fewer).
    #[arg(long, value_name = "T")]
    seq_len: Option<usize>,
    /// The compute precision: f32, bf16 or f16.
    #[arg(long, default_value = "f32", value_parser = super::bench::parse_dtype)]
    dtype: Dtype,
    /// Windows per forward pass.
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=4096))]
    batch: u64,
    /// cpu, cuda, cuda:N or auto.
    #[arg(long, default_value = "auto")]
    device: DeviceChoice,
    /// A PEFT LoRA adapter of the model (adapter_config.json, adapter_model.safetensors):
    /// the perplexity of the adapted model.
    #[arg(long, value_name = "DIR")]
    adapter: Option<PathBuf>,
    /// Print {"tokens", "nll", "ppl"} as one JSON object.
    #[arg(long)]
    json: bool,
}

/// The window length when none is given: long enough to mean something, never the model's
/// whole context (often 131072).
const DEFAULT_SEQ_LEN: u64 = 1024;

pub fn eval(args: EvalArgs) -> anyhow::Result<()> {
    let dir = ModelDir::open(&hf::resolve(&args.model)?)?;
    let spec = dir.spec()?;
    let positions = spec.max_positions();
    let seq_len = args
        .seq_len
        .map_or(DEFAULT_SEQ_LEN.min(positions), |t| t as u64);
    if !(2..=positions).contains(&seq_len) {
        return Err(usage(format!(
            "--seq-len {seq_len}: must be from 2 to the model's {positions} positions"
        ))
        .into());
    }
    if let Some(window) = spec.sliding_window.filter(|&w| seq_len > w) {
        return Err(usage(format!(
            "--seq-len {seq_len} is longer than the model's sliding window ({window}); use at most {window}"
        ))
        .into());
    }
    let tokenizer = dir.tokenizer.clone().ok_or_else(|| {
        usage(format!(
            "{}: no tokenizer.json; eval cuts the text with the model's own tokenizer",
            dir.dir.display()
        ))
    })?;
    let ids = gaccwb::data::text_ids(&args.data, &tokenizer, spec.eos)?;
    if ids.iter().any(|&id| u64::from(id) >= spec.arch.vocab) {
        return Err(usage(format!(
            "{}: the tokenizer gives ids beyond the model's {} embeddings; use the model's own tokenizer.json",
            tokenizer.display(),
            spec.arch.vocab
        ))
        .into());
    }
    let device = args.device.open()?;
    let mut model = dir.load(seq_len as usize, &device, None, &mut |_, _| {})?;
    if let Some(adapter) = &args.adapter {
        let lora = gaccwb::model::read_adapter_config(adapter)?;
        model = model.adapt(&lora, 0, candle_core::DType::F32)?;
        model.load_adapter(adapter)?;
    }
    let p = perplexity(
        &model,
        &ids,
        seq_len as usize,
        args.batch as usize,
        args.dtype.candle(),
        &device,
    )?;
    let line = match args.json {
        true => serde_json::to_string(&p)?,
        false => format!(
            "{}{} ({}, {} parameters) on {}: {} predicted tokens in windows of {seq_len}, {}: \
             mean NLL {:.6} nats/token, perplexity {:.4}",
            dir.dir.display(),
            args.adapter.as_ref().map_or(String::new(), |a| format!(
                " with the adapter {}",
                a.display()
            )),
            spec.arch.family,
            model.param_count()
                + model
                    .frozen
                    .iter()
                    .map(|p| p.var.elem_count() as u64)
                    .sum::<u64>(),
            args.data.display(),
            p.tokens,
            args.dtype.name(),
            p.nll,
            p.ppl
        ),
    };
    gaccwb::out::println(&line)?;
    Ok(())
}
