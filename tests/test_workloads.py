"""Workloads: determinism, the Mooncake block mapping, growing chats, shared prefixes, JSONL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import workloads as w
from router.tokenize import load_tokenizer
from support import QWEN3_DIR, REPO

MOONCAKE = REPO / "loadtest" / "data" / "traces" / "mooncake_conversation_head1500.jsonl"
SHAREGPT = REPO / "loadtest" / "data" / "traces" / "sharegpt_multiturn_150.json"


def _mooncake_rows(n: int) -> list[dict]:
    with open(MOONCAKE) as fh:
        return [json.loads(next(fh)) for _ in range(n)]


def test_mooncake_shared_hash_ids_become_shared_token_prefixes() -> None:
    rows = _mooncake_rows(40)
    wl = w.load_mooncake(MOONCAKE, max_requests=40)
    prompts = [s.turns[0].body["prompt"] for s in wl.sessions]
    assert [len(p) for p in prompts] == [r["input_length"] for r in rows]
    # Blocks with the same hash id are the same tokens; different ids differ.
    blocks: dict[int, list[int]] = {}
    for r, p in zip(rows, prompts):
        for i, h in enumerate(r["hash_ids"]):
            chunk = p[i * 512:(i + 1) * 512]
            ref = blocks.setdefault(h, chunk)
            n = min(len(ref), len(chunk))
            assert ref[:n] == chunk[:n]
    first = {r["hash_ids"][0] for r in rows}
    assert first == {0}  # every conversation request starts with the same block
    assert blocks[0] != blocks[1]


def test_mooncake_keeps_timestamps_output_lengths_and_scales() -> None:
    rows = _mooncake_rows(20)
    wl = w.load_mooncake(MOONCAKE, max_requests=20, length_scale=0.25, output_scale=0.5)
    assert [s.start_s for s in wl.sessions] == sorted(r["timestamp"] / 1000 for r in rows)
    for r, s in zip(rows, wl.sessions):
        body = s.turns[0].body
        assert len(body["prompt"]) == max(1, round(r["input_length"] * 0.25))
        assert body["max_tokens"] == max(1, round(r["output_length"] * 0.5))
        assert body["ignore_eos"] is True


def test_mooncake_is_deterministic_per_seed() -> None:
    a = w.load_mooncake(MOONCAKE, max_requests=5, seed=1)
    b = w.load_mooncake(MOONCAKE, max_requests=5, seed=1)
    c = w.load_mooncake(MOONCAKE, max_requests=5, seed=2)
    assert a.sessions == b.sessions
    assert a.sessions[0].turns[0].body["prompt"] != c.sessions[0].turns[0].body["prompt"]


def test_mooncake_text_prompts_tokenize_back_to_the_same_ids() -> None:
    ids = w.load_mooncake(MOONCAKE, max_requests=3, length_scale=0.5)
    text = w.load_mooncake(MOONCAKE, max_requests=3, length_scale=0.5, prompt_form="text")
    tok = load_tokenizer(str(QWEN3_DIR))
    for a, b in zip(ids.turns(), text.turns()):
        assert isinstance(b.body["prompt"], str)
        assert tok.completion_ids(b.body)[0] == a.body["prompt"]


def test_mooncake_bad_lines_are_skipped_and_counted(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    good = '{"timestamp": 5, "input_length": 10, "output_length": 3, "hash_ids": [1]}'
    p.write_text("\n".join([good, "not json", '{"timestamp": 1}', '{"timestamp": 1, "input_length": 0, '
                            '"output_length": 1, "hash_ids": [2]}', good]) + "\n")
    wl = w.load_mooncake(p)
    assert wl.num_requests == 2
    assert wl.skipped == 3


def test_empty_or_missing_trace_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(w.WorkloadError, match="cannot read"):
        w.load_mooncake(tmp_path / "missing.jsonl")
    (tmp_path / "e.jsonl").write_text("garbage\n")
    with pytest.raises(w.WorkloadError, match="no usable request"):
        w.load_mooncake(tmp_path / "e.jsonl")


def test_sharegpt_history_grows_turn_by_turn_with_recorded_answers() -> None:
    wl = w.load_sharegpt(SHAREGPT, max_requests=60, think_s=3.0)
    multi = [s for s in wl.sessions if len(s.turns) >= 2]
    assert multi, "the sample holds multi-turn conversations"
    data = {c["id"]: c for c in json.loads(SHAREGPT.read_text())}
    s = multi[0]
    conv = data[s.session_id.removeprefix("sg-")]["conversations"]
    first, second = s.turns[0].body["messages"], s.turns[1].body["messages"]
    assert first == [{"role": "user", "content": conv[0]["value"]}]
    assert second[:2] == [*first, {"role": "assistant", "content": conv[1]["value"]}]
    assert second[2] == {"role": "user", "content": conv[2]["value"]}
    assert s.turns[0].think_s == 0.0 and s.turns[1].think_s > 0
    assert [x.start_s for x in wl.sessions] == sorted(x.start_s for x in wl.sessions)
    assert wl.num_requests == 60


def test_sharegpt_max_tokens_is_the_recorded_answer_length() -> None:
    wl = w.load_sharegpt(SHAREGPT, max_requests=5, max_output_tokens=100000)
    tok = load_tokenizer(str(QWEN3_DIR))
    s = wl.sessions[0]
    conv = json.loads(SHAREGPT.read_text())[0]["conversations"]
    assert s.turns[0].body["max_tokens"] == len(tok.encode(conv[1]["value"]))


def test_synthetic_groups_share_their_system_prompt_and_docs_are_reused() -> None:
    spec = w.SyntheticSpec(groups=3, questions=4, prefix_tokens=64, suffix_tokens=8, num_docs=5,
                           docs_per_request=2, doc_tokens=32, rate=10.0)
    wl = w.synthetic(spec, seed=3)
    assert wl.num_requests == 12
    systems = {}
    for s in wl.sessions:
        g = s.session_id.split("-")[1]
        systems.setdefault(g, set()).add(s.turns[0].body["messages"][0]["content"])
    assert len(systems) == 3 and all(len(v) == 1 for v in systems.values())
    assert len({next(iter(v)) for v in systems.values()}) == 3
    tok = load_tokenizer(str(QWEN3_DIR))
    cached, total = w.ideal_cached_tokens((w.prompt_ids(t, tok) for t in wl.turns()), 16)
    assert 0.3 < cached / total < 0.95
    assert w.synthetic(spec, seed=3).sessions == wl.sessions


def test_synthetic_spec_rejects_unknown_keys(tmp_path: Path) -> None:
    p = tmp_path / "spec.json"
    p.write_text('{"groups": 2, "colour": 1}')
    with pytest.raises(w.WorkloadError, match="colour"):
        w.SyntheticSpec.from_file(p)


def test_jsonl_bodies_timestamps_and_sessions(tmp_path: Path) -> None:
    p = tmp_path / "b.jsonl"
    lines = [
        {"timestamp": 0.0, "session_id": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        {"timestamp": 1.5, "prompt": "hello", "max_tokens": 2, "model": "ignored"},
        {"timestamp": 2.0, "session_id": "a", "messages": [{"role": "user", "content": "again"}]},
        {"nothing": True},
    ]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    wl = w.load(p)
    assert wl.name == "jsonl" and wl.skipped == 1
    a = next(s for s in wl.sessions if s.session_id == "a")
    assert [t.path for t in a.turns] == [w.CHAT, w.CHAT] and a.turns[1].think_s == 2.0
    other = next(s for s in wl.sessions if s.session_id != "a")
    assert other.turns[0].path == w.COMPLETIONS and "model" not in other.turns[0].body and other.start_s == 1.5


def test_detect_format() -> None:
    assert w.detect_format(MOONCAKE) == "mooncake"
    assert w.detect_format(SHAREGPT) == "sharegpt"
    assert w.detect_format("default") == "synthetic"


def test_head_and_rate_scale() -> None:
    wl = w.load_mooncake(MOONCAKE, max_requests=50)
    assert wl.head(10).num_requests == 10
    fast = wl.rate_scaled(2.0)
    assert fast.duration_s == pytest.approx(wl.duration_s / 2)
    assert fast.arrival_rate == pytest.approx(wl.arrival_rate * 2)


def test_ideal_cached_tokens_counts_prefix_blocks_and_never_the_whole_prompt() -> None:
    a = list(range(64))
    assert w.ideal_cached_tokens([a, a], 16) == (48, 128)  # 4 blocks seen, 3 reusable (last token)
    b = a[:32] + [999] * 32
    assert w.ideal_cached_tokens([a, b], 16) == (32, 128)
    c = [7] * 16 + a[16:]  # first block differs: nothing after it can hit
    assert w.ideal_cached_tokens([a, c], 16) == (0, 128)
