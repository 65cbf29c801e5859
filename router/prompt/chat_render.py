"""Turn an OpenAI chat request into the conversation vLLM 0.33 hands to the chat template.

vLLM does not pass ``messages`` to ``apply_chat_template`` as sent. It parses every
message (``vllm/entrypoints/chat_utils.py``) and the request's tools (pydantic models),
and the rendered prompt, hence the token ids and the prefix-cache block hashes, follow
from that parsed form. Every rule below was observed on the real 0.33 renderer
(``tests/fixtures/golden/render_vectors_vllm-0.33.0_*.jsonl``):

* content-part lists become one string joined with ``"\\n"``, empty parts dropped,
  when the template treats content as a string (``"openai"`` templates, which loop over
  ``message.content``, get ``[{"type": "text", "text": ...}]`` instead);
* ``content: null`` renders as ``""`` (an empty part list);
* ``tool_calls: []`` is dropped; string ``arguments`` are parsed to JSON objects, and
  anything that is not valid JSON becomes ``{}``;
* an assistant ``reasoning`` field is also given to the template as ``reasoning_content``;
* tool messages keep ``tool_call_id``; every message keeps a string ``name``;
* when a ``developer`` message is present and the template does not know that role, it
  becomes ``system`` and all system messages are merged, in order, into one at the front
  joined with ``"\\n\\n"``;
* a first line ``x-anthropic-billing-header: ...`` is stripped from system text;
* tools are re-serialised as ``{"type", "function": {"name", "description",
  "parameters"[, "strict"]}}``: missing description/parameters become null and
  unknown keys are dropped.

Requests vLLM rejects with 400 raise :class:`ChatRequestError`.
"""

from __future__ import annotations

import json
from typing import Any, Literal

ContentFormat = Literal["string", "openai"]
"""How the template wants message content: one string, or a list of text-part dicts
(router.prompt.chat_template.detect_content_format)."""

BILLING_HEADER_PREFIX = "x-anthropic-billing-header"

_ROLE_PART_TYPES: dict[str, frozenset[str]] = {
    "user": frozenset({"text", "image_url", "input_audio", "file"}),
    "system": frozenset({"text"}),
    "developer": frozenset({"text"}),
    "tool": frozenset({"text"}),
    "assistant": frozenset({"text", "refusal"}),
}
"""Content-part types OpenAI's message schemas accept per role.

vLLM validates the request against OpenAI's typed message params first, so a user part
of type ``input_text`` is a 400 even though vLLM's own part parser knows that type."""

_TEXT_PART_TYPES = frozenset({"text", "refusal"})

_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template"}
)


class ChatRequestError(ValueError):
    """The chat request is one vLLM answers with 400."""


class UnsupportedContentError(ValueError):
    """Valid for vLLM, but needs the engine's multimodal processor (images, audio, files)."""


def filter_template_kwargs(kwargs: Any, allowed: frozenset[str]) -> dict[str, Any]:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise ChatRequestError("chat_template_kwargs must be an object")
    return {k: v for k, v in kwargs.items() if k in allowed and k not in _RESERVED_TEMPLATE_KWARGS}


def normalize_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Tools as vLLM's ``ChatCompletionToolsParam.model_dump()`` gives them to the template."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise ChatRequestError("tools must be a list")
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ChatRequestError(f"tools[{i}] must be an object")
        if tool.get("type", "function") != "function":
            raise ChatRequestError(f"tools[{i}].type must be 'function'")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise ChatRequestError(f"tools[{i}].function is required and must be an object")
        name = fn.get("name")
        if not isinstance(name, str):
            raise ChatRequestError(f"tools[{i}].function.name is required and must be a string")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise ChatRequestError(f"tools[{i}].function.description must be a string")
        parameters = fn.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise ChatRequestError(f"tools[{i}].function.parameters must be an object")
        function: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
        strict = fn.get("strict")
        if strict is not None:
            if not isinstance(strict, bool):
                raise ChatRequestError(f"tools[{i}].function.strict must be a boolean")
            function["strict"] = strict
        out.append({"type": "function", "function": function})
    return out


def normalize_messages(
    messages: Any, *, content_format: ContentFormat, template_has_developer: bool
) -> list[dict[str, Any]]:
    """The conversation vLLM renders, built from the request's ``messages``."""
    if not isinstance(messages, list) or not messages:
        raise ChatRequestError("messages must be a non-empty list")
    conversation = [_normalize_message(i, m, content_format) for i, m in enumerate(messages)]
    if not template_has_developer and any(m["role"] == "developer" for m in conversation):
        conversation = _hoist_system(conversation)
    for m in conversation:
        if m["role"] == "system" and isinstance(m["content"], str):
            m["content"] = strip_billing_header(m["content"])
    return conversation


