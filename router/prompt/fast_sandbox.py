"""Jinja's immutable sandbox, with its per-access safety checks remembered.

Chat templates render in jinja2's ``ImmutableSandboxedEnvironment`` (router.prompt.chat_template
builds the environment transformers uses, in the class chosen here). Every
``message.role`` or ``loop.index0`` there goes through ``is_safe_attribute`` (a dozen
``isinstance`` checks against abstract base classes), and every method call through
``is_safe_callable``: most of a render's time.

Measured (``benchmarks/bench_chat_render.py --reps 400``, shipped Qwen3 template,
ShareGPT text, medians in ms, one run; stock is transformers' ``apply_chat_template`` as
vLLM calls it, own the router.prompt.chat_template environment in the stock sandbox, memo the
same in this one)::

    case                         tokens   stock    own   memo   saved
    short (system + 1 turn)          73   0.032  0.030  0.017   0.014
    10 turns, 2k                   2066   0.133  0.128  0.047   0.086
    10 turns, 8k                   8066   0.136  0.140  0.055   0.082
    80 turns, 3k                   3416   0.815  0.824  0.236   0.579
    10 turns, 2k, 4 tools          2476   0.151  0.144  0.063   0.088

Render time follows the number of messages, not their length, and owning the
environment alone changes nothing. The router's own time per warm chat request is
about 0.5 ms (docs/benchmarks.md), so 0.08 ms is a sixth of it, and an agent's tool loop
of 80 messages saves 0.6 ms per request the history memo misses: kept, 2-3.5x. Of the
saving, the remembered verdicts are nearly all: the dict shortcut alone took the 80-turn
case from 0.79 to 0.65 ms, the verdicts to 0.23.

The verdicts depend on less than they look at:

- ``is_safe_attribute(obj, attr, value)`` looks at ``attr`` and at ``obj``'s type only
  (underscore names, internal attributes of functions/frames/generators, mutating
  methods of lists, dicts, sets, deques: ``isinstance`` checks), so it is remembered per
  ``(type, attr)``; everything else in :meth:`MemoSandbox.getattr` is the stock code,
  ``str.format`` wrapping included, and the attribute is read once, as there;
- a ``dict`` has no instance attributes, so a name a dict lacks always falls through
  to the item lookup the sandbox would do next;
- builtin functions and methods cannot carry the ``unsafe_callable`` / ``alters_data``
  marks ``is_safe_callable`` looks for, so calling one skips that check.

Everything else takes the stock path. Renders are identical, not merely equivalent: the
golden chat renderings, a comparison with ``apply_chat_template`` over real
conversations and the stock sandbox's refusals run in the tests
(``tests/test_chat_template.py``). :meth:`MemoSandbox.getattr` restates jinja2 3.1's
``SandboxedEnvironment.getattr``, so :data:`SANDBOX` is the stock class under any other
jinja2.
"""

from __future__ import annotations

import types
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

_DICT_ATTRS = frozenset(dir({}))
"""Every attribute a plain dict has: any other name raises AttributeError on it."""
_BUILTIN_CALLABLES = frozenset({
    types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType, types.MethodDescriptorType,
})
MAX_VERDICTS = 4096
"""Remembered ``(type, attr)`` pairs: templates name a few dozen; ``|attr`` with names from
request data could name more, and those past the bound are just checked every time."""


class MemoSandbox(ImmutableSandboxedEnvironment):
    """``ImmutableSandboxedEnvironment`` that remembers its attribute verdicts (see the module docstring)."""

    _verdicts: dict[tuple[type, str], bool]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._verdicts = {}

    def getattr(self, obj: Any, attribute: str) -> Any:
        """The stock ``SandboxedEnvironment.getattr``, step for step, but for the
        remembered verdict and the dict shortcut (the same item lookup, without first
        raising AttributeError)."""
        if type(obj) is dict and type(attribute) is str and attribute not in _DICT_ATTRS:
            try:
                return obj[attribute]
            except (TypeError, LookupError):
                return self.undefined(obj=obj, name=attribute)
        try:
            value = getattr(obj, attribute)
        except AttributeError:
            try:
                return obj[attribute]
            except (TypeError, LookupError):
                return self.undefined(obj=obj, name=attribute)
        fmt = self.wrap_str_format(value)
        if fmt is not None:
            return fmt
        verdicts = self._verdicts
        key = (type(obj), attribute)
        safe = verdicts.get(key)
        if safe is None:
            safe = self.is_safe_attribute(obj, attribute, value)
            if len(verdicts) < MAX_VERDICTS:
                verdicts[key] = safe
        return value if safe else self.unsafe_undefined(obj, attribute)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's signature
        if type(__obj) in _BUILTIN_CALLABLES:
            return __context.call(__obj, *args, **kwargs)
        return super().call(__context, __obj, *args, **kwargs)


SANDBOX: type[ImmutableSandboxedEnvironment] = (
    MemoSandbox if jinja2.__version__.startswith("3.1.") else ImmutableSandboxedEnvironment
)
"""The sandbox class chat templates render in."""
