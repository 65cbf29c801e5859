"""Prompt tokenization cost: segment-cached vs full tokenization (the naive baseline), same run.

Cases:
* warm chat: a 10-message conversation whose ~8k-token history the router tokenized
  before, plus a new ~200-token user turn (different on every repetition, so the new
  turn is always a cache miss);
* RAG message: one user message of two ~1k-token documents seen before and a new
  ~150-token question (the documents are reused from the cache, cut at paragraph breaks);
* cold prompts of 1k / 4k / 32k tokens never seen before (the segment path can only
  add its overhead here: one regex scan and one xxh3 per segment or paragraph).

Both paths render the chat template the same way; "full" then calls
``tokenizer.encode(prompt)`` on the whole prompt as vLLM does. Prints medians in ms and
the full/segment ratio.

    .venv/bin/python benchmarks/bench_tokenize.py [--reps 15]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from router.prompt.tokenize import PromptTokenizer

REPO = Path(__file__).resolve().parents[1]
QWEN3 = REPO / "loadtest" / "data" / "tokenizers" / "qwen3"
SHAREGPT = REPO / "loadtest" / "data" / "traces" / "sharegpt_multiturn_150.json"


def corpus_ids(tok: PromptTokenizer, n: int) -> list[int]:
    """At least ``n`` token ids of natural ShareGPT text."""
    ids: list[int] = []
    for conv in json.loads(SHAREGPT.read_text()):
        for turn in conv["conversations"]:
            ids.extend(tok.encode_full(turn["value"] + "\n"))
            if len(ids) >= n:
                return ids
    while len(ids) < n:
        ids.extend(ids)
    return ids


def text_of(tok: PromptTokenizer, ids: list[int], start: int, n: int) -> str:
    return tok.decode(ids[start : start + n])


def median_ms(fn: Callable[[int], object], reps: int) -> float:
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        fn(i)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()

    tok = PromptTokenizer.load(str(QWEN3), verify_rate=0.0)
    assert tok.segment_enabled, tok.segment_disabled_reason
    ids = corpus_ids(tok, 80_000)

    history: list[dict[str, str]] = [{"role": "system", "content": text_of(tok, ids, 0, 400)}]
    per_turn = (8000 - 400) // 10
    for k in range(10):
        role = "user" if k % 2 == 0 else "assistant"
        history.append({"role": role, "content": text_of(tok, ids, 400 + k * per_turn, per_turn)})
    seen = {"model": "m", "messages": [*history, {"role": "user", "content": "an earlier question"}]}
    tok.chat_ids(seen)
    new_turns = [f"Turn {i}: " + text_of(tok, ids, 10_000 + i * 211, 200) for i in range(args.reps)]

    def warm_body(i: int) -> dict:
        return {"model": "m", "messages": [*history, {"role": "user", "content": new_turns[i]}]}

    n_tokens = len(tok.chat_ids(warm_body(0)))
    render = median_ms(lambda i: tok.render_chat(warm_body(i)), args.reps)
    segment = median_ms(lambda i: tok.chat_ids(warm_body(i)), args.reps)
    full = median_ms(lambda i: tok.encode_full(tok.render_chat(warm_body(i))), args.reps)

    rows = [("warm 10-turn chat (8k seen + 200 new)", n_tokens, render, segment, full)]

    docs = [f"Document {d}:\n" + text_of(tok, ids, 40_000 + d * 1000, 1000) for d in range(2)]
    questions = [f"Question {i}: " + text_of(tok, ids, 60_000 + i * 151, 150) for i in range(args.reps + 1)]

    def rag_body(i: int) -> dict:
        return {"model": "m", "messages": [{"role": "user", "content": "\n\n".join([*docs, questions[i]])}]}

    tok.chat_ids(rag_body(args.reps))  # the documents are seen once
    rag = [median_ms(fn, args.reps) for fn in (lambda i: tok.render_chat(rag_body(i)), lambda i: tok.chat_ids(rag_body(i)),
                                                lambda i: tok.encode_full(tok.render_chat(rag_body(i))))]
    rows.append(("RAG message (2 docs seen + new question)", len(tok.chat_ids(rag_body(0))), *rag))
    for size in (1_000, 4_000, 32_000):
        reps = max(5, args.reps // (1 if size < 32_000 else 3))
        # Every paragraph names its request, so none was seen before either.
        prompts_seg = [f"Request {i} seg: " + text_of(tok, ids, 20_000 + i * 97, size).replace("\n\n", f" {i}s\n\n")
                       for i in range(reps)]
        prompts_full = [f"Request {i} full: " + text_of(tok, ids, 20_000 + i * 97, size).replace("\n\n", f" {i}f\n\n")
                        for i in range(reps)]
        body = lambda p: {"model": "m", "messages": [{"role": "user", "content": p}]}  # noqa: E731
        n = len(tok.chat_ids(body(prompts_seg[0] + " warmup")))
        r = median_ms(lambda i: tok.render_chat(body(prompts_seg[i])), reps)
        s = median_ms(lambda i: tok.chat_ids(body(prompts_seg[i])), reps)
        f = median_ms(lambda i: tok.encode_full(tok.render_chat(body(prompts_full[i]))), reps)
        rows.append((f"cold {size // 1000}k prompt", n, r, s, f))

    print(f"{'case':40} {'tokens':>7} {'render ms':>10} {'segment ms':>11} {'full ms':>9} {'full/segment':>13}")
    for name, n, r, s, f in rows:
        print(f"{name:40} {n:7d} {r:10.3f} {s:11.3f} {f:9.3f} {f / s:12.2f}x")
    print(f"segment cache: {len(tok.segments.cache)} segments, {tok.segments.cache.tokens} tokens")


if __name__ == "__main__":
    main()
