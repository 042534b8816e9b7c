"""Tool use: a ``calculate`` tool the model calls; reward 1.0 when its final answer holds the result.

The expression is evaluated by walking its syntax tree (numbers and + - * / ** % // only), never with
``eval``.
"""

import ast
import operator

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


class CalculatorEnv(ToolEnv):
    max_turns = 4

    @tool
    def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: An expression with numbers, parentheses and + - * / // % **, e.g. "37 * 41".
        """
        return format_number(evaluate(ast.parse(expression, mode="eval")))

    def reward(self, task: dict, messages: list[dict]) -> float:
        used_tool = any(m.get("role") == "tool" for m in messages)
        correct = str(task["answer"]) in completion_text(messages)
        return (0.8 if correct else 0.0) + (0.2 if used_tool else 0.0)
