"""Every flag's whole help text in each LLM script's `--help`. tyro shows a field's docstring whole but only the first
line of a trailing comment, so a help written as a comment that runs on over further lines is cut mid-sentence: the
text a reader of the source sees is compared with what `--help` prints, flag by flag, in this process."""

import ast
import contextlib
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
import typing

import pytest
import tyro

import distill_llm
import dpo_online
import grpo_llm
import ppo_llm

SCRIPTS = (grpo_llm, ppo_llm, dpo_online, distill_llm)


def source_help(cls: type) -> dict[str, str]:
    """Each field's help as its class's source writes it: a tyro.conf.arg(help=...) in its Annotated type, the string
    literal under it, or its trailing comment with the comment lines that continue it (a `# ---` line opens a
    section)."""
    source = textwrap.dedent(inspect.getsource(cls))
    trailing, alone = {}, {}  # comments by line: after code, or on a line of their own
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            (alone if token.line.strip().startswith("#") else trailing)[token.start[0]] = token.string[1:].strip()
    body = ast.parse(source).body[0].body
    hints = typing.get_type_hints(cls, include_extras=True)
    found = {}
    for node, after in zip(body, [*body[1:], None]):
        if not isinstance(node, ast.AnnAssign):
            continue
        name = node.target.id
        annotated = [m.help for m in getattr(hints[name], "__metadata__", ()) if getattr(m, "help", None)]
        if annotated:
            found[name] = annotated[0]
        elif isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) and isinstance(after.value.value,
                                                                                                  str):
            found[name] = after.value.value
        elif node.end_lineno in trailing:
            parts, line = [trailing[node.end_lineno]], node.end_lineno + 1
            while line in alone and not alone[line].startswith("---"):
                parts.append(alone[line])
                line += 1
            found[name] = " ".join(parts)
    return found


def documented_flags(args_class: type) -> dict[str, str]:
    """Every field of a script's Args with its help, from the nearest class in its ancestry that declares it."""
    helps = {}
    for cls in reversed(args_class.__mro__[:-1]):
        helps.update(source_help(cls))
    return helps


def printed_help(args_class: type, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """`--help` as tyro prints it on a wide terminal, as {flag: its help}, whitespace collapsed (one flag per option
    line, the aliases of a line sharing its help)."""
    monkeypatch.setenv("COLUMNS", "300")
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        tyro.cli(args_class, args=["--help"])
    helps, names = {}, []
    for line in out.getvalue().splitlines():
        text = line.rstrip().removeprefix("│").removesuffix("│").rstrip()
        indent = len(text) - len(text.lstrip())
        if indent <= 2 and re.match(r"--?[A-Za-z]", text.lstrip()):  # an option line: its flags, then its help's start
            options, _, start = text.strip().partition("  ")
            names = re.findall(r"(?:^|, )(--?[A-Za-z][\w-]*)", options)
            helps.update({name: start.strip() for name in names})
        elif names and indent > 2:  # the help's next line
            helps.update({name: f"{helps[name]} {text.strip()}".strip() for name in names})
        else:
            names = []
    return helps


def test_the_reader_sees_a_comment_run_on():
    """The negative control: a help written as a comment over two lines is read whole, so a cut help would fail."""
    @dataclasses.dataclass
    class Cut:
        workers: int = 0  # the first line of the help,
        # and its second line
        # --- a section ---
        rounds: int = 1
        """a docstring"""

    assert source_help(Cut) == {"workers": "the first line of the help, and its second line", "rounds": "a docstring"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda module: module.__name__)
def test_help_prints_every_flag_whole(script, monkeypatch):
    printed = printed_help(script.Args, monkeypatch)
    flags = documented_flags(script.Args)
    assert set(flags) == {field.name for field in dataclasses.fields(script.Args)}  # every flag has a help
    cut = [f"--{name.replace('_', '-')}" for name, text in flags.items()
           if " ".join(text.split()) not in printed.get(f"--{name.replace('_', '-')}", "")]
    assert cut == [], f"--help cuts these flags' help: {cut}"
