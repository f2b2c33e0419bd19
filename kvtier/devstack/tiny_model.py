"""A tiny random-init Llama plus a locally trained tokenizer, built offline.

Why: tests, benchmarks and the demo need a real Hugging Face model directory that vLLM can load, with no
download. The weights are seeded, so every build gives the same model (and the same greedy outputs).
Any Hugging Face model path works in its place.

    kvtier model tiny --out DIR [--hidden 256 --layers 4 --heads 4 --kv-heads 2 --vocab 8000]
    kvtier model kv8b --out DIR   # Llama-3.1-8B's KV bytes per token (128 KiB) at fp32; same override flags

Presets (`PRESETS`): `tiny` (4 KiB of KV per token, 1 MiB LMCache chunks) keeps tests fast; `kv8b` has the
KV geometry a real 8B model has per token, so benchmarks see realistic chunk sizes (32 MiB per 256 tokens):
Llama-3.1-8B is 32 layers x 8 KV heads x 128 head dim x 2 (K, V) x 2 B (bf16) = 131,072 B/token; the CPU
engine runs fp32, so kv8b halves the layers: 16 x 8 x 128 x 2 x 4 B = 131,072 B/token. Hidden 1024 = 8 heads
x 128 (no GQA, so the attention work per token is 16x tiny's); the MLP and vocab stay small (prefill time
is what the benchmarks pay, not what they measure).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Per-preset LlamaConfig geometry (build()'s keyword arguments); explicit CLI flags override them.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {"hidden": 256, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate": 688, "vocab": 8000,
             "max_pos": 8192, "dtype": "float32"},
    "kv8b": {"hidden": 1024, "layers": 16, "heads": 8, "kv_heads": 8, "intermediate": 2048, "vocab": 8000,
             "max_pos": 32768, "dtype": "float32"},
}
# Directory name under <base>/models for each preset ("tiny-llama" is what `kvtier up` has always used).
PRESET_DIRS = {"tiny": "tiny-llama", "kv8b": "kv8b-llama"}
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(config: dict[str, Any]) -> int:
    """KV cache bytes per token of a HF config dict, computed as LMCache/vLLM size it:
    layers x KV heads x head dim x 2 (K and V) x dtype size."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    return config["num_hidden_layers"] * kv_heads * head_dim * 2 * _DTYPE_BYTES[str(dtype).removeprefix("torch.")]


def preset_model(base: Path, preset: str) -> Path:
    """<base>/models/<preset dir>, built on first use (no download)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r} (one of {', '.join(PRESETS)})")
    out = Path(base) / "models" / PRESET_DIRS[preset]
    if not (out / "config.json").exists():
        print(f"building the {preset} local model under {out} (first run only)", file=sys.stderr)
        build(out, **PRESETS[preset])
    return out


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


def llama_config(*, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int,
                 max_pos: int, dtype: str) -> Any:
    """The LlamaConfig build() saves (separate so a preset's geometry is checkable without building weights)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
        pad_token_id=3, torch_dtype=dtype,
    )


def build(out: Path, *, hidden: int = 256, layers: int = 4, heads: int = 4, kv_heads: int = 2,
          intermediate: int = 688, vocab: int = 8000, max_pos: int = 8192, seed: int = 0,
          dtype: str = "float32") -> Path:
    """Write a seeded random-init LlamaConfig model (safetensors) plus tokenizer into `out`.

    Built into a temporary sibling directory and renamed, so a crashed build never leaves a half model
    that looks complete (tests check for config.json).
    """
    import torch
    from transformers import LlamaForCausalLM

    out = Path(out)
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden ({hidden}) must divide by heads ({heads}) and heads by kv_heads ({kv_heads})")
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    build_tokenizer(tmp, vocab, seed)
    from transformers import AutoTokenizer

    real_vocab = len(AutoTokenizer.from_pretrained(str(tmp)))
    cfg = llama_config(hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, intermediate=intermediate,
                       vocab=real_vocab, max_pos=max_pos, dtype=dtype)
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
    helps = {"tiny": "seeded random-init Llama + locally trained BPE tokenizer (4 KiB KV/token)",
             "kv8b": "as tiny, with Llama-3.1-8B's KV bytes per token (128 KiB at fp32: 16 layers x 8 x 128)"}
    for name, geo in PRESETS.items():
        t = sub.add_parser(name, help=helps[name])
        t.add_argument("--out", required=True, type=Path)
        for flag in ("hidden", "layers", "heads", "kv-heads", "intermediate", "vocab", "max-pos"):
            t.add_argument(f"--{flag}", type=int, default=geo[flag.replace("-", "_")])
        t.add_argument("--seed", type=int, default=0)
        t.add_argument("--dtype", default=geo["dtype"], choices=list(_DTYPE_BYTES))
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
