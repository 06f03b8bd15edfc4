"""The lab's logic behind the commands in ``tools/``: the simulated cluster and its
benchmark, the fault campaign, the DeepSpeed-Ulysses peer, the head, mask and memory sweeps,
and usp-prepare against Hugging Face datasets (``prepare_*``, ``proctree``)."""
