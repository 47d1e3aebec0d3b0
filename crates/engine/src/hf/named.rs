//! The published shapes `--shape` accepts: GPT-2 and GPT-3 175B (tied heads, trained with
//! dropout) and the Llama-family models whose `config.json` they copy.

use super::Arch;
use crate::scenario::ModelConfig;

/// (name, d_model, layers, heads, context) of the GPT shapes; their vocabulary is 50257.
const GPT: [(&str, u64, u64, u64, u64); 5] = [
    ("gpt2", 768, 12, 12, 1024),
    ("gpt2-medium", 1024, 24, 16, 1024),
    ("gpt2-large", 1280, 36, 20, 1024),
    ("gpt2-xl", 1600, 48, 25, 1024),
    ("gpt3-175b", 12288, 96, 96, 2048),
];

/// (name, family, [vocab, hidden, layers, heads, kv_heads, intermediate, context]) of the
/// Llama-family shapes, from the models' published `config.json`.
const LLAMA: [(&str, &str, [u64; 7]); 3] = [
    ("llama3-8b", "llama", [128256, 4096, 32, 32, 8, 14336, 8192]),
    (
        "llama3-70b",
        "llama",
        [128256, 8192, 80, 64, 8, 28672, 8192],
    ),
    (
        "mistral-7b",
        "mistral",
        [32000, 4096, 32, 32, 8, 14336, 32768],
    ),
];

/// Every name `--shape` accepts.
pub fn shape_names() -> Vec<&'static str> {
    GPT.iter()
        .map(|s| s.0)
        .chain(LLAMA.iter().map(|s| s.0))
        .collect()
}

/// The published architecture of a named shape (GPT-2/3 with their tied head), or `None`.
pub fn named(name: &str) -> Option<Arch> {
    if let Some(&(_, d, l, h, t)) = GPT.iter().find(|s| s.0 == name) {
        let m = ModelConfig {
            vocab: 50257,
            d_model: d as usize,
            layers: l as usize,
            heads: h as usize,
            seq_len: t as usize,
            path: None,
            adapter: None,
        };
        let family = if name.starts_with("gpt3") {
            "gpt3"
        } else {
            "gpt2"
        };
        return Some(Arch {
            tied: true,
            dropout: true,
            family: family.into(),
            ..Arch::engine(&m)
        });
    }
    let &(_, family, sizes) = LLAMA.iter().find(|s| s.0 == name)?;
    Some(Arch::dense(family, sizes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_shapes_count_the_published_parameters() {
        // The published counts of the released checkpoints.
        let published = [
            ("gpt2", 124_439_808u64),
            ("gpt2-medium", 354_823_168),
            ("gpt2-large", 774_030_080),
            ("gpt2-xl", 1_557_611_200),
            ("llama3-8b", 8_030_261_248),
            ("llama3-70b", 70_553_706_496),
            ("mistral-7b", 7_241_732_096),
        ];
        for (name, count) in published {
            let arch = named(name).unwrap();
            assert_eq!(arch.param_count(), count, "{name}");
            assert_eq!(arch.active_params(), count, "dense: {name}");
        }
        assert!(named("gpt4").is_none());
    }

    #[test]
    fn largest_module_and_matmul_parameters() {
        let llama = named("llama3-8b").unwrap();
        assert_eq!(llama.largest_module_params(), 128256 * 4096);
        // Every layer matrix and the head: the total less the input embedding and the norms.
        let norms = (2 * 32 + 1) * 4096;
        assert_eq!(
            llama.matmul_params(),
            llama.param_count() - 128256 * 4096 - norms
        );
        let gpt3 = named("gpt3-175b").unwrap();
        // The embedding (V·h) is just larger than the MLP's 4h² + 4h at this width.
        assert_eq!(gpt3.largest_module_params(), 50257 * 12288);
        let gpt2 = named("gpt2").unwrap();
        assert_eq!(gpt2.largest_module_params(), 50257 * 768);
    }
}
