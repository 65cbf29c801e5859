"""router.prompt.chat_template renders like transformers' apply_chat_template (what vLLM calls), and
router.prompt.fast_sandbox's memoizing sandbox like jinja2's stock one, refusals included.

The byte-identical check against vLLM itself is tests/test_tokenize.py's golden
renderings; the mutants below show that those renderings notice a wrong environment.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from router.prompt import chat_template
from router.prompt.chat_render import normalize_messages, normalize_tools
from router.prompt.chat_template import ENVIRONMENT, ChatTemplate, build_environment
from router.prompt.fast_sandbox import MemoSandbox
from router.prompt.prompt_fields import TokenizeError
from router.prompt.tokenize import PromptTokenizer
from support import GOLDEN, QWEN3_DIR, REPO

SHAREGPT = REPO / "loadtest" / "data" / "traces" / "sharegpt_multiturn_150.json"
GOLDEN_CHATS = [
    c for c in map(json.loads, (GOLDEN / "render_vectors_vllm-0.33.0_qwen3-0.6b-tok.jsonl").read_text().splitlines())
    if c["endpoint"] == "chat" and c["prompt_token_ids"] is not None and c["request"].get("truncate_prompt_tokens") is None
]


def conversations(limit: int) -> list[list[dict[str, str]]]:
    roles = {"human": "user", "gpt": "assistant"}
    return [
        [{"role": "system", "content": "You are a helpful assistant."},
         *({"role": roles.get(t["from"], "user"), "content": t["value"]} for t in conv["conversations"])]
        for conv in json.loads(SHAREGPT.read_text())[:limit]
    ]


@functools.cache
def compiled(source: str, tok: PromptTokenizer) -> ChatTemplate:
    return ChatTemplate(source, tok._hf.special_tokens_map)


def both(tok: PromptTokenizer, source: str, messages: list[dict[str, Any]], **kw: Any) -> list[str]:
    """What ChatTemplate and apply_chat_template render (or the error each raises)."""
    conversation = normalize_messages(messages, content_format="string", template_has_developer=True)
    tools = kw.pop("tools", None)
    agp, cfm = kw.pop("add_generation_prompt", True), kw.pop("continue_final_message", False)
    out = []
    for render in (
        lambda: compiled(source, tok).render(
            conversation, tools=tools, add_generation_prompt=agp, continue_final_message=cfm, kwargs=kw
        ),
        lambda: tok._hf.apply_chat_template(
            conversation, tools=tools, chat_template=source, add_generation_prompt=agp, continue_final_message=cfm,
            tokenize=False, **kw,
        ),
    ):
        try:
            out.append(render())
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            out.append(f"{type(e).__name__}: {str(e)[:60]}")
    return out


def test_renders_like_apply_chat_template_on_real_conversations(qwen3: PromptTokenizer) -> None:
    source = qwen3._hf.chat_template
    tools = normalize_tools([{"type": "function", "function": {"name": "f", "description": "é <b>", "parameters": {"z": 1, "a": 2}}}])
    rendered = 0
    for conv in conversations(30):
        for n in (2, 3, len(conv)):
            msgs = conv[:n]
            for kw in ({}, {"tools": tools}, {"add_generation_prompt": False, "enable_thinking": False}):
                a, b = both(qwen3, source, msgs, **kw)
                assert a == b
            if msgs[-1]["role"] == "assistant":
                a, b = both(qwen3, source, msgs, add_generation_prompt=False, continue_final_message=True)
                assert a == b and not a.startswith("ValueError")
            rendered += 1
    assert rendered >= 80


@pytest.mark.parametrize("source", [
    "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}",
    "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}{{ eos_token }}",
    "{{ tools|tojson }}|{{ tools|tojson(indent=2) }}|{{ {'b': '<é>', 'a': 1}|tojson }}",
    "{{ strftime_now('%Y') }} {{ messages[-1].content }}",
    "{% if messages|length > 1 %}{{ raise_exception('only one message, please') }}{% endif %}{{ messages[0].content }}",
    "  {% if true %}\n    {{ messages[0].role }}\n  {% endif %}\n{{ messages[0].content }}",
    "{{ messages[0].content }}",  # no "content" continue check: the tag is in the template text
    "{% for m in messages %}{{ m.content|trim }}{% endfor %}",
])
def test_environment_matches_transformers(qwen3: PromptTokenizer, source: str) -> None:
    """Extensions, filters, globals, whitespace options and the continue-final cut."""
    tools = [{"type": "function", "function": {"name": "f", "description": "<x>", "parameters": None}}]
    msgs = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi there,  "}]
    for kw in ({"tools": tools}, {"continue_final_message": True, "add_generation_prompt": False}, {"eos_token": "override"}):
        a, b = both(qwen3, source, msgs, **kw)
        assert a == b


def test_continue_final_message_refusals_match_transformers(qwen3: PromptTokenizer) -> None:
    cases = [
        ("{{ messages|length }}", [{"role": "user", "content": "x"}]),  # the template never names content
        ("{% for m in messages %}{{ m.content[:2] }}{% endfor %}", [{"role": "user", "content": "abcdef"}]),  # cut away
    ]
    for source, msgs in cases:
        a, b = both(qwen3, source, msgs, continue_final_message=True, add_generation_prompt=False)
        assert a.startswith("ValueError") and b.startswith("ValueError")


def test_the_caller_conversation_is_not_changed_by_continue_final_message(qwen3: PromptTokenizer) -> None:
    conversation = [{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "text", "text": "b"}]}]
    before = json.dumps(conversation)
    ChatTemplate("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}", {}).render(
        conversation, continue_final_message=True
    )
    assert json.dumps(conversation) == before


def test_the_router_renders_without_transformers_and_in_the_memo_sandbox(qwen3: PromptTokenizer) -> None:
    assert type(ENVIRONMENT) is MemoSandbox
    tok = PromptTokenizer.load(str(QWEN3_DIR), name="no-apply")

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("apply_chat_template called")

    tok._hf.apply_chat_template = refuse
    case = GOLDEN_CHATS[0]
    assert tok.render_chat(case["request"]) == case["prompt_text"]


@pytest.mark.parametrize("mutant", ["jinja's own tojson", "no continue-final cut"])
def test_golden_renderings_notice_a_wrong_environment(mutant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The golden check in test_tokenize.py fails if the rendering drifts from vLLM's.
    (Qwen3's template trims around every tag itself, so trim_blocks and lstrip_blocks
    show only in the comparison with transformers above.)"""
    env = build_environment()
    if mutant == "jinja's own tojson":
        env.filters["tojson"] = jinja2.Environment().filters["tojson"]
    else:
        monkeypatch.setattr(chat_template, "_cut_at_tag", lambda text, final: text)
    tok = PromptTokenizer.load(str(QWEN3_DIR), name="mutant")
    tok._templates = {k: ChatTemplate(tok._hf.chat_template, tok._hf.special_tokens_map, env) for k in ("default", "tool_use")}
    diverged = [c["id"] for c in GOLDEN_CHATS if tok.render_chat(c["request"]) != c["prompt_text"]]
    assert diverged


