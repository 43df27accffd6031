"""facebook/opt-125m's public config.json, and two ways to hand it to vLLM with no Hugging Face hub.

vLLM reads a model's config, never its weights or tokenizer, to build a
scheduler. vLLM's own tests name ``facebook/opt-125m``, which resolves through
an offline hub cache (:func:`offline_hf_cache`); kvfsm's engine passes a local
folder instead (:func:`model_dir`). No vLLM import here.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

OPT_125M_CONFIG = {
    "_name_or_path": "facebook/opt-125m", "activation_dropout": 0.0, "activation_function": "relu",
    "architectures": ["OPTForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 2, "do_layer_norm_before": True,
    "dropout": 0.1, "enable_bias": True, "eos_token_id": 2, "ffn_dim": 3072, "hidden_size": 768, "init_std": 0.02,
    "layer_norm_elementwise_affine": True, "layerdrop": 0.0, "max_position_embeddings": 2048, "model_type": "opt",
    "num_attention_heads": 12, "num_hidden_layers": 12, "pad_token_id": 1, "prefix": "</s>", "torch_dtype": "float16",
    "transformers_version": "4.21.0.dev0", "use_cache": True, "vocab_size": 50272, "word_embed_proj_dim": 768,
}  # fmt: skip


def model_dir() -> Path:
    """A local model folder holding only config.json: ``ModelConfig(model=str(model_dir()))``."""
    path = Path(tempfile.gettempdir()) / "kvfsm-opt-125m-config"
    path.mkdir(exist_ok=True)
    config = path / "config.json"
    if not config.exists():
        config.write_text(json.dumps(OPT_125M_CONFIG))
    return path


def offline_hf_cache() -> Path:
    """A fresh ``HF_HOME`` whose hub cache has facebook/opt-125m's config and nothing else (use with ``HF_HUB_OFFLINE=1``)."""
    home = Path(tempfile.mkdtemp(prefix="kvfsm-hf-"))
    repo = home / "hub" / "models--facebook--opt-125m"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(OPT_125M_CONFIG))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    return home
