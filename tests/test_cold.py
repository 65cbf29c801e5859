"""The first-block probe (router/prompt/cold.py): ids from a text prefix equal full tokenization's.

Real Qwen3 tokenizer, real texts: the golden chat renderings, ShareGPT turns cut at
random places, and texts built to break a naive prefix cut (whitespace runs, words
longer than the probe, CJK, combining marks, a cut inside an added token).
"""

from __future__ import annotations

import json
import random

import pytest
from prometheus_client import REGISTRY

from router.prompt.cold import MAX_PROBE_CHARS, HeadProbe
from router.prompt.segments import Scan
from router.prompt.tokenize import PromptTokenizer
from support import GOLDEN, QWEN3_DIR, REPO

BLOCK = 16


@pytest.fixture(scope="module")
def probe() -> HeadProbe:
    return HeadProbe(PromptTokenizer.load(str(QWEN3_DIR), verify_rate=0.0))


def _check(probe: HeadProbe, text: str, add_special: bool = False, n: int = BLOCK) -> bool:
    """True when the probe answered; it must then equal the full ids' head."""
    got = probe.head_ids(text, add_special, n)
    if got is None:
        return False
    head, per_char = got
    full = probe.tok.encode_full(text, add_special)
    assert head == full[:n], (text[:80], head, full[:n])
    assert per_char > 0
    assert len(full) <= probe.max_tokens(text, add_special)
    return True


def test_qwen3_is_eligible(probe: HeadProbe) -> None:
    assert probe.enabled, probe.disabled_reason


def test_golden_renderings(probe: HeadProbe) -> None:
    answered = 0
    for line in (GOLDEN / "render_vectors_vllm-0.33.0_qwen3-0.6b-tok.jsonl").open():
        case = json.loads(line)
        text = case.get("prompt_text")
        if text is None:
            continue
        for n in (4, BLOCK, 32):
            answered += _check(probe, text, n=n)
    assert answered > 40


def test_sharegpt_texts_cut_anywhere(probe: HeadProbe) -> None:
    convs = json.loads((REPO / "loadtest" / "data" / "traces" / "sharegpt_multiturn_150.json").read_text())
    rng = random.Random(7)
    texts = [t["value"] for c in convs for t in c["conversations"] if len(t["value"]) > 300]
    answered = 0
    for text in rng.sample(texts, 300):
        start = rng.randrange(0, len(text) // 2)
        answered += _check(probe, text[start:], add_special=rng.random() < 0.5, n=rng.choice((BLOCK, 32, 64)))
    assert answered > 250


@pytest.mark.parametrize(
    ("text", "answers"),
    [
        ("word " * 40 + " " * 500 + "tail", True),  # a whitespace run across the first cut
        ("a" * 300 + " b" * 200, True),  # a word longer than the first probe
        ("x" * (MAX_PROBE_CHARS * 2), False),  # one word longer than any probe: the full path is taken
        ("我们今天讨论缓存路由的设计。" * 60, True),  # CJK: under two characters per token, words end at "。"
        ("我们今天讨论缓存路由的设计" * 60, False),  # CJK without punctuation is one word: the full path
        ("cafe\u0301 " * 200, True),  # combining marks the NFC normalizer composes
        ("<|im_start|>user\n" + "Hello there. " * 19 + "<|im_end|>" * 30, True),  # added tokens around the cut
        ("\n\n\n" * 100 + "text " * 100, True),
        ("123456789" * 100, True),
        ("It's what they'd've done. " * 40, True),
    ],
)
def test_adversarial_cuts(probe: HeadProbe, text: str, answers: bool) -> None:
    """Each text gets the exact first block from a prefix, unless no prefix up to
    ``MAX_PROBE_CHARS`` ends at a word boundary."""
    assert _check(probe, text) == answers


def test_cut_never_splits_an_added_token(probe: HeadProbe) -> None:
    text = "abc<|im_start|>def"
    for cut in range(len(text) + 1):
        moved = probe.tok.cut_outside_added(text, cut)
        assert moved == (3 if 3 < cut < 15 else cut)


def test_mismatch_disables_the_probe() -> None:
    probe = HeadProbe(PromptTokenizer.load(str(QWEN3_DIR), verify_rate=0.0))
    before = REGISTRY.get_sample_value("kvrouter_cold_head_mismatches_total", {"model": probe.model}) or 0.0
    assert probe.check([1, 2, 3], [1, 2, 3, 4])
    assert probe.enabled
    assert not probe.check([1, 2, 3], [1, 2, 4, 4])
    assert not probe.enabled and "mismatch" in (probe.disabled_reason or "")
    assert REGISTRY.get_sample_value("kvrouter_cold_head_mismatches_total", {"model": probe.model}) == before + 1


def test_scan_counts_what_encode_would_tokenize_and_gives_the_exact_head() -> None:
    tok = PromptTokenizer.load(str(QWEN3_DIR), verify_rate=0.0)
    history = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n" + "old words " * 300 + "<|im_end|>\n"
    tok.encode(history)
    whole = tok.scan(history, False)
    assert whole.complete and whole.uncached_chars == 0 and whole.head == tok.encode_full(history)
    turn = "<|im_start|>user\nsomething new<|im_end|>\n<|im_start|>assistant\n"
    text = history + turn
    for _ in range(2):  # peek did not insert
        scan = tok.scan(text, False)
        assert scan.uncached_chars == len("user\nsomething new") + len("assistant\n")
        assert not scan.complete and scan.head_chars == len(history) + len("<|im_start|>")
        assert scan.head == tok.encode_full(text[: scan.head_chars])
        assert tok.encode_full(text)[: len(scan.head)] == scan.head
    assert tok.scan("never seen " * 50, False) == Scan(len("never seen " * 50), [], 0)