def strip_billing_header(text: str) -> str:
    """Drop a leading ``x-anthropic-billing-header`` line (Claude Code's attribution line)."""
    if not text.startswith(BILLING_HEADER_PREFIX):
        return text
    _, newline, rest = text.partition("\n")
    return rest if newline else ""


def _hoist_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    system_texts: list[str] = []
    rest: list[dict[str, Any]] = []
    for m in conversation:
        if m["role"] in ("system", "developer"):
            system_texts.append(_as_text(m["content"]))
        else:
            rest.append(m)
    return [{"role": "system", "content": "\n\n".join(system_texts)}, *rest]


def _as_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def _normalize_message(index: int, message: Any, content_format: ContentFormat) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ChatRequestError(f"{where} must be an object")
    role = message.get("role")
    if not isinstance(role, str):
        raise ChatRequestError(f"{where}.role is required and must be a string")
    texts = _content_texts(where, role, message.get("content"))
    out: dict[str, Any] = {"role": role}
    if content_format == "openai":
        out["content"] = [{"type": "text", "text": t} for t in texts]
    else:
        out["content"] = "\n".join(texts)
    if role == "assistant":
        tool_calls = message.get("tool_calls")
        if tool_calls is not None:
            if not isinstance(tool_calls, list):
                raise ChatRequestError(f"{where}.tool_calls must be a list")
            if tool_calls:
                out["tool_calls"] = [_normalize_tool_call(f"{where}.tool_calls[{j}]", c) for j, c in enumerate(tool_calls)]
        reasoning = message.get("reasoning")
        if reasoning is not None:
            out["reasoning"] = reasoning
            out["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
    name = message.get("name")
    if isinstance(name, str):
        out["name"] = name
    task = message.get("task")
    if isinstance(task, str):
        out["task"] = task
    if role == "developer":
        out["tools"] = message.get("tools")
    return out


def _content_texts(where: str, role: str, content: Any) -> list[str]:
    """The message's text parts, in order, empty ones dropped (vLLM's ``if parse_res``)."""
    if content is None:
        return []
    if isinstance(content, str):
        return [content] if content else []
    if not isinstance(content, list):
        raise ChatRequestError(f"{where}.content must be a string, a list of content parts or null")
    allowed = _ROLE_PART_TYPES.get(role)
    texts: list[str] = []
    for j, part in enumerate(content):
        part_where = f"{where}.content[{j}]"
        if isinstance(part, str):
            if allowed is not None:
                raise ChatRequestError(f"{part_where} must be a content-part object")
            if part:
                texts.append(part)
            continue
        if not isinstance(part, dict):
            raise ChatRequestError(f"{part_where} must be a content-part object")
        ptype = part.get("type")
        if allowed is not None and ptype not in allowed:
            raise ChatRequestError(
                f"{part_where}.type {ptype!r} is not valid for role {role!r}; expected one of {sorted(allowed)}"
            )
        if ptype in _TEXT_PART_TYPES:
            key = "text" if ptype == "text" else "refusal"
            value = part.get(key)
            if value is None:
                continue
            if not isinstance(value, str):
                raise ChatRequestError(f"{part_where}.{key} must be a string")
            if value:
                texts.append(value)
            continue
        if ptype in ("input_text", "output_text"):
            value = part.get("text")
            if isinstance(value, str) and value:
                texts.append(value)
            continue
        raise UnsupportedContentError(f"{part_where}: content part type {ptype!r} needs the engine's multimodal processor")
    return texts


def _normalize_tool_call(where: str, call: Any) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise ChatRequestError(f"{where} must be an object")
    fn = call.get("function")
    if not isinstance(fn, dict):
        raise ChatRequestError(f"{where}.function is required and must be an object")
    if not isinstance(fn.get("name"), str):
        raise ChatRequestError(f"{where}.function.name is required and must be a string")
    out = dict(call)
    out["function"] = function = dict(fn)
    arguments = fn.get("arguments")
    if isinstance(arguments, str):
        try:
            function["arguments"] = json.loads(arguments)
        except json.JSONDecodeError:
            function["arguments"] = {}
    elif not isinstance(arguments, (dict, list)):
        function["arguments"] = {}
    return out
