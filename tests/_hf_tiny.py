"""Tiny transformers decoders (Llama, Qwen2, Mistral, Qwen3, gpt-oss) and the batch shape the
Hugging Face tests use (``unit/test_hf.py``, ``distributed/test_hf_ranks.py``)."""

import torch
from transformers import (GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

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
    if kind == "gpt_oss":  # sinks (s_aux), a window of 6 on layer 0, 4 experts, top 2
        model = GptOssForCausalLM(GptOssConfig(**TINY, head_dim=16, sliding_window=6,
                                               num_local_experts=4, num_experts_per_tok=2))
        with torch.no_grad():  # sinks of the order of the scores, so that they matter
            for layer in model.model.layers:
                layer.self_attn.sinks.normal_(0.0, 2.0)
        return model
    if kind == "qwen3":  # q/k norms, head_dim 24 (not 64 / 4), layer 1 a window of 6
        return Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=24, use_sliding_window=True,
                                            sliding_window=6, max_window_layers=1))
    return MistralForCausalLM(MistralConfig(**TINY, sliding_window=5))
