"""tools/tiny_checkpoint.py: the checkpoint it writes is what model=pretrained reads, of the
architecture asked for, with a tokenizer whose vocabulary is the model's."""

import pytest

from tools.tiny_checkpoint import main
from usp.models.pretrained import check_checkpoint, pretrained_config

pytest.importorskip("transformers")


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "qwen3"])
def test_the_tiny_checkpoint_is_a_pretrained_directory(arch, tmp_path):
    from transformers import AutoTokenizer

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("def main():\n    return 0\n" * 200)
    main(["--arch", arch, "--out", str(tmp_path / "ckpt"), "--src", str(src), "--vocab", "300"])
    mc = pretrained_config(tmp_path / "ckpt")
    check_checkpoint(mc)  # every tensor there, of the built-in model's shape
    tok = AutoTokenizer.from_pretrained(tmp_path / "ckpt")
    assert mc.arch == arch and mc.vocab_size == len(tok) <= 300
    assert mc.head_dim == mc.dim // mc.n_heads  # stated: Qwen3Config's default is 128
    assert tok.decode(tok("def main():").input_ids) == "def main():"
    with pytest.raises(SystemExit, match="not empty"):
        main(["--arch", arch, "--out", str(tmp_path / "ckpt"), "--src", str(src)])
