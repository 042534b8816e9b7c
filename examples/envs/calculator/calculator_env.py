"""Tool use: a ``calculate`` tool the model calls; reward 1.0 when its final answer holds the result.

The expression is evaluated by walking its syntax tree (numbers and + - * / ** % // only), never with
``eval``.

Each task carries the ``tool_call`` that solves it. With ``force_first_tool_call = true`` in the job's
``config`` (or this package's ``[config]``), that call opens every episode, so even a model that has never
called a tool sees one run and its result; the model still has to state the answer itself.

Every call of the tool also notes where it ran -- its uid, its pid and whether any of the host's
``TUNEGATE_*`` settings are visible -- and reports, under ``info["metrics"]``, the number of tool calls
(``tools/calls``) and the fraction made inside a sandbox (``tools/sandboxed_fraction``): a non-root uid, a
PID namespace of its own (pid < 10) and no host settings in its environment. A job's metrics events show
both.
"""

import ast
import operator
import os

from envsdk import ToolEnv, completion_text, tool

OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in OPS:
        left, right = evaluate(node.left), evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 100:
            raise ValueError("exponent too large")
        return OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
        return OPS[type(node.op)](evaluate(node.operand))
    raise ValueError("only numbers and + - * / // % ** are allowed")


def format_number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.6g}"


def sandboxed_here() -> bool:
    """Whether this process runs as the sandbox runs it: not root, in its own PID namespace, and blind
    to the settings of the process that started it."""
    host_settings = [name for name in os.environ if name.startswith("TUNEGATE_")]
    return os.getuid() != 0 and os.getpid() < 10 and not host_settings


class CalculatorEnv(ToolEnv):
    max_turns = 4

    @tool
    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: An expression with numbers, parentheses and + - * / // % **, e.g. "37 * 41".
        """
        self.record_call()
        return format_number(evaluate(ast.parse(expression, mode="eval")))

    def record_call(self) -> None:
        where = self.info.setdefault("tool_runs", [])
        where.append({"uid": os.getuid(), "pid": os.getpid(), "sandboxed": sandboxed_here()})
        sandboxed = sum(1 for run in where if run["sandboxed"])
        self.info["metrics"] = {"tools/calls": len(where), "tools/sandboxed_fraction": sandboxed / len(where)}

    def reward(self, task: dict, messages: list[dict]) -> float:
        used_tool = any(m.get("role") == "tool" for m in messages)
        correct = str(task["answer"]) in completion_text(messages)
        return (0.8 if correct else 0.0) + (0.2 if used_tool else 0.0)
