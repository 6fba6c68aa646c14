"""A calculator tool that evaluates arithmetic by walking its `ast`; model text is never `eval`ed.

Accepted: int and float literals, `+ - * / // % **`, unary `+`/`-`, parentheses. Everything
else (names, calls, attributes, subscripts, strings, comparisons, bit operations, ...) is
rejected with a message naming what was found. Work is bounded before it is done: the
expression length, the exponent of `**`, and the size of every integer intermediate (checked
before multiplying or raising to a power), so `9**9**9` or `(10**200)**200` are refused at
once instead of hanging the event loop.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rollouts.tools.base import Tool, ToolError, ToolResult


class CalculatorError(ToolError, ValueError):
    """The expression is not plain arithmetic or exceeds a limit (message shown to the model)."""


@dataclass(frozen=True)
class CalculatorLimits:
    max_chars: int = 200
    max_exponent: int = 1000
    max_int_bits: int = 4096  # ~1233 decimal digits


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _bits(x: int | float) -> int:
    return abs(x).bit_length() if isinstance(x, int) else 0


def _check_size(x: int | float, limits: CalculatorLimits) -> int | float:
    if isinstance(x, complex):
        raise CalculatorError("the result is not a real number")
    if isinstance(x, float) and not math.isfinite(x):
        raise CalculatorError("the result is not a finite number")
    if _bits(x) > limits.max_int_bits:
        raise CalculatorError(f"the result has more than {limits.max_int_bits} bits")
    return x


def _check_operands(
    op: ast.operator, a: int | float, b: int | float, limits: CalculatorLimits
) -> None:
    """Refuse operations whose result would be too large, before computing them."""
    if isinstance(op, ast.Mult) and _bits(a) + _bits(b) > limits.max_int_bits + 1:
        raise CalculatorError(f"the product would have more than {limits.max_int_bits} bits")
    if isinstance(op, ast.Pow):
        if abs(b) > limits.max_exponent:
            raise CalculatorError(
                f"exponent {b} is larger than {limits.max_exponent} in absolute value"
            )
        if (
            isinstance(a, int)
            and isinstance(b, int)
            and b > 0
            and _bits(a) > 1
            and (_bits(a) - 1) * b > limits.max_int_bits
        ):
            raise CalculatorError(f"the power would have more than {limits.max_int_bits} bits")


def _eval(node: ast.AST, limits: CalculatorLimits) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval(node.body, limits)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, int | float):
            raise CalculatorError(f"only numbers are allowed, found {node.value!r}")
        return _check_size(node.value, limits)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand, limits))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        a, b = _eval(node.left, limits), _eval(node.right, limits)
        _check_operands(node.op, a, b, limits)
        try:
            result = _BINARY[type(node.op)](a, b)
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("the result is too large") from None
        return _check_size(result, limits)
    what = (
        type(node.op).__name__ if isinstance(node, ast.BinOp | ast.UnaryOp) else type(node).__name__
    )
    raise CalculatorError(
        f"{what} is not allowed: use numbers, + - * / // % **, unary minus and parentheses"
    )


def evaluate_arithmetic(
    expression: str, limits: CalculatorLimits = CalculatorLimits()
) -> int | float:
    """The value of an arithmetic `expression` (pure; see the module docstring for the grammar).

    Raises:
        CalculatorError: not plain arithmetic, malformed, too long, or over a size limit.
    """
    if not isinstance(expression, str):
        raise CalculatorError(f"expression must be a string, got {type(expression).__name__}")
    if len(expression) > limits.max_chars:
        raise CalculatorError(
            f"expression is {len(expression)} characters; the limit is {limits.max_chars}"
        )
    if not expression.strip():
        raise CalculatorError("expression is empty")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise CalculatorError(f"cannot parse {expression!r}: {getattr(exc, 'msg', exc)}") from None
    try:
        return _eval(tree, limits)
    except RecursionError:
        raise CalculatorError("expression is nested too deeply") from None


def format_number(value: int | float) -> str:
    """Integers as digits; floats that are whole as integers ("2.0" -> "2"), else repr."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return repr(value)


def make_calculator(limits: CalculatorLimits = CalculatorLimits()):
    """A calculator executor: `{"expression": "..."}` -> the value as text."""

    async def calculator(arguments: Mapping[str, Any]) -> ToolResult:
        return ToolResult(format_number(evaluate_arithmetic(arguments.get("expression"), limits)))

    return calculator


def calculator_tool(
    limits: CalculatorLimits = CalculatorLimits(), *, name: str = "calculator"
) -> Tool:
    """The calculator as a `Tool` (one string argument, `expression`)."""
    return Tool(
        name=name,
        description="Evaluate an arithmetic expression: numbers, + - * / // % **, parentheses.",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (12+3)*4-5/2"}},
            "required": ["expression"],
        },
        executor=make_calculator(limits),
        timeout_s=5.0,
    )
