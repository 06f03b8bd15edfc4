"""``usp-prepare`` against Hugging Face ``datasets`` on one corpus (``tools.bench_prepare``).

Both sides tokenize the same generated JSONL corpus (``tools.lab.prepare_corpus``) with the
same tokenizer directory, each in its own process, timed whole (interpreter start and
imports included) with its process tree's peak memory sampled (``tools.lab.proctree``):

- usp: ``usp-prepare --val-fraction 0 --workers N --quiet`` (every document in ``OUT.bin``);
- datasets: ``tools/lab/prepare_datasets.py``: ``load_dataset("json")`` + ``Dataset.map(
  batched=True, num_proc=N)``, timed twice: when the mapped dataset (arrow cache) is done,
  and when its ids are written to one flat file like usp's (the whole command).

``TOKENIZERS_PARALLELISM=false`` on both sides: N workers are N processes and the Rust
tokenizer starts no threads of its own. Rows run interleaved (usp w1, datasets w1, usp w2,
..., ``rounds`` times) so both see the same machine; the report takes the median per row.
Every run's token file is compared with the first one's (a hash; on a difference the first
token that differs): documents are in the same order on both sides (files sorted, lines
in order), so the files must be byte-identical.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from usp.data.prepare import POOL_BYTES
from . import prepare_corpus
from .proctree import run_sampled

TOOLS = ("usp", "datasets")
DATASETS_SCRIPT = Path(__file__).with_name("prepare_datasets.py")
ENV = {"TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
MB = 10**6  # corpus sizes in MB, as usp-prepare reports them
IMPORTS = {"usp": "import usp.data.prepare", "datasets": "import datasets, pyarrow"}


@dataclass(frozen=True)
class PrepareBench:
    """What to run: a corpus of ``corpus_mb`` MB from ``seed``, a BPE of ``vocab`` tokens
    trained on its first ``sample_mb`` MB, each tool of ``tools`` at each worker count,
    ``rounds`` times, under ``work_dir``; ``keep``: keep every run's output files."""

    corpus_mb: float = 200.0
    workers: tuple[int, ...] = (1, 2)
    rounds: int = 1
    work_dir: Path = Path("/tmp/usp_bench_prepare")
    tools: tuple[str, ...] = TOOLS
    seed: int = 0
    vocab: int = 16384
    sample_mb: float = 20.0
    keep: bool = False
    timeout_s: float | None = None
    tokenizer: str = "bpe"  # bpe | bytes (usp's byte tokenizer: --only usp, no BPE trained)

    def __post_init__(self):
        if self.corpus_mb <= 0 or self.sample_mb <= 0:
            raise ValueError(f"corpus_mb={self.corpus_mb} and sample_mb={self.sample_mb} must "
                             "be > 0 (MB of JSONL), e.g. --corpus-mb 200 --sample-mb 20")
        if not self.workers or min(self.workers) < 1:
            raise ValueError(f"workers {self.workers} must be counts >= 1, e.g. --workers 1,2")
        if self.rounds < 1:
            raise ValueError(f"rounds={self.rounds} must be >= 1 (--rounds)")
        if not 257 <= self.vocab <= 1 << 20:
            raise ValueError(f"vocab={self.vocab} must lie in [257, 2**20] (a byte-level BPE "
                             "needs the 256 bytes and EOS), e.g. --vocab 16384")
        if self.tokenizer not in ("bpe", "bytes"):
            raise ValueError(f"tokenizer={self.tokenizer!r}: bpe or bytes (--tokenizer)")
        if self.tokenizer == "bytes" and tuple(self.tools) != ("usp",):
            raise ValueError("--tokenizer bytes runs usp's byte tokenizer, which datasets has "
                             "no counterpart of; add --only usp")
        unknown = set(self.tools) - set(TOOLS)
        if not self.tools or unknown:
            raise ValueError(f"tools {self.tools}: pick from {TOOLS} (--only usp|datasets)")


@dataclass
class Sample:
    """One run: ``seconds``/``peak_*`` of the whole command; for datasets also ``map_*``,
    when the mapped dataset was done. ``same``: its token file equals the first run's."""

    tool: str
    workers: int
    round: int
    seconds: float
    peak_rss: int
    peak_pss: int
    peak_anon: int
    tokens: int
    documents: int
    dtype: str
    digest: str
    same: bool = True
    difference: str | None = None
    map_seconds: float | None = None
    map_peak_rss: int | None = None
    map_peak_pss: int | None = None
    map_peak_anon: int | None = None


