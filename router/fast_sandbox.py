"""Jinja's immutable sandbox, with its per-access safety checks remembered.

vLLM renders chat templates through transformers, in jinja2's
``ImmutableSandboxedEnvironment``. Every ``message.role`` or ``loop.index0`` there goes
through ``is_safe_attribute`` (a dozen ``isinstance`` checks against abstract base
classes), and every method call through ``is_safe_callable``. On an 8k-token Qwen3 chat
that is half of the 0.27 ms a render costs, on every request.

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
golden chat renderings and a comparison over real conversations run in the tests. No
library offers this, hence the subclass. It is applied by swapping the class of the
environment transformers compiled the template with (:func:`speed_up`), so
transformers' own extensions, filters and globals stay exactly as vLLM gets them; a
transformers or jinja2 version laid out differently is left alone.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger(__name__)

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

    _kvrouter_verdicts: dict[tuple[type, str], bool]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kvrouter_verdicts = {}

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
        verdicts = self._kvrouter_verdicts
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


def speed_up(template: str) -> bool:
    """Make transformers' compiled ``template`` render through :class:`MemoSandbox`.
    Returns whether it did (False: an unexpected transformers or jinja2 layout)."""
    if not jinja2.__version__.startswith("3.1."):
        return False
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template

        env = _compile_jinja_template(template).environment
    except Exception as e:  # noqa: BLE001 - any surprise keeps the stock sandbox
        log.debug("chat template sandbox left as is: %r", e)
        return False
    if type(env) is ImmutableSandboxedEnvironment:
        env._kvrouter_verdicts = {}  # what MemoSandbox.__init__ adds; swapping the class does not call it
        env.__class__ = MemoSandbox
    return type(env) is MemoSandbox
