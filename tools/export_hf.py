"""Export a usp checkpoint of a Hugging Face model as a directory ``from_pretrained`` loads.

    python tools/export_hf.py RUN_DIR_OR_STEP_DIR OUT_DIR [--config DIR] [--dtype bf16]
"""

from __future__ import annotations

import argparse
import sys

import torch

from usp.models.export import export_checkpoint

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="run_dir (its newest checkpoint) or run_dir/checkpoints/step_K")
    ap.add_argument("out_dir", help="directory to write (config.json + model.safetensors)")
    ap.add_argument("--config", default=None,
                    help="directory with the model's config.json (default: run_dir/hf_config)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="cast the weights (default: as stored)")
    args = ap.parse_args(argv)
    try:
        model = export_checkpoint(args.checkpoint, args.out_dir, config=args.config,
                                  dtype=DTYPES.get(args.dtype))
    except ValueError as e:
        print(f"export_hf: {e}", file=sys.stderr)
        return 2
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {type(model).__name__} ({n} parameters) to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
