"""Prompt token ids exactly as vLLM 0.33 computes them: one model's tokenizer facade.

The router hashes the same token ids the engine will hash, so these must match vLLM's
renderer bit for bit: a single differing token shifts every later block hash and turns
every prefix-cache hit into a miss. Chat requests are normalised like vLLM
(router.prompt.chat_render), rendered with the model's own chat template
(router.prompt.chat_template), and tokenized with the same HF tokenizer and flags vLLM uses.

This module is what the request path calls. The rest of the work is in three others,
each with one job:

* router.prompt.prompt_fields: the request's prompt fields, read as vLLM reads them;
* router.prompt.segments: tokenize only the segments of a prompt not seen before;
* router.prompt.remote_tokenize: a backend's ``/tokenize`` and the parity checks against it.
"""

from __future__ import annotations

import random
import threading
from pathlib import Path
from typing import Any

import jinja2

from router.prompt.chat_render import (
    ChatRequestError,
    UnsupportedContentError,
    filter_template_kwargs,
    normalize_messages,
    normalize_tools,
)
from router.prompt.chat_template import ChatTemplate
from router.prompt.length import LengthFloor
from router.prompt.prompt_fields import (
    EMPTY_PROMPT,
    TokenizeError,
    UnsupportedPrompt,
    bool_field,
    completion_prompts,
    truncation,
)
from router.prompt.segments import DEFAULT_SEGMENT_CACHE_TOKENS, Scan, SegmentTokenizer


class TooLong(TokenizeError):
    """A prompt with at least ``tokens`` tokens, found before tokenizing all of it
    (:mod:`router.prompt.length`), against a limit of ``limit``."""

    def __init__(self, limit: int, tokens: int) -> None:
        super().__init__(f"This model's maximum context length is {limit} tokens. However, your prompt has at "
                         f"least {tokens} tokens. Please reduce the length of the prompt.")
        self.limit = limit
        self.tokens = tokens


