"""The history memo (router/prompt/history.py).

Real Qwen3 tokenizer and chat template, real conversations (ShareGPT): what the memo
learns from one turn must be a prefix of the next turn's real block keys.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from indexer.hashing import BlockHasher
from router.prompt.hash_cache import HashCache
from router.prompt.history import MAX_MISMATCHES, Chain, Entry, HistoryMemo, chain_of, learn_entries
from router.prompt.tokenize import PromptTokenizer
from support import REPO

BLOCK = 16
MODEL = "qwen3-0.6b"
SHAREGPT = REPO / "loadtest" / "data" / "traces" / "sharegpt_multiturn_150.json"


@pytest.fixture(scope="module")
def hashes() -> HashCache:
    return HashCache(BlockHasher("sha256", BLOCK, "0", "0.33.0"))


def conversations(limit: int) -> list[list[dict[str, str]]]:
    convs = []
    for conv in json.loads(SHAREGPT.read_text())[:limit]:
        roles = {"human": "user", "gpt": "assistant"}
        msgs = [{"role": roles.get(t["from"], "user"), "content": t["value"]} for t in conv["conversations"]]
        convs.append([{"role": "system", "content": "You are a helpful assistant."}, *msgs])
    return convs


def keys_of(qwen3: PromptTokenizer, hashes: HashCache, body: dict[str, Any]) -> tuple[str, list[int]]:
    text = qwen3.render_chat(body)
    return text, hashes.hash_int64(qwen3.encode(text))


# -- chain_of ---------------------------------------------------------------------------


def test_chain_keys_each_message_boundary_and_only_prompt_fields() -> None:
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    chain = chain_of({"model": MODEL, "messages": msgs, "max_tokens": 5, "temperature": 0.3, "stream": True})
    assert chain is not None and len(chain.hashes) == 3 and len(set(chain.hashes)) == 3
    assert chain.sizes == sorted(chain.sizes) and chain.sizes[0] > 0
    # Sampling fields do not change the keys; a longer conversation extends the same chain.
    longer = chain_of({"model": MODEL, "messages": [*msgs, {"role": "assistant", "content": "d"}], "max_tokens": 9})
    assert longer is not None and longer.hashes[:3] == chain.hashes
    # Fields that shape the prompt do, and so does the model (a LoRA adapter hashes differently).
    for change in ({"chat_template_kwargs": {"enable_thinking": False}}, {"cache_salt": "s"}, {"tools": [{"type": "function"}]},
                   {"model": "adapter"}, {"add_generation_prompt": False}):
        other = chain_of({"model": MODEL, "messages": msgs, **change})
        assert other is not None and not set(other.hashes) & set(chain.hashes), change
    assert chain_of({"model": MODEL, "messages": msgs[:1]}).hashes[0] == chain.hashes[0]  # type: ignore[union-attr]


@pytest.mark.parametrize("body", [
    {"model": MODEL},
    {"model": MODEL, "messages": []},
    {"model": MODEL, "messages": "hi"},
    {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "truncate_prompt_tokens": 5},
    {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                                               {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
])
def test_chain_is_none_for_bodies_the_memo_cannot_key(body: dict[str, Any]) -> None:
    assert chain_of(body) is None


# -- HistoryMemo --------------------------------------------------------------------------


def test_memo_finds_the_longest_prefix_and_stays_bounded() -> None:
    memo = HistoryMemo(MODEL, max_keys=10)
    chain = Chain([11, 22, 33, 44], [10, 20, 30, 40])
    assert memo.find(chain) is None
    memo.put(11, Entry([1, 2], 40, 10))
    memo.put(33, Entry([1, 2, 3, 4], 70, 30))
    hit = memo.find(chain)
    assert hit is not None and (hit.key, hit.messages, hit.entry.keys) == (33, 3, [1, 2, 3, 4])
    # The estimate scales the messages past the entry by its tokens per byte.
    assert hit.estimate(chain) == 70 + round(10 * 70 / 30)
    memo.put(55, Entry(list(range(6)), 100, 50))  # 12 keys held: the least recently used goes
    assert 11 not in memo and 33 in memo and 55 in memo
    memo.put(11, Entry([1, 2], 40, 10))  # 12 keys again: 33 is now the least recently used
    assert 33 not in memo and 55 in memo and 11 in memo
    hit = memo.find(Chain([55], [50]))
    assert hit is not None
    memo.touch(hit)  # routed on: 55 refreshed, 11 is now the oldest
    memo.put(77, Entry([5, 6, 7], 40, 10))
    assert 11 not in memo and 55 in memo and 77 in memo
    memo.put(66, Entry([], 3, 5))  # nothing to route on: not stored
    assert 66 not in memo


def test_a_mismatch_drops_the_entry_and_persistent_ones_turn_the_memo_off() -> None:
    memo = HistoryMemo(MODEL)
    mismatches = 0
    for i in range(200):
        memo.put(i, Entry([i, i + 1], 40, 10))
        hit = memo.find(Chain([i], [10]))
        assert hit is not None
        wrong = i % 50 == 0  # a rare stale entry: 4 in 200 checks (2%)
        assert memo.check(hit, [i + 7, 0, 0] if wrong else [i, i + 1, 9]) is not wrong
        mismatches += wrong
        assert (i in memo) is not wrong
    assert memo.enabled and memo.mismatches == mismatches == 4
    failing = 0
    while memo.enabled:  # now every check fails: off once mismatches pass 5% of the checks
        memo.put(1000, Entry([1], 40, 10))
        hit = memo.find(Chain([1000], [10]))
        assert hit is not None and not memo.check(hit, [2])
        failing += 1
    assert failing == 7 and memo.mismatches * 20 > memo.checks  # 11 of 207
    assert len(memo) == 0 and memo.find(Chain([1000], [10])) is None
    memo.put(1000, Entry([1], 40, 10))
    assert len(memo) == 0
    # It starts over after a while, counts reset.
    memo.off_for_s = 0.0
    memo._off_until = 1e-9
    assert memo.enabled and memo.checks == memo.mismatches == 0
    # Few checks: a mismatch or two is not enough.
    young = HistoryMemo(MODEL)
    for _ in range(MAX_MISMATCHES - 1):
        young.put(1, Entry([1], 40, 10))
        young.check(young.find(Chain([1], [10])), [2])  # type: ignore[arg-type]
    assert young.enabled


# -- learn_entries: real template, real conversations -------------------------------------


def test_what_a_turn_teaches_is_a_prefix_of_the_next_turns_real_keys(qwen3: PromptTokenizer, hashes: HashCache) -> None:
    """For every turn of 40 conversations: the entry learned from the request is a prefix of
    the keys of the next request (its messages plus the answer and a new question), and
    the entry for all but its last message is a prefix of that history with another last
    message; both cover all of the shared prompt but for less than two blocks."""
    memo = HistoryMemo(MODEL)
    checked = 0
    for conv in conversations(40):
        for n in range(2, len(conv) - 1):
            if [m["role"] for m in conv[n - 1 : n + 2]] != ["user", "assistant", "user"]:
                continue  # a chat request ends with a question; its next turn adds an answer and one
            body = {"model": MODEL, "messages": conv[:n]}
            text, keys = keys_of(qwen3, hashes, body)
            chain = chain_of(body)
            assert chain is not None
            learned = dict(learn_entries(qwen3, memo, chain, body, text, False, keys, BLOCK))
            nxt = {"model": MODEL, "messages": conv[: n + 2]}
            _, next_keys = keys_of(qwen3, hashes, nxt)
            entry = learned.get(chain.hashes[-1])
            if entry is not None:
                assert next_keys[: len(entry.keys)] == entry.keys
                assert len(entry.keys) >= min(len(keys), len(next_keys)) - 2
                checked += 1
            other = {"model": MODEL, "messages": [*conv[: n - 1], {"role": "user", "content": "something else entirely"}]}
            _, other_keys = keys_of(qwen3, hashes, other)
            entry = learned.get(chain.hashes[-2])
            if entry is not None:
                assert other_keys[: len(entry.keys)] == entry.keys
            for k, e in learned.items():
                memo.put(k, e)
    assert checked >= 60


def test_a_template_that_rewrites_earlier_text_teaches_nothing(qwen3: PromptTokenizer, hashes: HashCache) -> None:
    """A template that renders the message count first shares nothing with the next turn,
    and one that moves the system prompt to the last user turn shares only the text
    before it: neither keeps an entry for the next turn (the segment cache does better)."""
    counting = copy.copy(qwen3)
    counting._hf = copy.copy(qwen3._hf)
    counting._templates = {}
    counting._hf.chat_template = "{{ messages|length }} messages<|im_end|>\n" + qwen3._hf.chat_template
    moving = copy.copy(counting)
    moving._hf = copy.copy(qwen3._hf)
    moving._templates = {}
    moving._hf.chat_template = (
        "{% for m in messages %}{% if m.role != 'system' %}<|im_start|>{{ m.role }}\n"
        "{% if loop.last %}{{ messages[0].content }} {% endif %}{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
        "<|im_start|>assistant\n"
    )
    conv = conversations(3)[2]
    body = {"model": MODEL, "messages": conv[:4]}
    chain = chain_of(body)
    assert chain is not None
    for t in (counting, moving):
        text, keys = keys_of(t, hashes, body)
        learned = dict(learn_entries(t, HistoryMemo(MODEL), chain, body, text, False, keys, BLOCK))
        assert chain.hashes[-1] not in learned


def test_tool_loops_teach_only_prefixes_of_every_continuation(qwen3: PromptTokenizer, hashes: HashCache) -> None:
    """Qwen3 keeps the reasoning of assistant turns after the last user question when a
    tool result follows, strips it when a user message follows, and joins consecutive
    tool results in one turn. Whatever the memo learns from an agent's requests must be
    a prefix of the real keys of each way the conversation can go on."""
    long = "lorem ipsum dolor sit amet " * 20
    sysm = {"role": "system", "content": "You are helpful. " * 30}
    u1 = {"role": "user", "content": "Question one " + long}

    def calls(i: int) -> list[dict[str, Any]]:
        return [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": '{"x": %d}' % i}}]

    def tool(i: int) -> dict[str, Any]:
        return {"role": "tool", "content": f"result {i} " + long, "tool_call_id": f"c{i}"}

    a1 = {"role": "assistant", "content": "<think>\nreasoning " + long + "\n</think>\n\nok", "tool_calls": calls(1)}
    a2 = {"role": "assistant", "content": "<think>\nmore " + long + "\n</think>\n\nok2", "tool_calls": calls(2)}
    requests = [[sysm, u1], [sysm, u1, a1, tool(1)], [sysm, u1, a1, tool(1), tool(2)], [sysm, u1, a1, tool(1), a2, tool(2)]]
    goes_on = [[a2, tool(3)], [tool(3)], [{"role": "user", "content": "never mind " + long}],
               [{"role": "assistant", "content": "final " + long}, {"role": "user", "content": "thanks " + long}]]
    hits = 0
    for messages in requests:
        memo = HistoryMemo(MODEL)
        body = {"model": MODEL, "messages": messages}
        text, keys = keys_of(qwen3, hashes, body)
        for key, entry in learn_entries(qwen3, memo, chain_of(body), body, text, False, keys, BLOCK):  # type: ignore[arg-type]
            memo.put(key, entry)
        for more in goes_on:
            for nxt in ([*messages, *more], [*messages[:-1], *more]):
                hit = memo.find(chain_of({"model": MODEL, "messages": nxt}))  # type: ignore[arg-type]
                if hit is not None:
                    _, real = keys_of(qwen3, hashes, {"model": MODEL, "messages": nxt})
                    assert real[: len(hit.entry.keys)] == hit.entry.keys, (len(messages), more)
                    hits += 1
    assert hits >= 4  # the plain chat turn, at least, is learned


def test_shared_tokens_counts_up_to_the_last_added_token_certainly_shared(qwen3: PromptTokenizer) -> None:
    a = "hello <|im_start|>user\n" + "x" * 40 + "<|im_end|>\n<|im_start|>assistant\n" + "more words " * 5
    full = qwen3.encode(a)
    start, end = qwen3.segments.added["<|im_start|>"], qwen3.segments.added["<|im_end|>"]
    last = len(full) - 1 - full[::-1].index(start)
    longest = max(map(len, qwen3.segments.added))
    at = a.rindex("<|im_start|>")
    after = at + len("<|im_start|>")
    # Differing far enough after the last <|im_start|>: everything through it is shared.
    assert qwen3.shared_tokens(a, a[: at + longest] + "different", False) == (last + 1, after)
    assert qwen3.shared_tokens(a, a[: at + longest - 1] + "different", False) == (full.index(end) + 1, a.index("<|im_end|>") + 10)
    # Differing right after it: which added token starts there depends on text past the
    # difference (a longer one could match), so neither it nor <|im_end|> just before counts.
    assert qwen3.shared_tokens(a, a[: at + 3] + "different", False) == (full.index(start) + 1, a.index("user"))
    assert qwen3.shared_tokens(a, a, False) == (last + 1, after)  # the text after the last added token never counts
    assert qwen3.shared_tokens("plain text", "plain other", False) == (0, 0)
    # The counted ids are exactly the ids of the counted characters.
    n, chars = qwen3.shared_tokens(a, a[: at + longest] + "different", False)
    assert qwen3.encode_full(a[:chars]) == full[:n]
