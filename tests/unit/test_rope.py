"""RoPE frequency scaling (``usp/models/rope.py``, ``usp/config/rope.py``): the frequencies and
the attention factor of every trainable ``rope_type`` equal transformers' own
(``ROPE_INIT_FUNCTIONS``), the factor reaches the rotation tables, and bad settings are refused
with the fix. Logits through the transformers model: ``test_llama_hf.py``."""

import math

import pytest
import torch

from usp.config import ModelConfig
from usp.config.rope import check_rope_scaling, rope_parameters
from usp.models.rope import inverse_frequencies, rope_cos_sin

HEAD_DIM, THETA = 64, 500000.0
SCALINGS = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 2048,
     "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
     "mscale": 1.0, "mscale_all_dim": 0.5},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
     "attention_factor": 1.3},
]


def _transformers(scaling):
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = transformers.LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4,
                                   head_dim=HEAD_DIM, max_position_embeddings=32768,
                                   rope_parameters=rope_parameters(THETA, scaling))
    return ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s["rope_type"])
def test_frequencies_and_attention_factor_equal_transformers(scaling):
    want, want_factor = _transformers(scaling)
    got, factor = inverse_frequencies(HEAD_DIM, THETA, check_rope_scaling(scaling))
    assert got.dtype == torch.float64 and got.shape == (HEAD_DIM // 2,)
    torch.testing.assert_close(got.float(), want, rtol=2e-6, atol=0)
    assert math.isclose(factor, want_factor, rel_tol=1e-12)
    plain, _ = inverse_frequencies(HEAD_DIM, THETA)
    assert not torch.allclose(got, plain)  # the scaling changed something


def test_the_attention_factor_scales_cos_and_sin():
    yarn = check_rope_scaling(SCALINGS[-1])  # attention_factor 1.3
    no_factor = check_rope_scaling({k: v for k, v in SCALINGS[-1].items()
                                    if k != "attention_factor"} | {"attention_factor": 1.0})
    pos = torch.arange(0, 5000, 7)
    cos, sin = rope_cos_sin(pos, HEAD_DIM, THETA, yarn)
    cos1, sin1 = rope_cos_sin(pos, HEAD_DIM, THETA, no_factor)
    torch.testing.assert_close(cos, 1.3 * cos1)
    torch.testing.assert_close(sin, 1.3 * sin1)


def test_plain_rope_is_unchanged_by_a_default_or_empty_scaling():
    pos = torch.arange(100)
    base = rope_cos_sin(pos, HEAD_DIM, THETA)
    for none in (None, {}, {"rope_type": "default"}):
        for got, want in zip(rope_cos_sin(pos, HEAD_DIM, THETA, check_rope_scaling(none)), base):
            assert torch.equal(got, want)
    assert ModelConfig(rope_scaling={"rope_type": "default"}).rope_scaling is None
    assert ModelConfig(rope_scaling={}).rope_scaling is None


@pytest.mark.parametrize("scaling,match", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type=dynamic cannot train: it rescales by "
                                             "the length of the batch"),
    ({"rope_type": "longrope", "factor": 2.0}, "rope_type=longrope cannot train"),
    ({"rope_type": "ntk", "factor": 2.0}, "'ntk' is not one of default, linear, llama3, yarn"),
    ({"factor": 2.0}, "names no rope_type"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 4096}, "yarn needs factor"),
    ({"rope_type": "llama3", "factor": 8.0}, "llama3 needs low_freq_factor, high_freq_factor, "
                                             "original_max_position_embeddings"),
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}, "move it there"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
      "beta_fats": 32}, "did you mean beta_fast"),
    ({"rope_type": "linear", "factor": 0.5}, r"factor=0.5 must be a number >= 1.0"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 8192}, "must be above low_freq_factor"),
])
def test_bad_scalings_are_refused_with_the_fix(scaling, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(rope_scaling=scaling)


@pytest.mark.parametrize("name,needs", [
    ("yarn", "factor, original_max_position_embeddings"), ("linear", "factor"),
    ("llama3", "factor, low_freq_factor, high_freq_factor, original_max_position_embeddings")])
def test_a_type_name_alone_is_refused_with_its_dictionary(name, needs):
    """``model.rope_scaling=yarn`` on the command line (the override parsed into the example
    and accepted: ``unit/test_cli.py``)."""
    from usp.config.rope import EXAMPLES

    with pytest.raises(ValueError) as err:
        ModelConfig(rope_scaling=name)
    said = str(err.value)
    assert f"names the type but not its {needs}" in said
    assert said.endswith(f"model.rope_scaling={EXAMPLES[name]}")
    for other, match in (("dynamic", "cannot train"), ("fast", "neither a dictionary"),
                         (4, "is not a dictionary")):
        with pytest.raises(ValueError, match=match):
            ModelConfig(rope_scaling=other)