class PromptTokenizer:
    """One model's tokenizer and chat template; load once, share across threads.

    Special tokens (``add_special_tokens=True``, e.g. a BOS) are added here around the
    ids of the segment path, which never sees them."""

    def __init__(
        self,
        hf_tokenizer: Any,
        *,
        name: str,
        segment_cache_tokens: int = DEFAULT_SEGMENT_CACHE_TOKENS,
        verify_rate: float = 0.01,
        use_segments: bool = True,
        rng: random.Random | None = None,
    ) -> None:
        self._hf = hf_tokenizer
        self.name = name
        self.eos_token_id: int | None = hf_tokenizer.eos_token_id
        self.segments = SegmentTokenizer(
            hf_tokenizer, name=name, cache_tokens=segment_cache_tokens, verify_rate=verify_rate, enabled=use_segments, rng=rng
        )
        self._templates: dict[str, ChatTemplate] = {}
        self._special_prefix, self._special_suffix = self._special_wrapping()
        self.length = LengthFloor(hf_tokenizer, self.segments.cut_outside_added)

    @classmethod
    def load(cls, path_or_hub_id: str, **kwargs: Any) -> PromptTokenizer:
        """Load from a local directory (offline) or a hub id: from the local cache, else from the
        hub once it is known to answer. Blocking: call off the event loop.

        The errors say what was expected in one line: transformers' own end in "Repo id must
        be in the form 'repo_name'" for a missing directory, and it retries an unreachable hub
        for ~50 s."""
        from transformers import AutoTokenizer

        path = Path(path_or_hub_id).expanduser()
        if path.is_dir():
            try:
                hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
            except (OSError, ValueError) as e:
                raise TokenizeError(f"{path_or_hub_id!r} is a directory without a loadable tokenizer "
                                    f"(expected tokenizer.json and tokenizer_config.json): {_first_line(e)}") from e
        elif path_or_hub_id.startswith(("/", ".", "~")) or path_or_hub_id.count("/") > 1:
            raise TokenizeError(f"no such directory {path_or_hub_id!r} (expected a tokenizer directory, "
                                "or a Hugging Face hub id such as Qwen/Qwen3-0.6B)")
        else:
            try:
                hf = AutoTokenizer.from_pretrained(path_or_hub_id, local_files_only=True)
            except (OSError, ValueError):
                hf = _from_hub(path_or_hub_id)
        kwargs.setdefault("name", path_or_hub_id)
        return cls(hf, **kwargs)

    @property
    def segment_disabled_reason(self) -> str | None:
        return self.segments.disabled_reason

    @property
    def segment_enabled(self) -> bool:
        return self.segments.disabled_reason is None

    @property
    def backend(self) -> Any:
        """The ``tokenizers.Tokenizer`` behind the HF wrapper (None for slow tokenizers)."""
        return getattr(self._hf, "backend_tokenizer", None)

    @property
    def special_prefix(self) -> list[int] | None:
        """The ids ``add_special_tokens=True`` puts before the text, None if unknown."""
        return self._special_prefix

    @property
    def special_count(self) -> int:
        """How many ids ``add_special_tokens=True`` adds around the text (an upper bound)."""
        if self._special_prefix is None or self._special_suffix is None:
            return 8
        return len(self._special_prefix) + len(self._special_suffix)

    def cut_outside_added(self, text: str, cut: int) -> int:
        """``cut``, moved back to the start of an added token it would split."""
        return self.segments.cut_outside_added(text, cut)

    # -- plain text -------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False, *, check: bool = True, limit: int | None = None) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens=...)``, through the segment cache.

        ``check=False`` skips the sampled full-tokenization check here; a caller on the
        event loop runs :meth:`check_prompt` elsewhere when :meth:`wants_check` says so.
        With ``limit``, a text found to have at least that many tokens before it is
        tokenized whole raises :class:`TooLong`."""
        if limit is not None and (floor := self.length.at_least(text, limit)) is not None:
            raise TooLong(limit, floor)
        if not self.segment_enabled or (add_special_tokens and self._special_prefix is None):
            return self.encode_full(text, add_special_tokens)
        ids = self.segments.encode(text)
        if check and self.segments.wants_check():
            ids = self.segments.check(text, ids)
        if add_special_tokens:
            assert self._special_prefix is not None and self._special_suffix is not None
            return [*self._special_prefix, *ids, *self._special_suffix]
        return ids

    def encode_full(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """The reference: exactly the call vLLM makes, no cache."""
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int]) -> str:
        return self._hf.decode(ids)

    @property
    def max_token_id(self) -> int:
        """The largest token id this tokenizer knows (added tokens included)."""
        return len(self._hf) - 1

    # -- OpenAI bodies ----------------------------------------------------------

    def render_chat(self, body: dict[str, Any]) -> str:
        """The prompt text vLLM 0.33 renders for a ``/v1/chat/completions`` body."""
        if not isinstance(body, dict):
            raise TokenizeError("request body must be a JSON object")
        if body.get("chat_template") is not None:
            raise TokenizeError("chat_template in the request is not accepted by the engine")
        agp = bool_field(body, "add_generation_prompt", True)
        cfm = bool_field(body, "continue_final_message", False)
        if agp and cfm:
            raise TokenizeError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        try:
            tools = normalize_tools(body.get("tools"))
            template = self._template(tools is not None)
            conversation = normalize_messages(
                body.get("messages"), content_format=template.content_format, template_has_developer=template.has_developer
            )
            kwargs = filter_template_kwargs(body.get("chat_template_kwargs"), template.variables)
        except UnsupportedContentError as e:
            raise UnsupportedPrompt(str(e)) from e
        except ChatRequestError as e:
            raise TokenizeError(str(e)) from e
        try:
            text = template.render(
                conversation,
                tools=tools,
                documents=body.get("documents"),
                add_generation_prompt=agp,
                continue_final_message=cfm,
                kwargs=kwargs,
            )
        except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
            raise TokenizeError(f"chat template error: {e}") from e
        if not isinstance(text, str):
            raise TokenizeError("chat template did not render a string")
        return text

    def prompt_text(self, body: dict[str, Any], kind: str) -> tuple[str, bool] | None:
        """The text and ``add_special_tokens`` of a request whose prompt is one text with
        no left truncation, else None (token ids, several prompts, embeddings)."""
        if not isinstance(body, dict) or body.get("truncate_prompt_tokens") is not None:
            return None
        if kind == "chat":
            return self.render_chat(body), bool_field(body, "add_special_tokens", False)
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or body.get("prompt_embeds") is not None:
            return None
        return prompt, bool_field(body, "add_special_tokens", True)

    def scan(self, text: str, add_special: bool) -> Scan:
        """What the segment cache already holds of ``text``, without tokenizing anything
        (:meth:`router.prompt.segments.SegmentTokenizer.scan`).

        Segments tokenize independently, so the head ids are what full tokenization
        starts with; with ``add_special`` they include the tokenizer's special prefix
        (and suffix, when complete), and there is no head when it adds special tokens
        some other way."""
        if not self.segment_enabled or (add_special and self._special_prefix is None):
            return Scan(len(text), [], 0)
        found = self.segments.scan(text)
        if not add_special:
            return found
        assert self._special_prefix is not None and self._special_suffix is not None
        suffix = self._special_suffix if found.complete else []
        return Scan(found.uncached_chars, [*self._special_prefix, *found.head, *suffix], found.head_chars, found.complete)

    def shared_tokens(self, text: str, other: str, add_special: bool) -> tuple[int, int]:
        """How many leading ids of ``text`` are certainly the leading ids of ``other`` too,
        and the characters of ``text`` they cover
        (:meth:`router.prompt.segments.SegmentTokenizer.shared_tokens`). Reads segments of
        ``text`` from the cache without refreshing them, so call it right after ``text``
        was tokenized; (0, 0) when that cannot be known or no text is shared."""
        if not self.segment_enabled or (add_special and self._special_prefix is None):
            return 0, 0
        n, chars = self.segments.shared_tokens(text, other)
        if n and add_special:
            n += len(self._special_prefix)  # type: ignore[arg-type]
        return n, chars

    def text_ids(self, text: str, add_special: bool, *, check: bool = True, limit: int | None = None) -> list[int]:
        """The ids of a prompt :meth:`prompt_text` returned (an empty prompt is an error)."""
        return self._truncate(self.encode(text, add_special, check=check, limit=limit), None, add_special)

    def wants_check(self) -> bool:
        """Whether this request is one of the sampled segment-path checks."""
        return self.segments.wants_check()

    def check_prompt(self, text: str, ids: list[int], add_special: bool) -> None:
        """The segment-path check for the ids :meth:`text_ids` returned (special tokens stripped)."""
        if add_special and self._special_prefix is not None and self._special_suffix is not None:
            ids = ids[len(self._special_prefix) : len(ids) - len(self._special_suffix)]
        self.segments.check(text, ids)

    def chat_ids(self, body: dict[str, Any], limit: int | None = None) -> list[int]:
        """Exact prompt ids vLLM 0.33 uses for a ``/v1/chat/completions`` body (``limit``: see :meth:`encode`)."""
        text = self.render_chat(body)
        add_special = bool_field(body, "add_special_tokens", False)
        ids = self.encode(text, add_special, limit=limit)
        return self._truncate(ids, body.get("truncate_prompt_tokens"), add_special)

    def completion_ids(self, body: dict[str, Any], limit: int | None = None) -> list[list[int]]:
        """One id list per prompt of a ``/v1/completions`` body (route on the first; ``limit``: see :meth:`encode`)."""
        if not isinstance(body, dict):
            raise TokenizeError("request body must be a JSON object")
        if body.get("prompt_embeds") is not None:
            raise UnsupportedPrompt("prompt_embeds cannot be tokenized by the router")
        add_special = bool_field(body, "add_special_tokens", True)
        truncate = body.get("truncate_prompt_tokens")
        out: list[list[int]] = []
        for prompt in completion_prompts(body.get("prompt")):
            if isinstance(prompt, str):
                ids = self.encode(prompt, add_special, limit=limit)
                out.append(self._truncate(ids, truncate, add_special))
            else:
                out.append(self._truncate(prompt, truncate, False))
        return out

    # -- internals --------------------------------------------------------------

    def _template(self, with_tools: bool) -> ChatTemplate:
        """The tokenizer's chat template (its ``tool_use`` one for requests with tools,
        where it has one), compiled on first use like transformers does."""
        key = "tool_use" if with_tools else "default"
        template = self._templates.get(key)
        if template is None:
            raw = self._hf.chat_template
            if isinstance(raw, dict):
                raw = raw.get(key) or raw.get("default")
            if not isinstance(raw, str):
                raise TokenizeError(f"tokenizer {self.name!r} has no chat template")
            try:
                template = ChatTemplate(raw, self._hf.special_tokens_map)
            except jinja2.TemplateError as e:
                raise TokenizeError(f"chat template error: {e}") from e
            self._templates[key] = template
        return template

    def _truncate(self, ids: list[int], truncate: Any, add_special: bool) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: keep the last N (left truncation).

        HF truncates before adding special tokens, so with ``add_special_tokens`` the
        specials survive and the text keeps N minus their count. ``-1`` means the
        engine's ``max_model_len``, which the engine enforces itself.
        """
        n = truncation(truncate)
        if n is None or n == -1 or len(ids) <= n:
            ids_out = ids
        elif add_special and self._special_prefix is not None and self._special_suffix is not None:
            pre, suf = len(self._special_prefix), len(self._special_suffix)
            keep = max(n - pre - suf, 0)
            body = ids[pre : len(ids) - suf]
            ids_out = [*ids[:pre], *(body[len(body) - keep :] if keep else []), *ids[len(ids) - suf :]]
        else:
            ids_out = ids[len(ids) - n :] if n else []
        if not ids_out:
            raise TokenizeError(EMPTY_PROMPT)
        return ids_out

    def _special_wrapping(self) -> tuple[list[int] | None, list[int] | None]:
        """The ids ``add_special_tokens=True`` puts before and after the text (e.g. BOS)."""
        core = self.encode_full("a b", False)
        full = self.encode_full("a b", True)
        n = len(core)
        for i in range(len(full) - n + 1):
            if full[i : i + n] == core:
                prefix, suffix = full[:i], full[i + n :]
                if self.encode_full("", True) == [*prefix, *suffix]:
                    return prefix, suffix
        return None, None


