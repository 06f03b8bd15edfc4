"""Chat templates and conversations for the tests of usp-prepare's chat mode and usp-export's
tokenizer: a ChatML template without generation markers, a Qwen3-like one that drops earlier
assistant turns' <think> blocks, and a tokenizer directory holding special tokens for them."""

from __future__ import annotations

import json
import random
from pathlib import Path

from _tokenizers import WORDS, bpe, save_dir

START, END = "<|im_start|>", "<|im_end|>"

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Qwen3's rule: an assistant turn after the last user turn keeps its reasoning (and the last
# one always shows a <think> block); earlier ones lose it
QWEN3_LIKE = """{%- set ns = namespace(last=0) -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{%- set ns.last = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{%- set c = m.content -%}{%- set r = '' -%}
{%- if '</think>' in c -%}
{%- set r = c.split('</think>')[0].split('<think>')[-1].strip('\\n') -%}
{%- set c = c.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
{%- if loop.index0 > ns.last -%}
{{- '<|im_start|>assistant\\n<think>\\n' + r + '\\n</think>\\n\\n' + c + '<|im_end|>\\n' -}}
{%- else -%}
{{- '<|im_start|>assistant\\n' + c + '<|im_end|>\\n' -}}
{%- endif -%}
{%- else -%}
{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"""


def chat_tokenizer(path: Path, template: str | None = CHATML) -> Path:
    """A byte-level BPE directory with <|im_start|>/<|im_end|> (special), <think>/</think>
    (not special) and ``template`` as its chat template (None: no template)."""
    from transformers import AutoTokenizer

    tok = bpe(300)
    tok.add_special_tokens([START, END])
    tok.add_tokens(["<think>", "</think>"])
    save_dir(tok, path)
    if template is not None:
        t = AutoTokenizer.from_pretrained(str(path))
        t.chat_template = template
        t.save_pretrained(str(path))
    return path


def sentence(rng: random.Random, lo: int = 2, hi: int = 8) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))


def conversation(rng: random.Random, turns: int, think: bool = False,
                 system: bool = False, tool: bool = False) -> list[dict]:
    """``turns`` user/assistant pairs (an assistant content with a <think> block when
    ``think``), after a system turn when ``system``; ``tool``: each assistant turn is
    followed by a tool's answer and a second assistant turn."""
    msgs = [{"role": "system", "content": sentence(rng)}] if system else []
    for _ in range(turns):
        msgs.append({"role": "user", "content": sentence(rng)})
        for step in range(1 + tool):
            if step:
                msgs.append({"role": "tool", "content": sentence(rng)})
            answer = sentence(rng)
            if think:
                answer = f"<think>\n{sentence(rng)}\n</think>\n\n{answer}"
            msgs.append({"role": "assistant", "content": answer})
    return msgs


def write_jsonl(path: Path, records: list) -> Path:
    """One JSON value a line (a str record is written as it is: a bad line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path
