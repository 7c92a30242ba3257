"""mkdocs hook: serve benchmarks/README.md and benchmarks/results/*.md as pages of the docs site.

The benchmark reports live beside the scripts that produce them (benchmarks/results/), not in
docs/; this hook adds them to the site's files under the same paths, so their relative links
(e.g. README.md → results/2026-12-02-main-job.md) and the navigation in mkdocs.yml resolve, and
`mkdocs build --strict` checks them like every other page.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent


def on_files(files: Files, config) -> Files:
    reports = sorted((ROOT / "benchmarks" / "results").glob("*.md"))
    pages = [ROOT / "benchmarks" / "README.md", *reports]
    for path in pages:
        files.append(File(path.relative_to(ROOT).as_posix(), src_dir=str(ROOT),
                          dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    return files
