"""Make the tiny model `make test-engine` serves with vLLM's CPU build: a Qwen2 causal LM of
random weights (seeded, so the same folder every time) over the repository's Qwen2.5
tokenizer, saved with that tokenizer and its generation_config.json. Nothing is downloaded.

Run with the engine venv's Python (it has torch): ``python make_model.py DEST [--layers N]``.
Hidden size 128, 2 layers (`tiny-qwen2`, the default), 4 attention heads of 32 (vLLM's CPU
attention takes head sizes 32, 64, 80, ...), 2 KV heads: about 80 MB. `--layers 8` makes
`tiny-qwen2-8l`, the hidden-state extraction's model (vLLM's default EAGLE-3 layer ids
[2, N//2, N-3, N] are distinct only from N = 7 on), the same otherwise.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

SEED = 1234
TOKENIZER = Path(__file__).resolve().parents[1] / "fixtures" / "tokenizers" / "qwen2.5-instruct"


def make(dest: Path, layers: int = 2) -> Path:
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER), local_files_only=True)
    vocab = -(-len(tok) // 64) * 64  # an embedding table padded as Qwen's (151665 -> 151680)
    torch.manual_seed(SEED)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096, tie_word_embeddings=True,
                      bos_token_id=151643, eos_token_id=[151645, 151643])
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    shutil.copy(TOKENIZER / "generation_config.json", tmp / "generation_config.json")
    tmp.rename(dest)
    return dest


if __name__ == "__main__":
    args = sys.argv[1:]
    n_layers = 2
    if "--layers" in args:
        i = args.index("--layers")
        n_layers = int(args[i + 1])
        del args[i:i + 2]
    out = Path(args[0])
    if not (out / "config.json").exists():
        make(out, n_layers)
    print(out)