HUB_PROBE_S = 5.0


def _from_hub(hub_id: str) -> Any:
    """``hub_id`` from the Hugging Face hub, after one quick check that the hub answers."""
    import os
    import urllib.error
    import urllib.request

    from transformers import AutoTokenizer

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=HUB_PROBE_S).close()
    except urllib.error.HTTPError:
        pass  # it answered (a mirror may refuse HEAD on its root): let the hub client try
    except OSError as e:
        raise TokenizeError(f"hub id {hub_id!r} is not in the local cache, and {endpoint} did not answer within "
                            f"{HUB_PROBE_S:g} s ({_first_line(e)}): give a local tokenizer directory") from e
    try:
        return AutoTokenizer.from_pretrained(hub_id)
    except (OSError, ValueError) as e:
        raise TokenizeError(f"hub id {hub_id!r} did not load from {endpoint}: {_first_line(e)}") from e


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:300]


_CACHE: dict[str, PromptTokenizer] = {}
_CACHE_LOCK = threading.Lock()


def load_tokenizer(path_or_hub_id: str) -> PromptTokenizer:
    """The process-wide :class:`PromptTokenizer` for this path (loaded on first use)."""
    with _CACHE_LOCK:
        tok = _CACHE.get(path_or_hub_id)
        if tok is None:
            tok = _CACHE[path_or_hub_id] = PromptTokenizer.load(path_or_hub_id)
        return tok