def test_a_template_using_break_still_gets_the_kwargs_it_reads() -> None:
    """vLLM finds a template's variables by parsing it with transformers' extensions; a
    parser without loopcontrols would fail on ``{% break %}`` and drop every kwarg."""
    tok = PromptTokenizer.load(str(QWEN3_DIR), name="break-template")
    tok._hf.chat_template = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
        "{% if flavour is defined %} [{{ flavour }}]{% endif %}"
    )
    body = {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"flavour": "mint", "other": 1}}
    assert tok.render_chat(body) == "x [mint]"


def test_developer_role_support_is_vllms_quoted_name_check() -> None:
    assert ChatTemplate("{% if m.role == 'developer' %}{% endif %}", {}).has_developer
    assert ChatTemplate('{# "developer" #}', {}).has_developer  # vLLM reads the text, comments too
    assert not ChatTemplate("{{ developer }}", {}).has_developer


def test_a_template_that_does_not_compile_is_a_400() -> None:
    tok = PromptTokenizer.load(str(QWEN3_DIR), name="broken-template")
    tok._hf.chat_template = "{% if %}"
    with pytest.raises(TokenizeError, match="chat template error"):
        tok.render_chat({"messages": [{"role": "user", "content": "x"}]})


# -- the memoizing sandbox -----------------------------------------------------------------


