"""Workloads: determinism, the Mooncake block mapping, growing chats, shared prefixes, JSONL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import workloads as w
from router.prompt.tokenize import load_tokenizer
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


def test_a_faster_clock_multiplies_a_multi_turn_workloads_request_rate() -> None:
    """Session starts and think times scale alike: every turn's arrival (at zero latency) comes
    ``k`` times sooner, so the rate is ``k`` times higher; the span counts each session's
    thinks, not only its start."""
    wl = w.mixed(w.MixedSpec(), seed=0, max_requests=200)
    arrivals = sorted(s.start_s + sum(t.think_s for t in s.turns[1:i + 1]) for s in wl.sessions
                      for i in range(len(s.turns)))
    assert wl.duration_s == pytest.approx(arrivals[-1] - arrivals[0])
    assert wl.duration_s > 1.5 * (wl.sessions[-1].start_s - wl.sessions[0].start_s)  # the thinks matter here
    fast = wl.rate_scaled(3.0)
    assert fast.arrival_rate == pytest.approx(wl.arrival_rate * 3)
    for s, f in zip(wl.sessions, fast.sessions):
        assert [t.think_s / 3 for t in s.turns] == pytest.approx([t.think_s for t in f.turns])
        assert [t.body for t in s.turns] == [t.body for t in f.turns]


def test_ideal_cached_tokens_counts_prefix_blocks_and_never_the_whole_prompt() -> None:
    a = list(range(64))
    assert w.ideal_cached_tokens([a, a], 16) == (48, 128)  # 4 blocks seen, 3 reusable (last token)
    b = a[:32] + [999] * 32
    assert w.ideal_cached_tokens([a, b], 16) == (32, 128)
    c = [7] * 16 + a[16:]  # first block differs: nothing after it can hit
    assert w.ideal_cached_tokens([a, c], 16) == (0, 128)


# -- mixed agentic and multi-tenant traffic --------------------------------------------------


def _kind(session: w.Session) -> str:
    return session.session_id.split("-")[1]


def _prompts(wl: w.Workload) -> list[list[int]]:
    return [t.body["prompt"] for t in wl.turns()]


def test_mixed_is_deterministic_per_seed_and_differs_across_seeds() -> None:
    a, b = w.mixed(seed=1001, max_requests=120), w.mixed(seed=1001, max_requests=120)
    assert [(s.session_id, s.start_s, s.turns) for s in a.sessions] == [(s.session_id, s.start_s, s.turns) for s in b.sessions]
    c = w.mixed(seed=1002, max_requests=120)
    assert [s.start_s for s in c.sessions] != [s.start_s for s in a.sessions]
    assert not set(map(tuple, _prompts(a))) & set(map(tuple, _prompts(c)))
    assert a.num_requests == c.num_requests == 120


def test_tuning_and_held_out_seeds_are_disjoint_and_named() -> None:
    assert w.TUNING_SEEDS and w.HELD_OUT_SEEDS and not set(w.TUNING_SEEDS) & set(w.HELD_OUT_SEEDS)
    assert w.mixed(seed=w.HELD_OUT_SEEDS[0], max_requests=5).name == f"mixed (seed {w.HELD_OUT_SEEDS[0]}, held-out)"
    assert w.mixed(seed=w.TUNING_SEEDS[0], max_requests=5).name.endswith("tuning)")
    assert w.seed_set(77) == "other"


def test_mixed_request_fractions_follow_the_mix() -> None:
    wl = w.mixed(seed=3)
    share = {k: sum(len(s.turns) for s in wl.sessions if _kind(s) == k) / wl.num_requests for k in w.MIXED_KINDS}
    for kind in w.MIXED_KINDS:
        assert share[kind] == pytest.approx(getattr(w.MixedSpec(), kind), abs=0.08), share
    only_agents = w.mixed(w.MixedSpec(chat=0, agent=1, rag=0, oneoff=0), seed=3, max_requests=100)
    assert {_kind(s) for s in only_agents.sessions} == {"agent"}
    mostly_rag = w.mixed(w.MixedSpec(rag=0.9, chat=0.1, agent=0, oneoff=0), seed=3, max_requests=200)
    assert sum(_kind(s) == "rag" for s in mostly_rag.sessions) > 0.8 * len(mostly_rag.sessions)


def test_mixed_sessions_grow_and_share_their_prefixes() -> None:
    wl = w.mixed(seed=5, max_requests=400)
    for s in wl.sessions:
        prompts = [t.body["prompt"] for t in s.turns]
        for before, after in zip(prompts, prompts[1:]):
            assert after[: len(before)] == before and len(after) > len(before)
        assert all(t.think_s > 0 for t in s.turns[1:])
    agents = [s.turns[0].body["prompt"] for s in wl.sessions if _kind(s) == "agent"]
    # Every agent loop starts with one system prompt; loops over the same context share it too.
    heads = {tuple(p[:256]) for p in agents}
    assert len(heads) == 1 and len(agents) > 5
    contexts = [tuple(p[:4096]) for p in agents]
    assert len(set(contexts)) < len(contexts)
    cached, total = w.ideal_cached_tokens(_prompts(wl), 16)
    assert 0.5 < cached / total < 0.95


def test_mixed_knobs_scale_contexts_and_burstiness() -> None:
    base = w.mixed(w.MixedSpec(chat=0, agent=1, rag=0, oneoff=0), seed=7, max_requests=100)
    longer = w.mixed(w.MixedSpec(chat=0, agent=1, rag=0, oneoff=0, context_tokens=16384), seed=7, max_requests=100)

    def first_turns(wl: w.Workload) -> float:
        return sum(len(s.turns[0].body["prompt"]) for s in wl.sessions) / len(wl.sessions)

    assert first_turns(longer) > 1.5 * first_turns(base)
    small = w.mixed(w.MixedSpec(length_scale=0.25), seed=7, max_requests=200)
    assert first_turns(small) < 0.35 * first_turns(w.mixed(seed=7, max_requests=200))

    def gaps_cv(spec: w.MixedSpec) -> float:
        starts = [s.start_s for s in w.mixed(spec, seed=7, max_requests=3000).sessions]
        gaps = [b - a for a, b in zip(starts, starts[1:])]
        m = sum(gaps) / len(gaps)
        return (sum((g - m) ** 2 for g in gaps) / len(gaps)) ** 0.5 / m

    one_turn = {"chat": 0, "agent": 0, "rag": 1, "oneoff": 1, "requests": 3000}
    poisson = gaps_cv(w.MixedSpec(**one_turn, burst_fraction=0))
    bursty = gaps_cv(w.MixedSpec(**one_turn, burst_factor=8, burst_fraction=0.2))
    assert poisson == pytest.approx(1.0, abs=0.1) and bursty > poisson + 0.2


def test_mixed_chat_form_sends_the_same_structure_as_messages() -> None:
    wl = w.mixed(w.MixedSpec(form="chat"), seed=9, max_requests=60)
    tok = load_tokenizer(str(QWEN3_DIR))
    for s in wl.sessions:
        assert all(t.path == w.CHAT for t in s.turns)
        roles = [m["role"] for m in s.turns[-1].body["messages"]]
        assert (roles[0] == "system") == (_kind(s) != "oneoff") and all(a != b for a, b in zip(roles, roles[1:]))
        ids = [w.prompt_ids(t, tok) for t in s.turns]
        for before, after in zip(ids, ids[1:]):
            assert len(after) > len(before)


def test_mixed_knobs_from_the_command_line_are_parsed_and_checked(tmp_path: Path) -> None:
    spec = w.MixedSpec.with_overrides({"agent": "0.5", "context_tokens": "16384", "form": "chat"})
    assert (spec.agent, spec.context_tokens, spec.form) == (0.5, 16384, "chat")
    with pytest.raises(w.WorkloadError, match="unknown mixed workload keys"):
        w.MixedSpec.with_overrides({"agnet": "1"})
    with pytest.raises(w.WorkloadError, match="context_tokens"):
        w.MixedSpec.with_overrides({"context_tokens": "1.5"})
    with pytest.raises(w.WorkloadError, match="fractions"):
        w.MixedSpec.with_overrides({"chat": 0, "agent": 0, "rag": 0, "oneoff": 0})
    path = tmp_path / "spec.mixed.json"
    path.write_text(json.dumps({"tenants": 3, "rate": 2.0}))
    assert w.detect_format(path) == "mixed"
    wl = w.load(path, seed=1001, max_requests=30, mix={"oneoff": "1", "chat": "0", "agent": "0", "rag": "0"})
    assert wl.num_requests == 30 and {_kind(s) for s in wl.sessions} == {"oneoff"}


def test_a_noisy_tenant_names_every_session_and_starts_x_times_each_others_sessions() -> None:
    """``noisy_tenant=X``: every body names its tenant in ``user`` (what the router's queue takes
    turns between) and every session id carries it; tenant-0 starts ~X times the sessions of each
    other tenant. Leaving tenant-0 out keeps the others' sessions exactly as they were."""
    spec = w.MixedSpec(noisy_tenant=10.0)
    wl = w.mixed(spec, seed=3, max_requests=2000)
    tenants = [w.tenant_of(s.session_id) for s in wl.sessions]
    assert all(t is not None and t.startswith("tenant-") for t in tenants)
    assert all(turn.body["user"] == w.tenant_of(s.session_id) for s in wl.sessions for turn in s.turns)
    noisy = tenants.count("tenant-0")
    others = (len(tenants) - noisy) / (spec.tenants - 1)
    assert 6 < noisy / others < 16
    quiet = w.without_tenant(wl, "tenant-0")
    assert [s for s in wl.sessions if w.tenant_of(s.session_id) != "tenant-0"] == quiet.sessions
    with pytest.raises(w.WorkloadError, match="no session of tenant"):
        w.without_tenant(quiet, "tenant-0")
    # Off (the default), bodies name no tenant and the workload is what it always was.
    plain = w.mixed(w.MixedSpec(), seed=3, max_requests=200)
    assert all("user" not in t.body and "@" not in s.session_id for s in plain.sessions for t in s.turns)
    with pytest.raises(w.WorkloadError, match="noisy_tenant"):
        w.MixedSpec(noisy_tenant=-1.0).validate()
