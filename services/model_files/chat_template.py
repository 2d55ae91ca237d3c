"""Chat templates: compiled in Jinja's sandbox with the helpers transformers gives them, and
rendered under a budget (:mod:`.template_budget`).

Templates come from model files and adapter uploads. The sandbox keeps a template from touching
what it must not; the meter keeps it from running long: the compiled template charges its
render's meter at every loop iteration, call, lookup and output, through the sandbox's hooks
and through nodes added to its syntax tree (:class:`_Metering`) before it is compiled. A
template is compiled outside any meter, so Jinja's constant folding never runs a metered filter
at compile time.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2 import nodes
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from services.model_files.template_budget import (
    CALL_OPERATIONS,
    BudgetExhausted,
    CountedIterator,
    TemplateBudget,
    checked_power,
    checked_product,
    meter,
    metered,
    size_of,
)


class ChatTemplateError(ValueError):
    """The chat template refused to render the messages (its ``raise_exception``, or a runtime
    error such as a loop over a value that is not a list)."""


class TemplateOverBudget(ChatTemplateError):
    """The render went over its budget (:class:`~.template_budget.TemplateBudget`)."""

    def __init__(self, message: str, setting: str | None):
        super().__init__(message)
        self.message = message
        """What went over, e.g. ``more than 100000 operations``."""
        self.setting = setting
        """The budget's setting that was exceeded; None: a fixed limit."""


def render_chat_template(source: str, budget: TemplateBudget, /, **variables: Any) -> str:
    """``source`` rendered with ``variables``, within ``budget``'s operations and output.

    Raises :class:`TemplateOverBudget` past the budget (and when the render nests deeper than
    Python's recursion limit or runs out of memory), :class:`ChatTemplateError` when the template
    fails or does not compile.
    """
    try:
        template = compile_chat_template(source)
        with metered(budget) as render_meter:
            parts = []
            for chunk in template.generate(**variables):
                render_meter.produce(chunk)
                parts.append(chunk)
            return "".join(parts)
    except BudgetExhausted as over:
        raise TemplateOverBudget(over.message, over.setting) from None
    except RecursionError:
        raise TemplateOverBudget("calls nested deeper than the renderer's recursion limit", None) from None
    except MemoryError:
        raise TemplateOverBudget(
            "more memory than the renderer may use", "chat_template_memory_mib"
        ) from None
    except Exception as error:  # noqa: BLE001 - the template's own code failed (an adapter's, maybe)
        raise ChatTemplateError(f"{type(error).__name__}: {error}") from None


# Keyed by the template's text: an adapter's template is immutable for the adapter's id, and
# adapters that ship the same template share one compilation. Sized for many adapters' templates.
@functools.lru_cache(maxsize=256)
def compile_chat_template(source: str) -> jinja2.Template:
    """``source`` compiled in the chat-template sandbox; ``jinja2.TemplateSyntaxError`` if it is
    not a Jinja template."""
    return _template_environment().from_string(source)


@functools.lru_cache(maxsize=256)
def chat_template_variables(source: str) -> frozenset[str]:
    """The variables ``source`` reads from its caller (``messages``, ``tools``, ``bos_token``...):
    a template that reads ``tools`` lays tool definitions out itself."""
    return frozenset(jinja2.meta.find_undeclared_variables(_template_environment().parse(source)))


# -- the sandbox --------------------------------------------------------------------------------

_ITER, _CONCAT, _OUT, _CHARGE = "loramesh.iter", "loramesh.concat", "loramesh.out", "loramesh.charge"
"""The filters :class:`_Metering` adds; the dot keeps them apart from any filter a template names."""


class _MeteredSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, charging the render's meter at each call, lookup and intercepted operator."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def _generate(self, source, name, filename, defer_init=False):
        return super()._generate(_Metering().visit(source), name, filename, defer_init)

    def call(self, context, obj, /, *args, **kwargs):
        charged = meter()
        charged.spend(CALL_OPERATIONS + sum(map(size_of, args)) + sum(map(size_of, kwargs.values())))
        if isinstance(obj, LoopContext) and args:  # a recursive loop's next level: count it too
            args = (CountedIterator(args[0]), *args[1:])
        result = super().call(context, obj, *args, **kwargs)
        charged.spend(size_of(result))
        return _counted(result)

    def getattr(self, obj, attribute):
        meter().spend(1)
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        meter().spend(1)
        return super().getitem(obj, argument)

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            result = checked_product(left, right)
        elif operator == "**":
            result = checked_power(left, right)
        else:
            result = super().call_binop(context, operator, left, right)
        return meter().spend_on(result)


class _Metering(NodeTransformer):
    """Rewrites a template's syntax tree so that its loops, ``~`` and outputs charge the meter."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        self.generic_visit(node)
        node.iter = _filtered(node.iter, _ITER)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        self.generic_visit(node)
        return _filtered(nodes.List(node.nodes, lineno=node.lineno), _CONCAT)

    def visit_Output(self, node: nodes.Output) -> nodes.Output:
        self.generic_visit(node)
        static = sum(len(child.data) for child in node.nodes if isinstance(child, nodes.TemplateData))
        children = [c if isinstance(c, nodes.TemplateData) else _filtered(c, _OUT) for c in node.nodes]
        if static >> 10:
            children.insert(0, _filtered(nodes.Const(static >> 10, lineno=node.lineno), _CHARGE))
        node.nodes = children
        return node


def _filtered(value: nodes.Expr, name: str) -> nodes.Filter:
    return nodes.Filter(value, name, [], [], None, None, lineno=value.lineno)


def _counted(value: Any) -> Any:
    """A lazy result (``map``'s, ``select``'s) charges each item as it is taken."""
    if isinstance(value, Iterator) and not isinstance(value, CountedIterator):
        return CountedIterator(value)
    return value


# The filters _Metering adds take the context only so that Jinja never folds them into constants
# at compile time: they must run, and charge, at every render.
@jinja2.pass_context
def _iterate(context, items):
    return CountedIterator(items)


@jinja2.pass_context
def _concat(context, values: list) -> str:
    return meter().spend_on("".join(str(v) for v in values))


@jinja2.pass_context
def _out(context, value) -> str:
    charged = meter()
    charged.spend(size_of(value))
    text = str(value)
    charged.spend(size_of(text))
    return text


@jinja2.pass_context
def _charge(context, operations: int) -> str:
    meter().spend(operations)
    return ""


def _metered(function: Callable) -> Callable:
    """A filter or test that charges one operation, its arguments' sizes and its result's."""

    @functools.wraps(function)  # keeps jinja_pass_arg: Jinja passes the context as it would
    def charged(*args, **kwargs):
        charged_meter = meter()
        charged_meter.spend(1 + sum(map(size_of, args)) + sum(map(size_of, kwargs.values())))
        return _counted(charged_meter.spend_on(function(*args, **kwargs)))

    return charged


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training masks; render it as is."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters, which chat templates must not do.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


@functools.cache
def _template_environment() -> _MeteredSandbox:
    # Sandboxed and metered, with the helpers and whitespace rules that transformers gives
    # templates, so the rendered prompt is the one the model was trained on.
    env = _MeteredSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _metered(f) for name, f in env.filters.items()}
    env.tests = {name: _metered(t) for name, t in env.tests.items()}
    env.filters.update({_ITER: _iterate, _CONCAT: _concat, _OUT: _out, _CHARGE: _charge})
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    del env.globals["lipsum"]  # lipsum(10**7) writes for minutes in one call the meter cannot see into
    return env
