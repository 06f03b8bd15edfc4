"""Typed configuration shared by the library, the planner and the CLI.

Only the CLI touches Hydra/OmegaConf; it turns YAML into these dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ModelConfig:
    """Shape of a Llama-style GQA decoder."""

    vocab_size: int = 256
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 8
    n_kv_heads: int = 2
    ffn_dim: int = 384
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.dim % self.n_heads != 0:
            raise ValueError(
                f"model dim ({self.dim}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        d, f, hd = self.dim, self.ffn_dim, self.head_dim
        attn = d * self.n_heads * hd + 2 * d * self.n_kv_heads * hd + self.n_heads * hd * d
        mlp = 3 * d * f
        per_layer = attn + mlp + 2 * d
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return self.n_layers * per_layer + emb + d
