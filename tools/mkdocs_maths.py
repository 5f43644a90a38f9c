"""MkDocs hook: the docs' maths as MathML, written when the site is built, so that a page renders its formulas with
no script and no network (browsers draw MathML themselves).

``pymdownx.arithmatex`` (generic mode) leaves each formula as ``<span class="arithmatex">\\(...\\)</span>`` or
``<div class="arithmatex">\\[...\\]</div>``; this hook replaces each with the MathML ``latex2mathml`` makes of it.
A formula it cannot convert fails the build with the page and the formula, so a typo never ships as raw TeX.
"""

from __future__ import annotations

import html
import re

from latex2mathml.converter import convert

_FORMULA = re.compile(r'<(span|div) class="arithmatex">\s*\\([(\[])(.*?)\\[)\]]\s*</\1>', re.DOTALL)
# TeX the converter does not know, written as what it does know (same rendering).
_SPELLINGS = {r"\operatorname*": r"\operatorname", r"\tfrac": r"\frac", r"\dfrac": r"\frac"}


def mathml(tex: str, display: bool) -> str:
    """``tex`` as a MathML element, in a block where ``display``."""
    for old, new in _SPELLINGS.items():
        tex = tex.replace(old, new)
    return convert(tex, display="block" if display else "inline")


def on_page_content(content: str, page, **_) -> str:  # noqa: ANN001 - MkDocs' hook signature
    def replace(match: re.Match) -> str:
        tag, opening, tex = match.groups()
        tex = html.unescape(tex)
        try:
            element = mathml(tex, display=opening == "[")
        except Exception as err:  # noqa: BLE001 - any converter error fails the build with its place
            raise ValueError(f"{page.file.src_path}: cannot render the formula {tex!r} "
                             f"({type(err).__name__}: {err})") from None
        return f'<{tag} class="arithmatex">{element}</{tag}>'

    return _FORMULA.sub(replace, content)
