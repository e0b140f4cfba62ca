"""Arithmetic expressions of non-negative integers with + - * / and parentheses, parsed by a small grammar and
evaluated in exact rational arithmetic (`fractions.Fraction`): model text is never given to `eval`. Countdown scores
its answers with it, and the calculator tool computes with it."""

import re
from fractions import Fraction

MAX_EXPRESSION_CHARS = 256  # longer answers are malformed: the given numbers never need more
TOKEN = re.compile(r"\s*(?:([0-9]+)|([-+*/()]))")


def parse_expression(text: str) -> tuple[Fraction, list[int]] | None:
    """The value of an arithmetic expression of non-negative integers, + - * / and parentheses (the usual
    precedence, left to right; no unary signs, no decimals), and the integers it uses. None when it is not such an
    expression or divides by zero."""
    if len(text) > MAX_EXPRESSION_CHARS:
        return None
    tokens, position, text = [], 0, text.rstrip()
    while position < len(text):
        match = TOKEN.match(text, position)
        if not match:
            return None
        tokens.append(int(match.group(1)) if match.group(1) else match.group(2))
        position = match.end()
    numbers: list[int] = []
    index = 0

    def peek() -> object:
        return tokens[index] if index < len(tokens) else None

    def take() -> object:
        nonlocal index
        index += 1
        return tokens[index - 1]

    def atom() -> Fraction:
        token = take() if index < len(tokens) else None
        if isinstance(token, int):
            numbers.append(token)
            return Fraction(token)
        if token == "(":
            value = sum_of_terms()
            if peek() != ")":
                raise ValueError("unclosed parenthesis")
            take()
            return value
        raise ValueError(f"unexpected {token!r}")

    def term() -> Fraction:
        value = atom()
        while peek() in ("*", "/"):
            operator, right = take(), atom()
            value = value * right if operator == "*" else value / right  # ZeroDivisionError: malformed
        return value

    def sum_of_terms() -> Fraction:
        value = term()
        while peek() in ("+", "-"):
            operator, right = take(), term()
            value = value + right if operator == "+" else value - right
        return value

    try:
        value = sum_of_terms()
    except (ValueError, ZeroDivisionError):
        return None
    return (value, numbers) if index == len(tokens) else None
