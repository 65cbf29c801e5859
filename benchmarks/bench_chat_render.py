"""Chat-template render time per request: the memoizing sandbox vs plain transformers, same run.

``router/prompt/fast_sandbox.py`` exists only for speed, so it has to keep earning its place
against what vLLM itself does: ``tokenizer.apply_chat_template(..., tokenize=False)``
through transformers' stock ``ImmutableSandboxedEnvironment``. Cases, all with the shipped
Qwen3 template and ShareGPT text, rendered from the conversation the router hands the
template (normalisation is timed separately, it is the same code either way):

* short: a system prompt and one user turn (~60 tokens);
* medium: 10 turns, ~2k tokens;
* long: 10 turns, ~8k tokens (the router's common re-sent history);
* many turns: 80 short turns (~3k tokens): attribute look-ups scale with messages,
  not with text;
* tools: the medium chat with 4 tool definitions (``tojson`` on each).

Columns (medians of ``--reps`` renders, ms): ``stock`` is ``apply_chat_template``, as
vLLM calls it; ``own stock`` is router.prompt.chat_template's environment in jinja2's stock
sandbox (what owning the environment costs or saves by itself); ``memo`` the same in
the memoizing sandbox, as the router renders; ``router`` is
:meth:`PromptTokenizer.render_chat` on the whole request body (normalisation included).
Every render is checked equal to the stock one.

    nice -n 15 .venv/bin/python benchmarks/bench_chat_render.py [--reps 200]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment

from router.prompt.chat_render import normalize_messages, normalize_tools
from router.prompt.chat_template import ChatTemplate, build_environment
from router.prompt.fast_sandbox import MemoSandbox
from router.prompt.tokenize import PromptTokenizer

from bench_tokenize import QWEN3, corpus_ids, median_ms  # the script beside this one

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": f"Tool number {i}: looks something up and returns a JSON answer.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "what to look up"}, "limit": {"type": "integer"}},
                "required": ["query"],
            },
        },
    }
    for i in range(4)
]


def chat(tok: PromptTokenizer, ids: list[int], turns: int, tokens: int) -> list[dict[str, str]]:
    per = max(1, (tokens - 40) // turns)
    msgs = [{"role": "system", "content": tok.decode(ids[:40])}]
    for k in range(turns):
        msgs.append({"role": "user" if k % 2 == 0 else "assistant", "content": tok.decode(ids[40 + k * per : 40 + (k + 1) * per])})
    if msgs[-1]["role"] == "assistant":
        msgs.append({"role": "user", "content": "and then?"})
    return msgs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()

    tok = PromptTokenizer.load(str(QWEN3), verify_rate=0.0)
    hf = tok._hf
    template = hf.chat_template
    ids = corpus_ids(tok, 12_000)
    cases: dict[str, dict[str, Any]] = {
        "short (system + 1 turn)": {"messages": chat(tok, ids, 1, 60)},
        "medium (10 turns, 2k)": {"messages": chat(tok, ids, 10, 2_000)},
        "long (10 turns, 8k)": {"messages": chat(tok, ids, 10, 8_000)},
        "many turns (80 turns, 3k)": {"messages": chat(tok, ids, 80, 3_000)},
        "tools (10 turns, 2k, 4 tools)": {"messages": chat(tok, ids, 10, 2_000), "tools": TOOLS},
    }

    special = hf.special_tokens_map
    own_stock = ChatTemplate(template, special, build_environment(ImmutableSandboxedEnvironment))
    memo = ChatTemplate(template, special, build_environment(MemoSandbox))

    def renders(body: dict[str, Any]) -> dict[str, Callable[[], str]]:
        conversation = normalize_messages(body["messages"], content_format="string", template_has_developer=False)
        tools = normalize_tools(body.get("tools"))
        return {
            "stock": lambda: hf.apply_chat_template(
                conversation, tools=tools, chat_template=template, add_generation_prompt=True, tokenize=False
            ),
            "own stock": lambda: own_stock.render(conversation, tools=tools, add_generation_prompt=True),
            "memo": lambda: memo.render(conversation, tools=tools, add_generation_prompt=True),
            "router": lambda: tok.render_chat({"model": "m", **body}),
        }

    print(f"{'case':32} {'tokens':>7} {'stock ms':>9} {'own stock':>10} {'memo ms':>8} {'saved ms':>9} {'stock/memo':>11} {'router ms':>10}")
    for name, body in cases.items():
        fns = renders(body)
        texts = {k: fn() for k, fn in fns.items()}
        assert len(set(texts.values())) == 1, f"{name}: renders differ"
        ms = {k: median_ms(lambda _, fn=fn: fn(), args.reps) for k, fn in fns.items()}
        n = len(tok.encode_full(texts["stock"]))
        s, m = ms["stock"], ms["memo"]
        print(f"{name:32} {n:7d} {s:9.3f} {ms['own stock']:10.3f} {m:8.3f} {s - m:9.3f} {s / m:10.2f}x {ms['router']:10.3f}")

if __name__ == "__main__":
    main()
