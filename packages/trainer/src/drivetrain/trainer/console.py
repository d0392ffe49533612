"""The CLI's consoles: plain text, because what they print comes from users and other programs.

Error messages carry paths, tracebacks and C++ source locations such as
``[/__w/pytorch/.../pair.cc:537]``; with rich markup on, such a message is parsed as a closing
tag and printing the error raises ``MarkupError`` instead. Styles are applied to ``Text`` parts
only, never parsed out of strings.
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text


def plain_console(*, stderr: bool = True) -> Console:
    """A console that prints strings verbatim (no markup, no highlighting), lines unwrapped."""
    return Console(stderr=stderr, soft_wrap=True, markup=False, highlight=False)


def print_error(console: Console, exc: BaseException) -> None:
    """``error: <message>`` with only the label styled; the message is printed as is."""
    console.print(Text.assemble(("error:", "red"), " ", str(exc)))


def print_ok(console: Console, message: str) -> None:
    console.print(Text(message, style="green"))
