"""The site's home page is the README, so GitHub and the site show one text (a hook of mkdocs.yml).

The README links to the pages as ``docs/<page>.md``, which works on GitHub; the home page sits beside
the pages, so the hook drops that ``docs/`` prefix."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

README = Path(__file__).resolve().parents[1] / "README.md"


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """The README's text in place of ``index.md``'s; every other page as it is."""
    if page.file.src_uri != "index.md":
        return markdown
    return re.sub(r"\]\(docs/", "](", README.read_text())
