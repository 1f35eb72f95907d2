"""The generated CuTeDSL for a score_mod / mask_mod, highlighted, with links back to the user's own lines.

The code generator writes a comment ``# <function>: <user line>`` before the statements each user line produced
and records where every node came from (file, line). The viewer shows the user's code with numbered anchors and
the generated module next to it; each such comment gets a link to the user line it quotes. An optional compile
report (PTX, registers, SASS mix) of our forward kernel with these mods inlined sits underneath.
"""
from __future__ import annotations

import html
import inspect
import itertools
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

_COUNTER = itertools.count()
_COMMENT = re.compile(r"^(\s*)# (?:backward of )?([A-Za-z_][\w.<>]*): (.*)$")


@dataclass
class UserSource:
    """The user's code as shown: text, the file name the code generator saw, and the first line number."""

    text: str
    filename: Optional[str] = None
    first_line: int = 1


def user_source_of(*fns: Optional[Callable]) -> Optional[UserSource]:
    """Source of the mods' defining file region via inspect (what a plain notebook cell gives us)."""
    for fn in fns:
        if fn is None:
            continue
        try:
            lines, start = inspect.getsourcelines(fn)
        except (OSError, TypeError):
            continue
        return UserSource("".join(lines), fn.__code__.co_filename, max(start, 1))
    return None


def _line_links(generated, source_lines: list[str], user: Optional[UserSource]) -> dict[int, int]:
    """Generated line index -> user line number, for every ``# fn: text`` comment the user's code explains."""
    if user is None:
        return {}
    by_text: dict[tuple[str, str], int] = {}
    graph = getattr(generated, "_graph", None)
    for loc in getattr(graph, "locs", []) or []:
        if loc is not None and (user.filename is None or loc.file == user.filename):
            by_text.setdefault((loc.function, loc.text.strip()), loc.line)
    user_lines = user.text.splitlines()
    links = {}
    for i, line in enumerate(source_lines):
        m = _COMMENT.match(line)
        if not m:
            continue
        fn, text = m.group(2), m.group(3).strip()
        target = by_text.get((fn, text))
        if target is None:          # no recorded location: fall back to finding the quoted text in the user code
            for j, u in enumerate(user_lines):
                if u.strip() == text:
                    target = user.first_line + j
                    break
        if target is not None:
            links[i] = target
    return links


def _highlight_lines(text: str) -> list[str]:
    """Pygments-highlighted HTML, one entry per source line (token spans never cross a line here)."""
    try:
        from pygments import lex
        from pygments.lexers import PythonLexer
        from pygments.styles import get_style_by_name
    except ImportError:
        return [html.escape(line) for line in text.split("\n")]
    style = get_style_by_name("default")
    lines, current = [], []
    for tok_type, value in lex(text, PythonLexer(stripnl=False, ensurenl=False)):
        st = style.style_for_token(tok_type)
        css = (f"color:#{st['color']};" if st["color"] else "") + ("font-weight:bold;" if st["bold"] else "") \
            + ("font-style:italic;" if st["italic"] else "")
        parts = value.split("\n")
        for k, part in enumerate(parts):
            if k:
                lines.append("".join(current))
                current = []
            if part:
                current.append(f"<span style='{css}'>{html.escape(part)}</span>" if css else html.escape(part))
    lines.append("".join(current))
    return lines


def _code_block(lines_html: list[str], first: int, anchor: Optional[str], links: dict[int, int],
                link_prefix: str, highlight_line: Optional[int] = None) -> str:
    rows = []
    for i, body in enumerate(lines_html):
        n = first + i
        ident = f" id='{anchor}-L{n}'" if anchor else ""
        style = " style='background:rgba(220,50,47,.18)'" if highlight_line == n else ""
        link = ""
        if i in links:
            link = (f" <a class='flexlab-src-link' href='#{link_prefix}-L{links[i]}' title='your line "
                    f"{links[i]}' style='font-size:11px;text-decoration:none'>↩ line {links[i]}</a>")
        rows.append(f"<div{ident}{style}><span style='color:#999;user-select:none;display:inline-block;"
                    f"width:3.5em;text-align:right;margin-right:1em'>{n}</span>{body}{link}</div>")
    return ("<pre style='font-size:12px;line-height:1.35;margin:0;padding:6px;overflow:auto;max-height:560px;"
            "background:var(--jp-layout-color1,#f7f7f7)'>" + "".join(rows) + "</pre>")


