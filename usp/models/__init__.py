"""Models that run sequence parallel through ``usp_attention``, one concept per file:

- ``decoder``: the built-in Llama-style GQA decoder (``Transformer``, ``flops_per_token``);
- ``hf``: the Hugging Face adapter (transformers decoders through usp's attention);
- ``export``: build, load and export transformers models (``from_pretrained`` directories);
- ``tiling``: the chunked LM loss and the tiled MLP (exact recompute);
- ``offload``: activation offload to pinned host memory (CUDA);
- ``checkpoint``: a model's and its optimizer's state on disk (save, verify, resume).

Nothing is imported here: ``hf`` and ``export`` need transformers, which is optional.
"""