@dataclass
class Result:
    bench: PrepareBench
    corpus: dict
    tokenizer: dict
    samples: list[Sample] = field(default_factory=list)
    load_avg: dict = field(default_factory=dict)

    @property
    def agree(self) -> bool:
        return all(s.same for s in self.samples)


def usp_command() -> list[str]:
    """``usp-prepare`` next to this Python (a venv's bin), else ``python -m usp.data.prepare``."""
    exe = Path(sys.executable).parent / "usp-prepare"
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "usp.data.prepare"]


def digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            h.update(block)
    return h.hexdigest()


def first_difference(a: Path, b: Path, dtype: str, chunk: int = 1 << 24) -> int | None:
    """The index of the first token where the files ``a`` and ``b`` differ (the shorter
    one's length where one is a prefix of the other); None when they are equal."""
    x, y = np.memmap(a, dtype=dtype, mode="r"), np.memmap(b, dtype=dtype, mode="r")
    n = min(len(x), len(y))
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        diff = np.flatnonzero(x[start:end] != y[start:end])
        if len(diff):
            return start + int(diff[0])
    return None if len(x) == len(y) else n


def _run_usp(data, tok_dir: Path, workers: int, folder: Path, env: dict, timeout):
    out = folder / "tokens"
    cmd = [*usp_command(), "--src", str(data.folder), "--glob", "*.jsonl", "--out", str(out),
           "--tokenizer", str(tok_dir), "--val-fraction", "0", "--workers", str(workers),
           "--quiet"]
    run = run_sampled(cmd, env=env, stdout=folder / "log.txt", timeout=timeout)
    _check_rc("usp-prepare", run.rc, folder)
    meta = json.loads((folder / "tokens.json").read_text())
    counts = {k: meta[k] for k in ("num_tokens", "num_documents", "dtype")}
    return run, folder / "tokens.bin", counts, {}


def _run_datasets(data, tok_dir: Path, workers: int, folder: Path, env: dict, timeout):
    cache, mark, result = folder / "cache", folder / "mapped.json", folder / "result.json"
    cmd = [sys.executable, str(DATASETS_SCRIPT), "--tokenizer", str(tok_dir), "--workers",
           str(workers), "--cache-dir", str(cache), "--out", str(folder / "tokens.bin"),
           "--mark", str(mark), "--result", str(result), *map(str, data.files)]
    start = time.time()  # the script marks the mapped dataset with its own time.time()
    run = run_sampled(cmd, env=dict(env, HF_DATASETS_CACHE=str(cache)),
                      stdout=folder / "log.txt", mark=mark.exists, timeout=timeout)
    _check_rc("the datasets script", run.rc, folder)
    counts = json.loads(result.read_text())
    at = run.mark_peak
    mapped = {"map_seconds": json.loads(mark.read_text())["time"] - start,
              "map_peak_rss": at.rss, "map_peak_pss": at.pss, "map_peak_anon": at.anon}
    return run, folder / "tokens.bin", counts, mapped


RUNNERS = {"usp": _run_usp, "datasets": _run_datasets}


def _check_rc(name: str, rc: int, folder: Path) -> None:
    if rc != 0:
        log = (folder / "log.txt").read_text(errors="replace").splitlines()[-25:]
        raise RuntimeError(f"{name} exited with status {rc} (its output is in "
                           f"{folder / 'log.txt'}); last lines:\n" + "\n".join(log))


