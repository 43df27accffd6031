"""A 2-layer Llama with random weights and a locally trained byte-level BPE tokenizer: a real model for a real
vLLM engine on a CPU-only machine with no model hub (1.5 MB on disk, made in about a second).

The weights are random, so the text is nonsense, but the engine runs every
kernel a served model does: greedy tokens depend on every byte of the KV
cache, which is what a connector's test must compare. vLLM's CPU attention
needs a head size of at least 32 and a block size that is a multiple of 32.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "the prefill engine computes the prompt and the decode engine generates the answer",
    "a connector moves the key and value cache between engines, tiers and processes",
    "blocks are pinned, loaded, stored and freed; every path out of a state releases what it holds",
    "requests are aborted, expired and retried; a block freed twice or never is a bug",
    "kvfsm declares the lifecycle of every request as a checked state machine",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()[]{}-_/",
]
"""What the tokenizer is trained on: enough for a vocabulary of a few hundred tokens."""

VOCAB_SIZE = 327


def make_tiny_model(path: str | Path, *, seed: int = 0, layers: int = 2) -> Path:
    """Write the model (config, safetensors weights, tokenizer) into ``path``; returns it.

    The same ``seed`` writes the same bytes, so two processes that each make
    the model serve identical weights.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")  # type: ignore[no-untyped-call]
    fast.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=2048,
        bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id("</s>"),
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    with torch.no_grad():  # a wider spread than the init's 0.02, so greedy tokens depend on every input
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    (path / "kvfsm-tiny-model.json").write_text(json.dumps({"seed": seed, "layers": layers}) + "\n")
    return path
