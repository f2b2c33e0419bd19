"""The kv8b model preset has Llama-3.1-8B's KV bytes per token at the dtype the CPU engine runs (fp32).

Why: benchmark ratios at the tiny model's 1 MiB chunks are dominated by per-chunk costs; kv8b exists so they
are measured at a real model's 32 MiB chunks. No engine is started here (the geometry is in the config)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.devstack import tiny_model
from kvtier.devstack.tiny_model import PRESETS, kv_bytes_per_token, llama_config, preset_model

pytestmark = pytest.mark.unit

LLAMA_31_8B = {"num_hidden_layers": 32, "num_key_value_heads": 8, "num_attention_heads": 32, "hidden_size": 4096,
               "torch_dtype": "bfloat16"}


def test_kv_bytes_formula_matches_llama_8b() -> None:
    assert kv_bytes_per_token(LLAMA_31_8B) == 131_072


def test_preset_configs_kv_bytes() -> None:
    def kv(name: str) -> int:
        return kv_bytes_per_token(llama_config(**PRESETS[name]).to_dict())

    assert PRESETS["kv8b"]["dtype"] == "float32"  # what vLLM's CPU backend runs
    assert kv("kv8b") == kv_bytes_per_token(LLAMA_31_8B) == 131_072
    assert kv("tiny") == 4096


def test_built_kv8b_dir_loads_its_config(tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    out = preset_model(tmp_path, "kv8b")
    assert out == tmp_path / "models" / "kv8b-llama"
    cfg = AutoConfig.from_pretrained(str(out))
    assert kv_bytes_per_token(cfg.to_dict()) == 131_072
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads) == (16, 8, 128)
    assert len(AutoTokenizer.from_pretrained(str(out))) == cfg.vocab_size
    # the weights on disk have that geometry too (K projection: kv_heads * head_dim rows, fp32)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        k = f.get_slice("model.layers.15.self_attn.k_proj.weight")
        assert k.get_shape() == [8 * 128, 1024] and k.get_dtype() == "F32"
    assert json.loads((out / "kvtier-tiny.json").read_text())["layers"] == 16
    # a second call reuses the built directory instead of rebuilding
    mtime = (out / "config.json").stat().st_mtime_ns
    assert preset_model(tmp_path, "kv8b") == out and (out / "config.json").stat().st_mtime_ns == mtime


def test_unknown_preset_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown model preset"):
        preset_model(tmp_path, "kv70b")
    assert not (tmp_path / "models").exists()


def test_cli_kv8b_defaults_are_the_preset(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    seen: dict[str, object] = {}
    monkeypatch.setattr(tiny_model, "build", lambda out, **kw: seen.update(kw) or out)
    assert tiny_model.main(["kv8b", "--out", str(tmp_path / "m")]) == 0
    assert {k: seen[k] for k in PRESETS["kv8b"]} == PRESETS["kv8b"]
    assert tiny_model.main(["kv8b", "--out", str(tmp_path / "m"), "--layers", "8"]) == 0
    assert seen["layers"] == 8


@pytest.mark.parametrize("extra", [["--from-up", "up.json"], ["--model", "/m"],
                                   ["--replica-a", "http://127.0.0.1:9", "--replica-b", "http://127.0.0.1:9"]])
def test_bench_model_preset_only_for_a_stack_started_here(extra: list[str], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.bench import cross_pod

    assert cross_pod.main(["--model-preset", "kv8b", "--dir", str(tmp_path), *extra]) == 2
    assert "--model-preset" in capsys.readouterr().err
    assert not (tmp_path / "models").exists()  # rejected before any build