def run(cfg: PrepareBench, log=print) -> Result:
    """Make (or reuse) the corpus and tokenizer, then run every row ``cfg.rounds`` times
    interleaved; returns every run's figures and the token-file checks."""
    work = Path(cfg.work_dir)
    data = prepare_corpus.corpus(work, int(cfg.corpus_mb * MB), cfg.seed, log)
    if cfg.tokenizer == "bytes":
        tok_dir = Path("bytes")  # usp-prepare --tokenizer bytes
        tok = {"folder": None, "vocab_size": 257, "kind": "bytes", "eos": 256}
    else:
        tok_dir = prepare_corpus.tokenizer(data, cfg.vocab, int(cfg.sample_mb * MB), log)
        vocab_size = json.loads((tok_dir / prepare_corpus.MANIFEST).read_text())["vocab_size"]
        tok = {"folder": str(tok_dir), "vocab_size": vocab_size, "kind": "byte-level BPE",
               "eos": prepare_corpus.EOS, "sample_mb": cfg.sample_mb}
    result = Result(cfg, {"folder": str(data.folder), "mb": data.num_bytes / MB,
                          "bytes": data.num_bytes, "documents": data.num_documents,
                          "files": len(data.files), "seed": cfg.seed}, tok)
    env = dict(os.environ, **ENV)
    _warm_up(cfg.tools, data, env, log)
    runs = work / "runs"
    shutil.rmtree(runs, ignore_errors=True)
    reference = runs / "reference.bin"  # the first run's token file, kept to compare with
    result.load_avg["before"] = os.getloadavg()
    for r in range(cfg.rounds):
        for w in cfg.workers:
            for tool in cfg.tools:
                folder = runs / f"{tool}-w{w}-r{r}"
                folder.mkdir(parents=True)
                log(f"round {r + 1}/{cfg.rounds}: {tool} with {w} worker(s) ...")
                proc, tokens_bin, counts, mapped = RUNNERS[tool](
                    data, tok_dir, w, folder, env, cfg.timeout_s)
                sample = Sample(tool, w, r, proc.seconds, proc.peak.rss, proc.peak.pss,
                                proc.peak.anon, counts["num_tokens"], counts["num_documents"],
                                counts["dtype"], digest(tokens_bin), **mapped)
                if not result.samples:  # a second name for the file: no copy, kept alone
                    _link(tokens_bin, reference)
                else:
                    _compare(sample, result.samples[0], tokens_bin, reference)
                result.samples.append(sample)
                log(f"  {proc.seconds:.1f} s, {sample.tokens} tokens, peak RSS "
                    f"{proc.peak.rss / 2**20:.0f} MiB" + ("" if sample.same else
                                                          f"; DIFFERS: {sample.difference}"))
                if not cfg.keep:
                    shutil.rmtree(folder)
    result.load_avg["after"] = os.getloadavg()
    if not cfg.keep:
        shutil.rmtree(runs)
    return result


def _link(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a file system without hard links
        shutil.copyfile(src, dst)


def _warm_up(tools, data, env: dict, log) -> None:
    """Read the corpus and import both sides' libraries once, untimed, so the first timed
    run does not alone pay for a cold disk cache."""
    log("warm-up: reading the corpus, importing the libraries (untimed) ...")
    for path in data.files:
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass
    code = "; ".join(["from transformers import AutoTokenizer", *(IMPORTS[t] for t in tools)])
    subprocess.run([sys.executable, "-c", code], env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False)


def _compare(sample: Sample, first: Sample, tokens_bin: Path, reference: Path) -> None:
    if sample.digest == first.digest:
        return
    sample.same = False
    sample.difference = (f"{sample.tokens} tokens / {sample.documents} documents against "
                         f"{first.tokens} / {first.documents} of {first.tool} w{first.workers}")
    if sample.dtype != first.dtype:
        sample.difference += f"; {sample.dtype} ids against {first.dtype}"
    else:
        at = first_difference(reference, tokens_bin, first.dtype)
        sample.difference += f"; first differing token at index {at}"


def in_process(result: Result, workers: int) -> bool:
    """Whether usp-prepare ignored ``--workers`` (a corpus under its ``POOL_BYTES``)."""
    return workers > 1 and result.corpus["bytes"] < POOL_BYTES


def machine() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in ("usp", "tokenizers", "transformers", "datasets", "pyarrow", "numpy"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    return {"cpus": os.cpu_count(), "python": sys.version.split()[0],
            "platform": sys.platform, "versions": versions}


def as_json(result: Result, rows: list, argv: list[str]) -> dict:
    """Everything the report says, for ``--json``: the median rows, every run, the corpus
    and tokenizer, the machine and the command line."""
    bench = asdict(result.bench)
    bench["work_dir"] = str(bench["work_dir"])
    tokens = result.samples[0].tokens if result.samples else None
    return {"command": " ".join([sys.executable, "-m", "tools.bench_prepare", *argv]),
            "bench": bench, "env": ENV, "agree": result.agree,
            "corpus": dict(result.corpus, tokens=tokens), "tokenizer": result.tokenizer,
            "machine": dict(machine(), load_avg=result.load_avg),
            "rows": [dict(asdict(row), tokens_per_s=row.tokens_per_s) for row in rows],
            "samples": [asdict(s) for s in result.samples]}
