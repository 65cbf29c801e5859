"""A model's chat template, rendered in an environment the router builds, as vLLM renders it.

vLLM 0.33 renders a chat request with transformers 5.20's ``apply_chat_template(...,
tokenize=False)``. That is, for one conversation:

* a jinja2 ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``,
  the ``loopcontrols`` extension and a ``{% generation %}`` tag (which renders its body
  as it is unless a training mask is asked for); the filter ``tojson`` is ``json.dumps``
  keeping non-ASCII text; the globals are ``raise_exception`` and ``strftime_now``;
* the template variables ``messages``, ``tools``, ``documents``,
  ``add_generation_prompt``, then the tokenizer's ``special_tokens_map`` (``eos_token``
  ...) overridden by the request's ``chat_template_kwargs``;
* for ``continue_final_message``, a tag appended to the last message's text and the
  render cut where the tag lands, so the prompt ends inside that message.

This module builds that environment and takes those steps itself, instead of calling
``apply_chat_template``, so the router can render through its own faster sandbox
(router.prompt.fast_sandbox, which says why and by how much) without reaching into the
environment transformers caches privately. The golden renderings of the real vLLM
renderer (``tests/fixtures/golden/render_vectors_*``) and a comparison with
``apply_chat_template`` over real conversations check that the two stay byte-identical.

The analyses vLLM makes of the template before rendering (content format, the variables
it reads, whether it knows the ``developer`` role) live here too: they read the
template, not the request, and parse it with the same extensions (a template with
``{% break %}`` or ``{% generation %}`` does not parse without them).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import jinja2
import jinja2.meta
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from router.prompt.chat_render import ContentFormat
from router.prompt.fast_sandbox import SANDBOX

CONTINUE_FINAL_MESSAGE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""transformers' marker for the end of the message to continue (trailing space included)."""


class GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it
    to build training masks; a render for inference outputs the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _strftime_now(format: str) -> str:  # noqa: A002 - the templates call it with this keyword
    return datetime.now().strftime(format)


def build_environment(sandbox: type[ImmutableSandboxedEnvironment] = SANDBOX) -> ImmutableSandboxedEnvironment:
    """The chat-template environment transformers builds, in the given sandbox class."""
    env = sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


ENVIRONMENT = build_environment()
"""Shared by every template: the sandbox's remembered verdicts are per (type, attribute)."""


class ChatTemplate:
    """One compiled chat template and what vLLM learns from it before rendering.

    Compiling raises ``jinja2.TemplateSyntaxError`` (a ``TemplateError``) for a template
    that does not parse; rendering raises ``TemplateError``, ``ValueError`` or
    ``TypeError`` where ``apply_chat_template`` does."""

    def __init__(
        self, source: str, special_tokens: Mapping[str, Any], environment: ImmutableSandboxedEnvironment = ENVIRONMENT
    ) -> None:
        self.source = source
        self.content_format = detect_content_format(source)
        self.variables = template_variables(source)
        self.has_developer = template_mentions_role(source, "developer")
        self._special_tokens = dict(special_tokens)
        self._compiled = environment.from_string(source)

    def render(
        self,
        conversation: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        documents: Any = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for one non-empty conversation of plain dicts."""
        if documents is not None:
            for document in documents:
                if not isinstance(document, dict):
                    raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
        final = None
        if continue_final_message:
            conversation, final = self._tag_final_message(conversation)
        text = self._compiled.render(
            messages=conversation,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **{**self._special_tokens, **(kwargs or {})},
        )
        return text if final is None else _cut_at_tag(text, final)

    def _tag_final_message(self, conversation: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
        """The conversation with the tag after the last message's text (a copy: the
        caller's is left as it is), and that text."""
        last = dict(conversation[-1])
        content = last.get("content")
        if content is None:
            raise ValueError('continue_final_message is set but the final message has no "content" to continue!')
        if "content" not in self.source:
            raise ValueError('continue_final_message is set to "content" but this is not an accepted field in the chat_template')
        if isinstance(content, (list, tuple)):
            blocks = [dict(b) if isinstance(b, dict) else b for b in content]
            for block in reversed(blocks):
                if "text" in block:
                    final = block["text"]
                    block["text"] = final + CONTINUE_FINAL_MESSAGE_TAG
                    break
            else:
                raise ValueError("continue_final_message is set but we could not find any text to continue in the final message!")
            last["content"] = blocks
        else:
            final = content
            last["content"] = content + CONTINUE_FINAL_MESSAGE_TAG
        return [*conversation[:-1], last], final


def _cut_at_tag(text: str, final: str) -> str:
    """The render up to the tag; without the whitespace before it when the template
    trimmed the message's trailing space."""
    tag = CONTINUE_FINAL_MESSAGE_TAG.strip()
    if final.strip() not in text or tag not in text:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the chat after "
            "applying the chat template!"
        )
    at = text.rindex(tag)
    if text[at : at + len(CONTINUE_FINAL_MESSAGE_TAG)] == CONTINUE_FINAL_MESSAGE_TAG:
        return text[:at]
    return text[:at].rstrip()


def detect_content_format(template: str) -> ContentFormat:
    """``"openai"`` when the template iterates over a message's content, else ``"string"``.

    Mirrors vLLM's detection: the template's AST is searched for a ``for`` loop whose
    iterable is ``<x>.content`` / ``<x>["content"]`` (or a variable assigned from one).
    """
    try:
        ast = ENVIRONMENT.parse(template)
    except jinja2.TemplateSyntaxError:
        return "string"
    content_vars = {
        target.name
        for assign in ast.find_all(nodes.Assign)
        if isinstance(assign.target, nodes.Name) and _is_content_access(assign.node)
        for target in [assign.target]
    }
    for loop in ast.find_all(nodes.For):
        it = loop.iter
        if isinstance(it, nodes.Filter) and it.node is not None:
            it = it.node
        if _is_content_access(it) or (isinstance(it, nodes.Name) and it.name in content_vars):
            return "openai"
    return "string"


def _is_content_access(node: nodes.Node) -> bool:
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return False


def template_variables(template: str) -> frozenset[str]:
    """Names the template reads from its context; other ``chat_template_kwargs`` are dropped."""
    try:
        ast = ENVIRONMENT.parse(template)
    except jinja2.TemplateSyntaxError:
        return frozenset()
    return frozenset(jinja2.meta.find_undeclared_variables(ast))


def template_mentions_role(template: str, role: str) -> bool:
    """Whether the template handles ``role`` itself: vLLM's test, the role's name quoted
    anywhere in the template text."""
    return f'"{role}"' in template or f"'{role}'" in template
