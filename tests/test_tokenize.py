"""router.prompt.tokenize: vLLM 0.33's prompt ids (golden renderer output), segment cache, remote /tokenize, parity guard."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import REGISTRY
from transformers import PreTrainedTokenizerFast

from router.prompt.prompt_fields import TokenizeError, UnsupportedPrompt
from router.prompt.remote_tokenize import ParityGuard, RemoteTokenizeError, RemoteTokenizer
from router.prompt.segments import SegmentCache
from router.prompt.tokenize import PromptTokenizer, load_tokenizer
from support import GOLDEN, QWEN3_DIR, REPO, Proc, free_port, wait_http

GOLDEN_RENDER = GOLDEN / "render_vectors_vllm-0.33.0_qwen3-0.6b-tok.jsonl"
CASES = [json.loads(line) for line in GOLDEN_RENDER.read_text().splitlines() if line.strip()]
SHAREGPT = REPO / "loadtest" / "data" / "traces" / "sharegpt_multiturn_150.json"


@pytest.fixture(scope="module")
def qwen3_full() -> PromptTokenizer:
    return PromptTokenizer.load(str(QWEN3_DIR), use_segments=False)


def _ids(tok: PromptTokenizer, case: dict[str, Any]) -> Any:
    if case["endpoint"] == "chat":
        return tok.chat_ids(case["request"])
    ids = tok.completion_ids(case["request"])
    return ids if case.get("batch") else ids[0]


def test_golden_has_all_86_cases() -> None:
    assert len(CASES) == 86
    assert sum(c["prompt_token_ids"] is None for c in CASES) == 2


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
@pytest.mark.parametrize("path", ["segment", "full"])
def test_golden_prompt_ids_match_vllm(case: dict[str, Any], path: str, qwen3: PromptTokenizer, qwen3_full: PromptTokenizer) -> None:
    tok = qwen3 if path == "segment" else qwen3_full
    if case["prompt_token_ids"] is None:
        with pytest.raises(TokenizeError):
            _ids(tok, case)
    else:
        assert _ids(tok, case) == case["prompt_token_ids"]


RENDERED = [
    c for c in CASES
    if c["endpoint"] == "chat" and c["prompt_token_ids"] is not None and c["request"].get("truncate_prompt_tokens") is None
]


@pytest.mark.parametrize("case", RENDERED, ids=[c["id"] for c in RENDERED])
def test_rendered_chat_text_matches_vllm(case: dict[str, Any], qwen3: PromptTokenizer) -> None:
    assert qwen3.render_chat(case["request"]) == case["prompt_text"]


def test_qwen3_uses_the_segment_path(qwen3: PromptTokenizer) -> None:
    assert qwen3.segment_enabled, qwen3.segment_disabled_reason


def _sharegpt_chats(limit: int) -> Iterator[list[dict[str, str]]]:
    roles = {"human": "user", "gpt": "assistant", "system": "system"}
    for conv in json.loads(SHAREGPT.read_text())[:limit]:
        messages = [{"role": roles.get(t["from"], "user"), "content": t["value"]} for t in conv["conversations"]]
        yield messages


def test_segment_path_equals_full_tokenization_on_growing_sharegpt_chats() -> None:
    tok = PromptTokenizer.load(str(QWEN3_DIR), verify_rate=0.0)
    hits_before = _metric("kvrouter_tokenizer_segment_tokens_total", model=str(QWEN3_DIR), result="hit")
    requests = 0
    for messages in _sharegpt_chats(60):
        history: list[dict[str, str]] = [{"role": "system", "content": "You are a helpful assistant."}]
        for m in messages:
            history.append(m)
            if m["role"] != "user":
                continue
            body = {"model": "m", "messages": list(history)}
            assert tok.chat_ids(body) == tok.encode_full(tok.render_chat(body)), f"turn {len(history)}"
            requests += 1
    assert requests > 100
    hits = _metric("kvrouter_tokenizer_segment_tokens_total", model=str(QWEN3_DIR), result="hit") - hits_before
    assert hits > 0, "growing chats must reuse cached segments"


def test_runtime_check_disables_the_segment_path_on_a_mismatch() -> None:
    tok = PromptTokenizer.load(str(QWEN3_DIR), verify_rate=1.0, name="runtime-check")
    body = {"model": "m", "messages": [{"role": "user", "content": "Hello there, general Kenobi"}]}
    expected = tok.chat_ids(body)
    assert tok.segment_enabled
    for key in tok.segments.cache.keys():
        tok.segments.cache.put(key, [0, 1, 2])
    assert tok.chat_ids(body) == expected
    assert not tok.segment_enabled
    assert _metric("kvrouter_tokenizer_segment_mismatches_total", model="runtime-check") == 1
    assert _metric("kvrouter_tokenizer_segment_checks_total", model="runtime-check") == 2
    assert tok.chat_ids(body) == expected


def test_deferred_check_strips_special_tokens_and_catches_a_mismatch() -> None:
    tok = PromptTokenizer.load(str(QWEN3_DIR), verify_rate=1.0, name="deferred-check")
    text = "A completion prompt <|im_start|> with an added token inside."
    ids = tok.text_ids(text, True, check=False)
    assert _metric("kvrouter_tokenizer_segment_checks_total", model="deferred-check") == 0  # check=False: none here
    tok.check_prompt(text, ids, True)
    assert tok.segment_enabled
    assert _metric("kvrouter_tokenizer_segment_checks_total", model="deferred-check") == 1
    tok.check_prompt(text, [*ids[:-1], ids[-1] + 1], True)
    assert not tok.segment_enabled
    assert _metric("kvrouter_tokenizer_segment_mismatches_total", model="deferred-check") == 1


def _qwen3_variant(tmp_path: Path, edit: Any) -> PreTrainedTokenizerFast:
    spec = json.loads((QWEN3_DIR / "tokenizer.json").read_text())
    edit(spec)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|im_end|>")


def test_long_segments_take_the_gil_free_path_and_tokenize_identically(qwen3: PromptTokenizer) -> None:
    from router.prompt.segments import GIL_FREE_CHARS

    readme = (REPO / "README.md").read_text()
    for size in (GIL_FREE_CHARS - 1, GIL_FREE_CHARS, 5 * GIL_FREE_CHARS + 7):
        text = f"[{size}] " + readme[:size]
        chat = f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
        assert qwen3.encode(text) == qwen3.encode_full(text)
        assert qwen3.encode(chat) == qwen3.encode_full(chat)


def _rag_message(docs: list[str], question: str) -> str:
    parts = [f"Document {i}:\n{doc}" for i, doc in enumerate(docs)]
    return "<|im_start|>user\n" + "\n\n".join([*parts, f"Question: {question}"]) + "<|im_end|>\n<|im_start|>assistant\n"


def test_shared_documents_in_a_new_message_reuse_their_ids() -> None:
    """A long message is cut at paragraph breaks: a second question over the same documents
    tokenizes only its own words (and still equals full tokenization), and a scan's head
    runs through the cached documents up to the new question."""
    from router.prompt.segments import CHUNKED_CHARS

    tok = PromptTokenizer.load(str(QWEN3_DIR), verify_rate=0.0, name="rag-chunks")
    readme = (REPO / "README.md").read_text()
    docs = [readme[i * 900 : (i + 1) * 900].replace("\n\n", "\n") for i in range(3)]
    first = _rag_message(docs, "what does the first document say?")
    assert len(first) > CHUNKED_CHARS
    assert tok.encode(first) == tok.encode_full(first)
    second = _rag_message(docs, "and the " + "second one " * 40 + "?")
    scan = tok.scan(second, False)
    assert not scan.complete and scan.uncached_chars < 600, scan.uncached_chars
    assert second[: scan.head_chars].endswith("\n\n") and second[scan.head_chars :].startswith("Question:")
    assert tok.encode_full(second)[: len(scan.head)] == scan.head
    missed = _metric("kvrouter_tokenizer_segment_tokens_total", model="rag-chunks", result="miss")
    assert tok.encode(second) == tok.encode_full(second)
    new = _metric("kvrouter_tokenizer_segment_tokens_total", model="rag-chunks", result="miss") - missed
    assert 0 < new < 120, f"{new} tokens tokenized again for a new question over cached documents"


def test_paragraph_cuts_keep_ids_exact_on_random_and_real_long_texts(qwen3: PromptTokenizer) -> None:
    """Long texts full of line breaks before letters, digits, marks, quotes and spaces (and
    the ShareGPT conversations joined into long messages): segment ids equal full ids."""
    rng = random.Random(7)
    pieces = ["word", "Word", " the", "École", "ñ", "\u0301", "你好", "12", "3", "'s", "'t", " ", "  ", "\t", ".", ":", "!?",
              "👋🏽", "\n", "\n\n", "\r\n", " \n", "\n \n", "\n\n\n", "<|im_end|>", "<think>", "#", "- ", "```", "_x", "Ⅻ"]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(300, 900))) for _ in range(150)]
    for messages in _sharegpt_chats(40):
        texts.append("\n\n".join(m["content"] for m in messages))
    for text in texts:
        assert qwen3.encode(text) == qwen3.encode_full(text), text[:200]
        assert qwen3.encode(text) == qwen3.encode_full(text), text[:200]  # from the cache


def test_paragraph_cuts_are_off_where_a_line_break_changes_the_next_word(tmp_path: Path) -> None:
    """A normalizer that rewrites a line break together with the letter after it makes a
    paragraph cut change the ids: the probes at load find that, whole segments stay, and
    the ids stay exact."""

    def rewrite_across_breaks(spec: dict[str, Any]) -> None:
        replace = {"type": "Replace", "pattern": {"String": "\n\nQ"}, "content": "\n\n q"}
        spec["normalizer"] = {"type": "Sequence", "normalizers": [spec["normalizer"], replace]}

    tok = PromptTokenizer(_qwen3_variant(tmp_path, rewrite_across_breaks), name="break-rewrite", verify_rate=0.0)
    assert tok.segment_enabled, tok.segment_disabled_reason
    assert tok.segments._cut_re is None
    text = _rag_message(["alpha beta gamma " * 60, "delta epsilon " * 80], "why?")
    assert tok.encode(text) == tok.encode(text) == tok.encode_full(text)


def test_scan_heads_include_a_bos_the_tokenizer_adds(tmp_path: Path) -> None:
    """With a post-processor that adds a BOS, a scan's head starts with it and a complete
    scan is exactly ``encode(add_special_tokens=True)``."""

    def add_bos(spec: dict[str, Any]) -> None:
        bos = {"id": "<|endoftext|>", "ids": [151643], "tokens": ["<|endoftext|>"]}
        spec["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<|endoftext|>": bos},
        }

    tok = PromptTokenizer(_qwen3_variant(tmp_path, add_bos), name="bos-scan", verify_rate=0.0)
    assert tok.special_prefix == [151643]
    history = "<|im_start|>user\n" + "an old question " * 30 + "<|im_end|>\n"
    text = history + "<|im_start|>user\nsomething new<|im_end|>\n"
    tok.encode(history, True)
    scan = tok.scan(text, True)
    assert scan.head[0] == 151643 and not scan.complete
    assert tok.encode_full(text, True)[: len(scan.head)] == scan.head
    tok.encode(text, True)
    scan = tok.scan(text, True)
    assert scan.complete and scan.head == tok.encode_full(text, True)


def test_prefix_space_tokenizer_falls_back_to_full_tokenization(tmp_path: Path) -> None:
    def prefix_space(spec: dict[str, Any]) -> None:
        spec["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = True

    tok = PromptTokenizer(_qwen3_variant(tmp_path, prefix_space), name="prefix-space")
    assert not tok.segment_enabled
    assert "add_prefix_space" in (tok.segment_disabled_reason or "")
    assert tok.encode("<|im_start|>user\nHi") == tok.encode_full("<|im_start|>user\nHi")


def test_metaspace_first_tokenizer_falls_back_to_full_tokenization(tmp_path: Path) -> None:
    def metaspace_first(spec: dict[str, Any]) -> None:
        spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}

    tok = PromptTokenizer(_qwen3_variant(tmp_path, metaspace_first), name="metaspace-first")
    assert not tok.segment_enabled
    assert "first" in (tok.segment_disabled_reason or "")


def test_stripping_added_token_falls_back_to_full_tokenization(tmp_path: Path) -> None:
    def lstrip(spec: dict[str, Any]) -> None:
        spec["added_tokens"][1]["lstrip"] = True

    tok = PromptTokenizer(_qwen3_variant(tmp_path, lstrip), name="lstrip")
    assert not tok.segment_enabled


def test_segment_cache_evicts_least_recently_used_within_its_token_bound() -> None:
    cache = SegmentCache(max_tokens=10)
    cache.put(1, [1] * 4)
    cache.put(2, [2] * 4)
    assert cache.get(1) == [1] * 4
    cache.put(3, [3] * 4)
    assert cache.get(2) is None
    assert cache.get(1) is not None and cache.get(3) is not None
    assert cache.tokens == 8
    cache.put(4, [4] * 11)
    assert cache.get(4) is None and cache.tokens <= 10


def test_completion_prompt_shapes(qwen3: PromptTokenizer) -> None:
    assert qwen3.completion_ids({"prompt": "Hello"}) == [[9707]]
    assert qwen3.completion_ids({"prompt": ["Hello", "Hello"]}) == [[9707], [9707]]
    assert qwen3.completion_ids({"prompt": [1, 2, 3]}) == [[1, 2, 3]]
    assert qwen3.completion_ids({"prompt": [[1, 2], [3]]}) == [[1, 2], [3]]


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": ""},
        {"prompt": []},
        {"prompt": [[]]},
        {"prompt": [1, "a"]},
        {"prompt": [-1]},
        {"prompt": None},
        {"prompt": {"text": "x"}},
        {"prompt": "x", "add_special_tokens": "yes"},
        {"prompt": "x", "truncate_prompt_tokens": -2},
    ],
)
def test_invalid_completion_prompts_are_rejected(body: dict[str, Any], qwen3: PromptTokenizer) -> None:
    with pytest.raises(TokenizeError):
        qwen3.completion_ids(body)


@pytest.mark.parametrize(
    "body",
    [
        {"messages": []},
        {"messages": "hi"},
        {"messages": [{"content": "no role"}]},
        {"messages": [{"role": "user", "content": 5}]},
        {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True, "continue_final_message": True},
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": [1]},
        {"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    ],
)
def test_invalid_chat_requests_are_rejected(body: dict[str, Any], qwen3: PromptTokenizer) -> None:
    with pytest.raises(TokenizeError):
        qwen3.chat_ids(body)


def test_image_part_is_unsupported_locally_not_invalid(qwen3: PromptTokenizer) -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}]}
    with pytest.raises(UnsupportedPrompt):
        qwen3.chat_ids(body)


def test_openai_content_format_template_gets_text_part_dicts() -> None:
    tok = PromptTokenizer.load(str(QWEN3_DIR), name="openai-format")
    tok._hf.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% for p in m.content %}[{{ p.text }}]{% endfor %}<|im_end|>\n{% endfor %}"
    )
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}, {"type": "text", "text": "b"}]}]}
    assert tok.render_chat(body) == "<|im_start|>user\n[a][b]<|im_end|>\n"


def test_load_tokenizer_caches_by_path() -> None:
    assert load_tokenizer(str(QWEN3_DIR)) is load_tokenizer(str(QWEN3_DIR))


def test_decode_round_trips(qwen3: PromptTokenizer) -> None:
    assert qwen3.decode(qwen3.encode("Hello world")) == "Hello world"
    assert qwen3.eos_token_id == 151645


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# -- remote /tokenize and the parity guard ----------------------------------------

PEER_APP = textwrap.dedent(
    '''
    """A vLLM-shaped /tokenize peer: the naive HF recipe (apply_chat_template + encode)."""
    import os
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.environ["PEER_TOKENIZER"], local_files_only=True)
    app = FastAPI()

    @app.get("/health")
    def health():
        return {}

    @app.post("/tokenize")
    def tokenize(body: dict):
        try:
            if "messages" in body:
                text = tok.apply_chat_template(
                    body["messages"], tools=body.get("tools"), tokenize=False,
                    add_generation_prompt=body.get("add_generation_prompt", True),
                    continue_final_message=body.get("continue_final_message", False),
                    **(body.get("chat_template_kwargs") or {}))
                ids = tok.encode(text, add_special_tokens=body.get("add_special_tokens", False))
            elif "prompt" in body:
                ids = tok.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
            else:
                raise ValueError("either prompt or messages is required")
        except Exception as e:
            return JSONResponse({"error": {"message": str(e), "type": "BadRequestError", "code": 400}}, status_code=400)
        return {"tokens": ids, "count": len(ids), "max_model_len": 40960}
    '''
)


@pytest.fixture(scope="module")
def peer_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    d = tmp_path_factory.mktemp("peer")
    (d / "tokenize_peer.py").write_text(PEER_APP)
    port = free_port()
    args = [sys.executable, "-m", "uvicorn", "tokenize_peer:app", "--app-dir", str(d), "--host", "127.0.0.1", "--port", str(port)]
    with Proc(args, d / "peer.log", env={"PEER_TOKENIZER": str(QWEN3_DIR)}) as proc:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=90, proc=proc.popen)
        yield f"http://127.0.0.1:{port}"


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


async def _with_client(fn: Any) -> Any:
    async with aiohttp.ClientSession() as client:
        return await fn(client)


def _case(case_id: str) -> dict[str, Any]:
    return next(c for c in CASES if c["id"] == case_id)


def test_remote_chat_ids_come_from_the_backend(peer_url: str, qwen3: PromptTokenizer) -> None:
    remote = RemoteTokenizer("qwen3")
    body = _case("chat_multi_turn")["request"]
    ids = _run(_with_client(lambda c: remote.chat_ids(peer_url, body, c)))
    assert ids == _case("chat_multi_turn")["prompt_token_ids"] == qwen3.chat_ids(body)


def test_remote_completion_ids_cover_every_prompt_shape(peer_url: str) -> None:
    remote = RemoteTokenizer("qwen3")
    body = {"model": "qwen3", "prompt": ["Hello", "Goodbye world"]}
    assert _run(_with_client(lambda c: remote.completion_ids(peer_url, body, c))) == [[9707], [15216, 28374, 1879]]
    body = {"model": "qwen3", "prompt": [[9906, 1917], [1, 2, 3]]}
    assert _run(_with_client(lambda c: remote.completion_ids(peer_url, body, c))) == [[9906, 1917], [1, 2, 3]]


def test_remote_truncation_keeps_the_last_tokens(peer_url: str) -> None:
    case = _case("cmpl_truncate_prompt_tokens")
    remote = RemoteTokenizer("qwen3")
    assert _run(_with_client(lambda c: remote.completion_ids(peer_url, case["request"], c))) == [case["prompt_token_ids"]]


def test_remote_400_is_a_tokenize_error(peer_url: str) -> None:
    remote = RemoteTokenizer("qwen3")
    body = _case("chat_parts_two_text")["request"]
    with pytest.raises(TokenizeError, match="startswith"):
        _run(_with_client(lambda c: remote.chat_ids(peer_url, body, c)))


def test_unreachable_backend_is_a_remote_error() -> None:
    remote = RemoteTokenizer("qwen3", timeout=2.0)
    with pytest.raises(RemoteTokenizeError):
        _run(_with_client(lambda c: remote.completion_ids(f"http://127.0.0.1:{free_port()}", {"prompt": "x"}, c)))


def test_parity_guard_counts_matches_and_stays_local(peer_url: str, qwen3: PromptTokenizer) -> None:
    guard = ParityGuard("parity-ok", mode="auto", sample_rate=1.0)
    remote = RemoteTokenizer("qwen3")
    same = [c for c in CASES if c["endpoint"] == "chat" and c["prompt_token_ids"] is not None and c["hf_token_ids"] == c["prompt_token_ids"]][:10]

    async def check_all(client: aiohttp.ClientSession) -> list[bool]:
        return [await guard.check_chat(qwen3.chat_ids(c["request"]), c["request"], remote, peer_url, client) for c in same]

    assert all(_run(_with_client(check_all)))
    assert guard.mode == "local" and guard.checks == 10 and guard.mismatches == 0
    assert _metric("kvrouter_tokenizer_parity_checks_total", model="parity-ok") == 10
    assert _metric("kvrouter_tokenizer_parity_mismatches_total", model="parity-ok") == 0


def test_parity_guard_auto_switches_to_remote_after_persistent_mismatches(peer_url: str, qwen3: PromptTokenizer) -> None:
    guard = ParityGuard("parity-bad", mode="auto", sample_rate=1.0, window=20, threshold=3)
    remote = RemoteTokenizer("qwen3")
    differ = [
        c for c in CASES
        if c["endpoint"] == "chat" and c["hf_token_ids"] is not None and c["prompt_token_ids"] not in (None, c["hf_token_ids"])
    ]
    assert len(differ) >= 3
    results: list[bool] = []

    async def check(client: aiohttp.ClientSession) -> None:
        for c in differ[:3]:
            assert guard.should_check()
            results.append(await guard.check_chat(qwen3.chat_ids(c["request"]), c["request"], remote, peer_url, client))

    _run(_with_client(check))
    assert results == [False, False, False]
    assert guard.mode == "remote"
    assert not guard.should_check()
    assert _metric("kvrouter_tokenizer_parity_mismatches_total", model="parity-bad") == 3
    assert _metric("kvrouter_tokenizer_remote", model="parity-bad") == 1


def test_parity_guard_local_mode_never_switches() -> None:
    guard = ParityGuard("parity-local", mode="local", sample_rate=1.0)
    for _ in range(10):
        guard.record([1], [2])
    assert guard.mode == "local" and guard.mismatches == 10


def test_parity_guard_samples_at_its_rate() -> None:
    rng = random.Random(7)
    guard = ParityGuard("parity-rate", mode="auto", sample_rate=0.01, rng=rng.random)
    sampled = sum(guard.should_check() for _ in range(20_000))
    assert 120 <= sampled <= 280
    assert ParityGuard("parity-remote", mode="remote").mode == "remote"
