"""The math domain: a calculator, a length converter and summary statistics.

World section ``math``: ``history`` (the expressions calculated). Tasks: compute an expression, convert a
length, a statistic of a few numbers; they change nothing, so their rubric is the planned call and the
number the answer must state (no final-state checks of their own). Parameter kind ``unit`` (variants may
spell the unit names out).
"""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Callable
from typing import Any

from k2lab.agentic.domains.base import (
    BaseTool,
    Codec,
    CodecOption,
    Domain,
    Draft,
    Param,
    Phase,
    Step,
    ToolError,
    string,
)

__all__ = ["DOMAIN", "LENGTH_UNITS", "format_number", "safe_calculate"]

#: Length units in meters.
LENGTH_UNITS = {"m": 1.0, "km": 1000.0, "mi": 1609.344, "ft": 0.3048}
LONG_UNIT_NAMES = {"m": "meters", "km": "kilometers", "mi": "miles", "ft": "feet"}


def initial_state(rng: random.Random) -> dict[str, Any]:
    """An empty calculation history."""
    return {"history": []}


# ------------------------------------------------------------------------------------------------ tools


_OPERATORS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.FloorDiv: operator.floordiv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def safe_calculate(expression: str) -> float:
    """Evaluate an arithmetic expression (numbers, + - * / // % **, parentheses) without ``eval``."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as error:
        raise ToolError("invalid_expression", f"cannot parse {expression!r}") from error
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, int | float)
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ToolError("invalid_expression", "exponent too large")
        try:
            return _OPERATORS[type(node.op)](left, right)
        except ZeroDivisionError as error:
            raise ToolError("division_by_zero", "division by zero") from error
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ToolError("invalid_expression", f"unsupported syntax {type(node).__name__}")


def format_number(value: float) -> str:
    """A number as an answer writes it: integers without decimals, others with up to 4."""
    if isinstance(value, float) and not value.is_integer():
        return f"{value:.4f}".rstrip("0").rstrip(".")
    return str(int(value))


def calculate(world: dict[str, Any], args: dict[str, Any]) -> Any:
    value = safe_calculate(str(args["expression"]))
    world["math"]["history"].append(str(args["expression"]))
    return {"expression": args["expression"], "result": value}


def convert_units(world: dict[str, Any], args: dict[str, Any]) -> Any:
    source, target = args["from_unit"], args["to_unit"]
    if source not in LENGTH_UNITS or target not in LENGTH_UNITS:
        raise ToolError("unknown_unit", f"cannot convert {source!r} to {target!r}")
    value = float(args["value"]) * LENGTH_UNITS[source] / LENGTH_UNITS[target]
    return {"value": round(value, 4), "unit": target}


def statistics(world: dict[str, Any], args: dict[str, Any]) -> Any:
    numbers = [float(x) for x in args["numbers"]]
    if not numbers:
        raise ToolError("empty_input", "no numbers given")
    ordered = sorted(numbers)
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    ops = {"mean": sum(numbers) / len(numbers), "median": median, "max": max(numbers), "min": min(numbers)}
    ops["sum"] = sum(numbers)
    return {"op": args["op"], "result": ops[args["op"]]}


def unit_codecs() -> list[CodecOption]:
    """Unit names spelled out."""
    spelled = Codec(
        "enum",
        mapping=tuple(LONG_UNIT_NAMES.items()),
        schema=(("enum", list(LONG_UNIT_NAMES.values())),),
        note="unit names spelled out",
    )
    return [(spelled, ())]


UNIT = {"type": "string", "enum": list(LENGTH_UNITS), "description": "Length unit."}
EXPRESSION = Param(
    "expression", string("Arithmetic, e.g. '(2 + 3) * 4'."), synonyms=("expr", "formula", "math_input")
)
VALUE = Param(
    "value", {"type": "number", "description": "The length."}, synonyms=("length", "number", "magnitude")
)
FROM_UNIT = Param("from_unit", dict(UNIT), kind="unit", synonyms=("source_unit", "unit_in", "input_unit"))
TO_UNIT = Param("to_unit", dict(UNIT), kind="unit", synonyms=("target_unit", "unit_out", "output_unit"))
NUMBERS = Param(
    "numbers",
    {"type": "array", "items": {"type": "number"}, "description": "The data."},
    synonyms=("values", "data", "samples"),
)
OP = Param(
    "op",
    {"type": "string", "enum": ["mean", "median", "max", "min", "sum"]},
    synonyms=("statistic", "operation", "measure"),
)

TOOLS: tuple[BaseTool, ...] = (
    BaseTool("calculate", "math", "arithmetic", "Evaluate an arithmetic expression.", (EXPRESSION,),
             calculate, True, aliases=("calc", "evaluate_expression", "compute")),
    BaseTool("convert_units", "math", "units", "Convert a length between units.", (VALUE, FROM_UNIT, TO_UNIT),
             convert_units, True, aliases=("unit_convert", "length_conversion", "convert_length")),
    BaseTool("statistics", "math", "statistics", "Summary statistic of a list of numbers.", (NUMBERS, OP),
             statistics, True, aliases=("describe_numbers", "stats", "aggregate")),
)  # fmt: skip


# ------------------------------------------------------------------------------------------------ tasks


def math_calculate(rng: random.Random, world: dict[str, Any]) -> Draft:
    """Compute an arithmetic expression."""
    a, b, c = rng.randint(100, 9999), rng.randint(11, 999), rng.randint(2, 97)
    expression = rng.choice((f"({a} + {b}) * {c}", f"{a} * {b} - {c}", f"{a} / {c}", f"{a} * {c} + {b}"))
    value = format_number(eval(expression, {"__builtins__": {}}))  # noqa: S307 - digits and operators only
    steps = [Step("calculate", {"expression": expression})]
    phase = Phase(f"Compute {expression} for me.", steps, f"{expression} = {value}", terms=[value])
    return Draft("math_calculate", [phase], [])


def math_convert(rng: random.Random, world: dict[str, Any]) -> Draft:
    """Convert a length between two units."""
    source, target = rng.sample(("m", "km", "mi", "ft"), 2)
    value = float(rng.randint(2, 500))
    steps = [Step("convert_units", {"value": value, "from_unit": source, "to_unit": target})]
    result = convert_units(world, steps[0].args)["value"]
    phase = Phase(
        f"How many {target} is {format_number(value)} {source}?",
        steps,
        f"{format_number(value)} {source} is {format_number(result)} {target}.",
        terms=[format_number(result)],
    )
    return Draft("math_convert", [phase], [])


def math_statistics(rng: random.Random, world: dict[str, Any]) -> Draft:
    """A summary statistic of four to seven numbers."""
    numbers = [float(rng.randint(1, 99)) for _ in range(rng.randint(4, 7))]
    op = rng.choice(("mean", "median", "max", "min", "sum"))
    steps = [Step("statistics", {"numbers": numbers, "op": op})]
    result = statistics(world, steps[0].args)["result"]
    listed = ", ".join(format_number(x) for x in numbers)
    phase = Phase(
        f"What is the {op} of {listed}?",
        steps,
        f"The {op} is {format_number(result)}.",
        terms=[format_number(result)],
    )
    return Draft("math_statistics", [phase], [])


DOMAIN = Domain(
    name="math",
    description="a calculator and unit converter",
    prefixes=("math_", "calc_", "num_", "sci_"),
    tools=TOOLS,
    templates=(math_calculate, math_convert, math_statistics),
    initial_state=initial_state,
    param_kinds={"unit": unit_codecs},
)
