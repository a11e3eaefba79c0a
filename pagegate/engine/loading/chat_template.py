"""Chat templates: the Jinja sandbox they render in, with the helpers transformers gives them.

Apart from tokenizer.py so that a tokenizer that never renders one (an engine core's: the gateway renders chat
prompts) never imports jinja2.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training); renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


@functools.cache
def _environment() -> ImmutableSandboxedEnvironment:
    """The sandbox chat templates run in, with the helpers transformers gives them."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    return _environment().from_string(source)


@functools.lru_cache(maxsize=16)
def template_variables(source: str) -> frozenset[str]:
    """The variables a template reads from its caller; a template that fails to parse reads none."""
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(source)))
    except jinja2.TemplateSyntaxError:
        return frozenset()
