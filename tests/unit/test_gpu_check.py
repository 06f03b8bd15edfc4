"""The GPU check's kernel section fails on a kernel whose output is off by 1e-4. The whole
dry run as a command: ``e2e/test_gpu_check_dry_run.py``."""

import torch

from usp.bench import gpu_check, gpu_checks_attention
from usp.kernels import get_kernel


class _Off:
    """The torch kernel with its output nudged: what a wrong CUDA call would look like."""

    def __init__(self, eps):
        self.inner, self.eps, self.name = get_kernel("torch"), eps, "off"

    def forward(self, q, k, v, causal, scale):
        out, lse = self.inner.forward(q, k, v, causal, scale)
        return out + self.eps, lse

    def backward(self, *args):
        return self.inner.backward(*args)


def test_the_check_fails_on_a_wrong_kernel(monkeypatch):
    sizes = gpu_check.Sizes.dry()
    monkeypatch.setattr(gpu_checks_attention, "get_kernel", lambda name: _Off(1e-4))
    rows = gpu_check.SECTIONS["kernels"](torch.device("cpu"), sizes)
    fp32 = [r for r in rows if r["dtype"] == "float32"]
    assert fp32 and not any(r["ok"] for r in fp32)  # 1e-4 > the 2e-5 fp32 bound
    monkeypatch.setattr(gpu_checks_attention, "get_kernel", lambda name: _Off(0.0))
    assert all(r["ok"] for r in gpu_check.SECTIONS["kernels"](torch.device("cpu"), sizes))