def test_memo_sandbox_renders_exactly_like_the_stock_sandbox(qwen3: PromptTokenizer) -> None:
    template = qwen3._hf.chat_template
    stock, fast = (build_environment(env).from_string(template) for env in (ImmutableSandboxedEnvironment, MemoSandbox))
    cases = [c["request"] for c in GOLDEN_CHATS if isinstance(c["request"].get("messages"), list)]
    cases += [{"messages": conv} for conv in conversations(30)]
    rendered = 0
    for body in cases:
        kwargs = {"messages": body["messages"], "tools": body.get("tools"), "add_generation_prompt": True}
        out = []
        for env in (stock, fast):
            try:
                out.append(env.render(**kwargs))
            except Exception as e:  # noqa: BLE001 - the same refusal is what must match
                out.append(repr(e))
        assert out[0] == out[1]
        rendered += 1
    assert rendered >= 80


def sandbox_renders(source: str) -> list[str]:
    """``source`` rendered by the stock sandbox, then twice by each of two memo sandboxes
    (the second render of each uses the remembered verdicts); a refusal as ``Type: message``."""
    out = []
    for env, times in ((ImmutableSandboxedEnvironment(), 1), (MemoSandbox(), 2), (MemoSandbox(), 2)):
        t = env.from_string(source)
        for _ in range(times):
            try:
                out.append(t.render(messages=[{"role": "user", "content": " Hi there "}], m={"role": "user"}))
            except (SecurityError, jinja2.TemplateError, TypeError) as e:
                out.append(f"{type(e).__name__}: {e}")
    return out


@pytest.mark.parametrize(("source", "refusal"), [
    ("{{ messages.append(1) }}", "SecurityError: access to attribute 'append' of 'list' object is unsafe."),
    ("{{ m.pop('role') }}", "SecurityError: access to attribute 'pop' of 'dict' object is unsafe."),
    ("{{ m.update({'a': 1}) }}", "SecurityError: access to attribute 'update' of 'dict' object is unsafe."),
    ("{{ ''.__class__ }}", ""),
    ("{{ 'x'.format.__globals__ }}", ""),
    ("{{ '{0.__class__}'.format(m) }}", ""),
    ("{{ m['__class__'] }}{{ m|attr('__class__') }}", ""),
])
def test_memo_sandbox_refuses_what_the_stock_sandbox_refuses(source: str, refusal: str) -> None:
    """A mutating method is an error, a private attribute an empty undefined, on first use
    and after the verdicts are remembered."""
    assert sandbox_renders(source) == [refusal] * 5


@pytest.mark.parametrize(("source", "rendered"), [
    ("{{ m.role }}{{ m['role'] }}{{ m.get('role') }}{{ m.nosuch is defined }}", "useruseruserFalse"),
    ("{{ m.items()|list|length }}{% for k, v in m.items() %}{{ k }}={{ v }}{% endfor %}{{ m.keys()|list }}",
     "1role=user['role']"),
    ("{% for x in range(3) %}{{ loop.index0 }}{{ x.real }}{% endfor %}", "001122"),
    ("{{ messages|map(attribute='role')|join }}{{ m|attr('items') is defined }}{{ m|attr('role') is defined }}",
     "userTrueFalse"),
    ("{{ messages[0].content.strip() }}|{{ messages[0].content.split()|join(',') }}|"
     "{{ messages[-1].content.lstrip().startswith('Hi') }}", "Hi there|Hi,there|True"),
    ("{{ messages|selectattr('role', 'equalto', 'user')|list|length }}{{ messages[0]['role']|upper }}", "1USER"),
    ("{% set ns = namespace(n=0) %}{% for x in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}", "1"),
    ("{{ '{}-{}'.format(m.role, 2) }}{{ '%s!'|format(m.role) }}", "user-2user!"),
])
def test_memo_sandbox_renders_what_the_stock_sandbox_allows(source: str, rendered: str) -> None:
    """What chat templates do (read fields, loop, call str and dict methods, set a
    namespace) renders the same, on first use and after the verdicts are remembered."""
    assert sandbox_renders(source) == [rendered] * 5


def test_memo_sandbox_reads_each_attribute_once_like_the_stock_sandbox() -> None:
    class Counting:
        def __init__(self) -> None:
            self.reads = 0

        def __getattr__(self, name: str) -> int:
            self.reads += 1
            return self.reads

    source = "{{ o.x }} {{ o.x }} {{ o.y }} {{ o.x }}"
    out = [env.from_string(source).render(o=Counting()) for env in (ImmutableSandboxedEnvironment(), MemoSandbox())]
    assert out[0] == out[1] == "1 2 3 4"
