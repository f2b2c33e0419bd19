"""A tiny random-init Llama plus a locally trained tokenizer, built offline.

Why: tests, benchmarks and the demo need a real Hugging Face model directory that vLLM can load, with no
download. The weights are seeded, so every build gives the same model (and the same greedy outputs).
Any Hugging Face model path works in its place.

    kvtier model tiny --out DIR [--hidden 256 --layers 4 --heads 4 --kv-heads 2 --vocab 8000]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_SPECIALS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]


def _corpus(seed: int, n_lines: int = 4000) -> list[str]:
    """Generated pseudo-text: a fixed syllable vocabulary glued into words, digits and punctuation."""
    rng = random.Random(seed)
    syll = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "da", "ve", "qu", "ix", "zo", "be", "fa",
            "gle", "th", "or", "an", "el", "st", "ing", "er", "ed", "ch", "wa", "yo", "um", "pr", "cl"]
    words = ["".join(rng.choice(syll) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    words += ["the", "a", "of", "and", "to", "in", "is", "cache", "token", "model", "prefix", "node"]
    lines = []
    for _ in range(n_lines):
        ws = [rng.choice(words) for _ in range(rng.randint(5, 25))]
        if rng.random() < 0.3:
            ws.insert(rng.randrange(len(ws)), str(rng.randint(0, 99999)))
        line = " ".join(ws)
        lines.append(line[0].upper() + line[1:] + rng.choice([".", ".", "?", "!", ","]))
    return lines


def build_tokenizer(out: Path, vocab: int, seed: int) -> None:
    """Train a byte-level BPE tokenizer on generated text and save it as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=_SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


def build(out: Path, *, hidden: int = 256, layers: int = 4, heads: int = 4, kv_heads: int = 2,
          intermediate: int = 688, vocab: int = 8000, max_pos: int = 8192, seed: int = 0,
          dtype: str = "float32") -> Path:
    """Write a seeded random-init LlamaConfig model (safetensors) plus tokenizer into `out`.

    Built into a temporary sibling directory and renamed, so a crashed build never leaves a half model
    that looks complete (tests check for config.json).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out)
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}) and heads by kv_heads ({kv_heads})")
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build_tokenizer(tmp, vocab, seed)
    from transformers import AutoTokenizer

    real_vocab = len(AutoTokenizer.from_pretrained(str(tmp)))
    cfg = LlamaConfig(
        vocab_size=real_vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=3, torch_dtype=dtype,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(getattr(torch, dtype))
    model.generation_config.bos_token_id = 1
    model.generation_config.eos_token_id = 2
    model.save_pretrained(str(tmp), safe_serialization=True)
    (tmp / "kvtier-tiny.json").write_text(json.dumps(
        {"seed": seed, "hidden": hidden, "layers": layers, "heads": heads, "kv_heads": kv_heads,
         "vocab": real_vocab, "max_pos": max_pos, "dtype": dtype}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvtier model", description="build a local test model (no download)")
    sub = p.add_subparsers(dest="kind", required=True)
    t = sub.add_parser("tiny", help="seeded random-init Llama + locally trained BPE tokenizer")
    t.add_argument("--out", required=True, type=Path)
    t.add_argument("--hidden", type=int, default=256)
    t.add_argument("--layers", type=int, default=4)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--kv-heads", type=int, default=2)
    t.add_argument("--intermediate", type=int, default=688)
    t.add_argument("--vocab", type=int, default=8000)
    t.add_argument("--max-pos", type=int, default=8192)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a = p.parse_args(argv)
    try:
        out = build(a.out, hidden=a.hidden, layers=a.layers, heads=a.heads, kv_heads=a.kv_heads,
                    intermediate=a.intermediate, vocab=a.vocab, max_pos=a.max_pos, seed=a.seed, dtype=a.dtype)
    except ValueError as e:
        print(f"kvtier model: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
