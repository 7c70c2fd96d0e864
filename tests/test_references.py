"""Cross-references in the code and docs resolve: every named Note, and every file a doc or
comment points to.

Pure and single-process: only the tree's text is read. A Note is defined by a line that holds
nothing but the word Note and its bracketed name, optionally after `#` (a comment, or the first
line of a docstring); it is referred to by the word Note (or Notes) and the bracketed name(s),
across line breaks and comment markers. A path is checked when it names a file (it ends in .py,
.md, .sh, .yaml or .toml) and starts at a folder of this repository (`modular/tables/layout.py`,
or `tables/layout.py` relative to a package).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = {".py", ".md", ".sh", ".yaml", ".toml"}
# Where references are read; paths are checked outside tests/, whose files come and go with them.
NOTE_SCOPES = (
    "modular", "planners", "benchmarks", "examples", "scripts", "tests", "docs", "README.md",
)
PATH_SCOPES = ("modular", "planners", "benchmarks", "examples", "scripts", "docs", "README.md")

_DEFINITION = re.compile(r'^\s*(?:r?"""\s*)?(?:#\s*)?Note \[([^\]]+)\]:?\s*$')
_REFERENCE = re.compile(r"Notes? ((?:\[[^\]]+\](?:,? ?(?:and |or )?)?)+)")
_PATH = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w-]*/)+[\w-]+\.(?:py|md|sh|yaml|toml))\b")


def _files(scopes: tuple[str, ...]) -> list[Path]:
    out = []
    for scope in scopes:
        path = ROOT / scope
        if path.is_file():
            out.append(path)
        else:
            out += sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES)
    return out


def _tree() -> tuple[set[str], set[str]]:
    """Every file's path from the root, and every folder's name."""
    files, folders = set(), set()
    for p in ROOT.rglob("*"):
        rel = p.relative_to(ROOT)
        if rel.parts[0].startswith(".") or "__pycache__" in rel.parts:
            continue
        (files if p.is_file() else folders).add(str(rel))
    return files, {Path(f).name for f in folders}


def _flat(text: str) -> str:
    """Text with line breaks, and the comment markers after them, as single spaces."""
    return re.sub(r"\s*\n[ \t]*(?:#[ \t]*)?", " ", text)


def _notes() -> tuple[dict[str, list[str]], list[tuple[str, str]]]:
    definitions: dict[str, list[str]] = {}
    references = []
    for path in _files(NOTE_SCOPES):
        text = path.read_text()
        where = str(path.relative_to(ROOT))
        for n, line in enumerate(text.splitlines(), 1):
            match = _DEFINITION.match(line)
            if match:
                definitions.setdefault(" ".join(match.group(1).split()), []).append(f"{where}:{n}")
        for match in _REFERENCE.finditer(_flat(text)):
            for name in re.findall(r"\[([^\]]+)\]", match.group(1)):
                references.append((" ".join(name.split()), where))
    return definitions, references


def test_every_note_reference_has_a_definition() -> None:
    definitions, references = _notes()
    assert len(definitions) > 40, f"found only {len(definitions)} Notes: the reader is broken"
    missing: dict[str, set[str]] = {}
    for name, where in references:
        if name not in definitions:
            missing.setdefault(name, set()).add(where)
    assert not missing, "Notes referred to but defined nowhere (define them, or fix the name): " + (
        "; ".join(f"[{name}] in {sorted(files)}" for name, files in sorted(missing.items()))
    )


def test_a_note_said_to_be_in_a_file_is_defined_there() -> None:
    definitions, _ = _notes()
    wrong = []
    for path in _files(NOTE_SCOPES):
        text = _flat(path.read_text())
        for match in re.finditer(_REFERENCE.pattern + r" in `?([\w/.]+\.(?:py|md))", text):
            for name in re.findall(r"\[([^\]]+)\]", match.group(1)):
                homes = [d.split(":")[0] for d in definitions.get(" ".join(name.split()), [])]
                if homes and not any(h.endswith(match.group(2)) for h in homes):
                    wrong.append(
                        f"{path.relative_to(ROOT)}: [{name}] in {match.group(2)}, defined in {homes}"
                    )
    assert not wrong, "Notes pointed at the wrong file:\n" + "\n".join(wrong)


def test_every_file_a_doc_or_comment_names_exists() -> None:
    files, folders = _tree()
    missing = []
    for path in _files(PATH_SCOPES):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for match in _PATH.finditer(line):
                named = match.group(1)
                if named.split("/")[0] not in folders:
                    continue  # another project's path (torch/..., fbgemm_gpu/...)
                if named not in files and not any(f.endswith("/" + named) for f in files):
                    missing.append(f"{path.relative_to(ROOT)}:{n}: {named}")
    assert not missing, "files named but not in the tree (moved or renamed?):\n" + "\n".join(missing)


def test_the_path_check_catches_a_stale_path() -> None:
    files, folders = _tree()
    assert "tables" in folders and not any(f.endswith("/tables/precision.py") for f in files)
    assert _PATH.findall("(modular/tables/precision.py), see tables/layout.py") == [
        "modular/tables/precision.py",
        "tables/layout.py",
    ]