@dataclass
class SourceView:
    """Generated source + user code + optional compile report; renders as HTML in notebooks."""

    generated: object = None
    user: Optional[UserSource] = None
    error: Optional[str] = None
    error_line: Optional[int] = None
    report: object = None
    exception: Optional[BaseException] = field(default=None, repr=False)
    uid: int = field(default_factory=lambda: next(_COUNTER))

    @property
    def source(self) -> Optional[str]:
        return getattr(self.generated, "source", None)

    def links(self) -> dict[int, int]:
        """Generated line index (0-based) -> user line number."""
        if self.source is None:
            return {}
        return _line_links(self.generated, self.source.split("\n"), self.user)

    def _repr_html_(self) -> str:
        prefix = f"flexlab-user-{self.uid}"
        parts = ["<div class='flexlab-source-view' data-testid='flexlab-source-view'>"]
        if self.error:
            where = f" (line {self.error_line})" if self.error_line else ""
            parts.append(f"<div class='flexlab-error' style='color:#b00020;margin-bottom:6px'>"
                         f"<b>cannot generate code{where}:</b> {html.escape(self.error)}</div>")
        cols = []
        if self.user is not None:
            cols.append("<div style='flex:1;min-width:0'><div><b>your code</b></div>" + _code_block(
                _highlight_lines(self.user.text.rstrip("\n")), self.user.first_line, prefix, {}, prefix,
                self.error_line) + "</div>")
        if self.source is not None:
            key = getattr(self.generated, "hash", "")[:12]
            cols.append(f"<div style='flex:1.4;min-width:0'><div><b>generated CuTeDSL</b> <code>{key}</code></div>"
                        + _code_block(_highlight_lines(self.source.rstrip("\n")), 1, None, self.links(), prefix)
                        + "</div>")
        parts.append("<div style='display:flex;gap:1em;align-items:flex-start'>" + "".join(cols) + "</div>")
        if self.report is not None:
            parts.append("<div style='margin-top:8px'><b>compile report</b>" + self.report._repr_html_() + "</div>")
        parts.append("</div>")
        return "".join(parts)


def source_view(score_mod: Optional[Callable] = None, mask_mod: Optional[Callable] = None, *,
                user: Optional[UserSource] = None, compile_report: bool = False, dtype: str = "bfloat16",
                head_dim: int = 128) -> SourceView:
    """Generate the CuTeDSL for the mods (and with ``compile_report=True`` compile our kernel around it).

    Never raises for the user's code: an unsupported op or a failing compile is shown inside the view, with the
    user line when the code generator names one.
    """
    from ..errors import UnsupportedModError

    user = user or user_source_of(score_mod, mask_mod)
    view = SourceView(user=user)
    try:
        from ..codegen import generate
        view.generated = generate(score_mod, mask_mod)
    except UnsupportedModError as err:
        view.error, view.error_line, view.exception = str(err), err.line, err
        return view
    except Exception as err:                                       # noqa: BLE001 - shown, not raised
        view.error, view.exception = f"{type(err).__name__}: {err}", err
        return view
    if compile_report:
        from .compile_report import forward_kernel_report
        try:
            view.report = forward_kernel_report(score_mod, mask_mod, dtype=dtype, head_dim=head_dim)
        except Exception as err:                                   # noqa: BLE001
            view.error = f"compile report failed: {type(err).__name__}: {err}"
    return view
