"""MkDocs hooks for the visattn docs (named in mkdocs.yml; not part of the package).

* Pictures stay in the repository's ``assets/`` folder. The pages link them as ``../assets/NAME.png``, the
  path that works where the Markdown is read as it is (GitHub, an editor); :func:`on_files` adds that folder
  to the site and :func:`on_page_markdown` rewrites the links to it, so ``mkdocs build --strict`` checks them.
* Docstrings use Sphinx roles (``:func:`name```, ``:mod:`~pkg.mod```), which Markdown leaves as text around
  the code span; :func:`on_page_content` drops the role and, for ``~``, keeps the last dotted name only.
"""
from __future__ import annotations

import re
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
ASSETS = "assets"
PICTURES = ("*.png", "*.jpg", "*.svg", "*.gif")
ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|obj|exc):<code>(~?)([^<]*)</code>")


def on_files(files, config):
    for pattern in PICTURES:
        for path in sorted((ROOT / ASSETS).glob(pattern)):
            uri = f"{ASSETS}/{path.name}"
            if files.get_file_from_path(uri) is None:
                files.append(File(uri, str(ROOT), config["site_dir"], config["use_directory_urls"]))
    return files


def on_page_markdown(markdown, page, config, files):
    depth = page.file.src_uri.count("/")  # pages in docs/ sub-folders link ../../assets/
    return markdown.replace("](" + "../" * (depth + 1) + ASSETS + "/", "](" + "../" * depth + ASSETS + "/")


def _role(match: re.Match) -> str:
    tilde, name = match.groups()
    return f"<code>{name.rsplit('.', 1)[-1] if tilde else name}</code>"


def on_page_content(html, page, config, files):
    return ROLE.sub(_role, html)
