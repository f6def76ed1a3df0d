"""MkDocs hooks (``mkdocs.yml``: ``hooks``). The pages in ``docs/`` link the generated tables, plots
and reports where they lie in the repository, ``../results/...`` relative to ``docs/``, so that a
link also works where the Markdown is read as it is (GitHub). The build adds those files to the
site under ``results/`` and points the links there (the pages are all at the top of ``docs/``).
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
#: The generated files the pages link: (folder, suffixes).
SHARED = (("results/tables", (".md", ".png")), ("results/analysis", (".png",)), ("results/audit", (".md",)))


def on_files(files, config):
    for folder, suffixes in SHARED:
        for path in sorted((ROOT / folder).glob("*")):
            if path.suffix in suffixes:
                files.append(
                    File(
                        path.relative_to(ROOT).as_posix(),
                        str(ROOT),
                        config["site_dir"],
                        config["use_directory_urls"],
                    )
                )
    return files


def on_page_markdown(markdown, page, config, files):
    return markdown.replace("](../results/", "](results/")
