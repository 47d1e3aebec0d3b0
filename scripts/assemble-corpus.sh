#!/usr/bin/env bash
# Rebuilds assets/corpus.txt, the text the `text-bpe` preset trains on: the project's own prose
# and code (README, docs/, then its Rust sources whole), so the preset needs no download. The
# sources are there for size: prose alone (~100 KB) supports only a ~5k-token BPE, not 8192.
# The committed copy is fixed; rerun this only to refresh it on purpose (the BPE cache key is the
# file's hash, so a new corpus trains a new tokenizer).
set -euo pipefail
cd "$(dirname "$0")/.."
{
    cat README.md
    for f in docs/*.md; do [ -e "$f" ] && [ "$f" != docs/TOKENIZER.md ] && cat "$f"; done
    git ls-files 'crates/*.rs' 'src/*.rs' | sort | while read -r f; do
        cat "$f"
    done
} > assets/corpus.txt
wc -c assets/corpus.txt
