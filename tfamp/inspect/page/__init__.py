"""The HTML pages' own files, and putting one page together.

Each page is three files in this folder: ``NAME.html`` (the skeleton, with
``%%TITLE%%``, ``%%STYLE%%``, ``%%DATA%%`` and ``%%SCRIPT%%`` slots),
``NAME.css`` and ``NAME.js``, edited as what they are. ``assemble`` inlines
them with the page's data into one self-contained file, so what the user
gets still needs no network and no files besides itself.

Pages: ``graph`` (what a rewrite did: ``tfamp.inspect.html_report``) and
``ranges`` (where values sit: ``tfamp.numerics.plot``).
"""

from __future__ import annotations

import functools
import html
import re
from importlib import resources

_SLOTS = re.compile(r"%%(TITLE|STYLE|DATA|SCRIPT)%%")


@functools.cache
def _read(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="ascii")


def assemble(page: str, *, title: str, data_json: str) -> str:
    """One self-contained HTML page: `page`'s skeleton with its style, script,
    the escaped `title` and `data_json` (already safe inside <script>) inlined.

    One pass over the skeleton, so text inside the data or the script is never
    taken for a slot.
    """
    values = {"TITLE": html.escape(title), "DATA": data_json,
              "STYLE": _read(f"{page}.css"), "SCRIPT": _read(f"{page}.js")}
    return _SLOTS.sub(lambda m: values[m.group(1)], _read(f"{page}.html"))
