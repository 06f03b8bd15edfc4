"""Tiny transformers decoders (Llama, Qwen2, Mistral) and the batch shape the Hugging Face
tests use (``unit/test_hf.py``, ``distributed/test_hf_ranks.py``)."""

import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

L, ROWS, V = 32, 4, 128
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=V, max_position_embeddings=256, use_cache=False)


def tiny_model(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**TINY))
    if kind == "qwen2":  # layer 0 full attention, layer 1 a window of 6
        return Qwen2ForCausalLM(Qwen2Config(**TINY, use_sliding_window=True, sliding_window=6,
                                            max_window_layers=1))
    return MistralForCausalLM(MistralConfig(**TINY, sliding_window=5))
