"""Put a GPU suite run into the repository: its files under benchmarks/results/gpu/, its tables into the docs.

    python benchmarks/gpu/to_docs.py OUTDIR        # OUTDIR: what run.sh (or device.sh) wrote

OUTDIR holds ``results.md`` and ``results.json`` and the parts' files, as ``parts/`` or as ``parts.tgz``. The section
of docs/benchmarks.md between the ``gpu-suite`` markers is replaced by ``results.md`` (its headings one level down).
A dry run, or a run without a CUDA device, is refused: those figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BEGIN = "<!-- gpu-suite:begin"
END = "<!-- gpu-suite:end -->"


def fill(docs: str, results_md: str) -> str:
    """``docs`` with the text between the markers replaced by ``results_md``, its headings demoted by one level.

    Example::

        >>> fill("a\\n<!-- gpu-suite:begin -->\\nold\\n<!-- gpu-suite:end -->\\nb\\n", "### T\\nnew\\n")
        'a\\n<!-- gpu-suite:begin -->\\n#### T\\nnew\\n<!-- gpu-suite:end -->\\nb\\n'
    """
    start, end = docs.find(BEGIN), docs.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the docs have no section between '{BEGIN} ...' and '{END}'")
    opening = docs.index("\n", start) + 1
    body = re.sub(r"^(#+) ", r"#\1 ", results_md.strip(), flags=re.MULTILINE)
    return docs[:opening] + body + "\n" + docs[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, help="the suite's output folder")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results" / "gpu")
    args = parser.parse_args(argv)
    environment = json.loads((args.run / "results.json").read_text())["environment"]
    if environment["mode"] != "full" or environment["memory_gib"] is None:
        print(
            f"to_docs: {args.run} is a {environment['mode']} run on {environment['device']}: only a full run on a CUDA"
            " device goes into the docs",
            file=sys.stderr,
        )
        return 2
    if args.results.exists():
        shutil.rmtree(args.results)
    (args.results / "parts").mkdir(parents=True)
    for name in ("results.md", "results.json"):
        shutil.copy(args.run / name, args.results / name)
    if (args.run / "parts").is_dir():
        for path in (args.run / "parts").iterdir():
            shutil.copy(path, args.results / "parts" / path.name)
    elif (args.run / "parts.tgz").exists():
        with tarfile.open(args.run / "parts.tgz") as archive:
            archive.extractall(args.results, filter="data")
    args.docs.write_text(fill(args.docs.read_text(), (args.run / "results.md").read_text()))
    print(f"to_docs: wrote {args.results} and the GPU section of {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
