"""Every repository path that a docstring, a comment or a doc names exists (issue 42).

Read: README.md, CHANGELOG.md and the Markdown under docs/, deploy/ and the packages; the docstrings and comments
of the *.py under capture/ replay_format/ replay_service/ replay_client/ tests/ bench/ scripts/ examples/; the
comments of scripts/*.sh.

A *name* is a word (cut at white space, quotes, brackets and `,;=|`; a `:line`, `::test` or `#anchor` suffix and
trailing punctuation dropped) that is a file name ending in .py, .md or .sh, or a path with a `/` that ends in `/`
or in one of EXTENSIONS, or that starts at a top-level folder of the repository. Not names: URLs; words with a
placeholder or a glob (`< > { } * $ ~ ...`); DATA folders (what the service, the plugin or a build make at run
time); another project's files: a path whose first folder is in no folder on the naming file's way up to the root
(`transformer/moe/router.py`), or that starts with one of FOREIGN (`vllm/v1/engine/core.py`: this repository's
plugin is named `capture/vllm/...`, or relative to its own package), or a bare file name that the same file named
before as another project's (`vllm/v1/engine/core.py`, then `core.py:1082`).

A name exists if it resolves against the naming file's folder or any folder above it up to the root (`./` and
`../`: against the folder only), or against a folder that a path named before it in the same paragraph names
(`capture/worker/` (`sharding.py`, ...)); a bare file or folder name also if it lies in a direct child of one of
those folders (`stand_ins.py` named in tests/ is tests/support/stand_ins.py).

Absolute paths: one under a MACHINE folder (a checkout's or a home folder) fails wherever it is named. One under
SCRATCH fails in Markdown unless it is an example, in a fenced code block or the value of a `--option`; in a
docstring or a comment it says where the code itself writes (a test's screenshots). System paths (/usr/...) and
the service's URL paths (/v1/...) are not checked.

Run as a script, it prints every missing name as `file:line: name`.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY_FOLDERS = ("capture", "replay_format", "replay_service", "replay_client", "tests", "bench", "scripts", "examples")
MD_FOLDERS = ("docs", "deploy", "capture", "replay_format", "replay_service", "replay_client")
SKIPPED = {"__pycache__", "node_modules", "vendor"}
EXTENSIONS = {"py", "md", "sh", "toml", "yml", "yaml", "json", "txt", "cfg", "ini", "conf", "html", "js", "css",
              "png", "svg"}
BARE = {"py", "md", "sh"}
# Other projects' packages: a path that starts with one of these is theirs, even where this repository has a folder
# of the same name (capture/vllm/).
FOREIGN = ("vllm/", "megatron/", "verl/", "slime/", "miles/", "sglang/", "nemo_rl/", "transformer_engine/",
           "torch/", "site-packages/", "vllm-project/")
# Folders made at run time, never in the repository: the service's data directory (`runs/`, `compares/`,
# `quarantine/`, `trash/`), the plugin's spill root, a build's output.
DATA = {"runs", "compares", "quarantine", "trash", "replay-spill", "replay-data", "build", "dist"}
MACHINE = ("/work/", "/home/", "/root/", "/Users/", "/mnt/")
SCRATCH = "/tmp/"

WORD = re.compile(r"[^\s`'\"()\[\],;=|]+")
PLACEHOLDER = re.compile(r"[<>{}*$~…]|\.\.\.")
SUFFIX = re.compile(r"(?:::[\w\[\]./-]*|:\d[\d,-]*|#[\w-]*)$")
STRING_OR_COMMENT = re.compile(r"""(?P<s>[rRbBuUfF]{0,2}(?:'''[\s\S]*?'''|\"\"\"[\s\S]*?\"\"\"|'(?:\\.|[^'\\\n])*'"""
                               r"""|"(?:\\.|[^"\\\n])*"))|(?P<c>#[^\n]*)""")
BODIES = ("body", "orelse", "finalbody", "handlers", "cases")


@cache
def top_level() -> frozenset[str]:
    return frozenset(p.name for p in ROOT.iterdir() if not p.name.startswith("."))


@cache
def generated() -> frozenset[Path]:
    """The pages the docs site adds at build time (docs/hooks/reference.py): named from docs/, never on disk."""
    spec = importlib.util.spec_from_file_location("docs_reference_hook", ROOT / "docs" / "hooks" / "reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return frozenset(ROOT / "docs" / uri for uri in hook.generated_uris())


@cache
def present(path: Path) -> bool:
    return path.exists() or Path(os.path.normpath(path)) in generated()


@cache
def children(folder: Path) -> tuple[Path, ...]:
    if not folder.is_dir():  # a folder of pages the docs hook generates: no files on disk
        return ()
    return tuple(c for c in folder.iterdir() if c.is_dir() and not c.name.startswith((".", "__")))


@cache
def anchors(folder: Path) -> tuple[Path, ...]:
    """The folder and every folder above it up to the root."""
    return (folder, *[p for p in folder.parents if p == ROOT or ROOT in p.parents])


def names_in(word: str) -> Iterator[str]:
    """The names a word may hold, cleaned: none, or the word's pieces between colons."""
    if "://" in word or word.startswith(("http", "www.")) or PLACEHOLDER.search(word):
        return
    for piece in [word] if word.startswith("/") else word.split(":"):
        name = SUFFIX.sub("", piece.lstrip("(")).rstrip(".,:;!?)")
        if name:
            yield name


def is_name(name: str) -> bool:
    if name.startswith("/"):
        return name.startswith((*MACHINE, SCRATCH))
    if not re.match(r"(?:\.\.?/)*\w", name) or name.rstrip("/").split("/")[0] in DATA:
        return False
    last = name.rstrip("/").rsplit("/", 1)[-1]
    ext = last.rsplit(".", 1)[1] if "." in last else ""
    if "/" not in name:
        return ext in BARE
    parts = name.split("/")
    return name.endswith("/") or ext in EXTENSIONS or (parts[0] in top_level() and all(parts[1:]))


def located(name: str, folder: Path, context: list[Path]) -> Path | bool | None:
    """Where a name of this repository lies (False: nowhere); None for another project's name."""
    if name.startswith(("./", "../")):
        target = (folder / name).resolve()
        inside = target == ROOT or ROOT in target.parents  # a clone holds the repository only: nothing beside it
        return folder / name if inside and present(folder / name) else False
    bases = (*context, *anchors(folder))
    parts = name.rstrip("/").split("/")
    if len(parts) > 1 and (name.startswith(FOREIGN) or not any(present(a / parts[0]) for a in bases)):
        return None
    found = next((a / name for a in bases if present(a / name)), None)
    if found is None and len(parts) == 1:
        found = next((c / name for a in bases for c in children(a) if present(c / name)), None)
    return found or False


def texts_of_python(path: Path) -> Iterator[tuple[int, str]]:
    """(first line, text) of every docstring and every comment."""
    source = path.read_text()
    todo: list[ast.AST] = [ast.parse(source)]
    while todo:  # statements only: no docstring lies inside an expression
        node = todo.pop()
        body = getattr(node, "body", None)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                yield first.value.lineno, first.value.value
        for field in BODIES:
            block = getattr(node, field, None)
            if isinstance(block, list):
                todo.extend(c for c in block if isinstance(c, ast.stmt | ast.excepthandler | ast.match_case))
    for match in STRING_OR_COMMENT.finditer(source):
        if match.group("c"):
            yield source.count("\n", 0, match.start()) + 1, match.group("c")


def texts_of_shell(path: Path) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(path.read_text().splitlines(), 1):
        comment = re.search(r"(?:^|\s)#(?!!)(.*)", line)
        if comment:
            yield number, comment.group(1)


def texts_of_markdown(path: Path) -> Iterator[tuple[int, str]]:
    """The file as one text; a line of a fenced code block starts with NUL."""
    fenced, lines = False, []
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            lines.append("")
        else:
            lines.append(("\x00" if fenced else "") + line)
    yield 1, "\n".join(lines)


READERS = {"py": texts_of_python, "sh": texts_of_shell, "md": texts_of_markdown}


def files() -> Iterator[tuple[Path, str]]:
    def walk(folder: Path, pattern: str) -> Iterator[Path]:
        for p in sorted(folder.rglob(pattern)):
            if not SKIPPED.intersection(p.relative_to(ROOT).parts):
                yield p
    for name in ("README.md", "CHANGELOG.md"):
        if (ROOT / name).exists():
            yield ROOT / name, "md"
    for folder in MD_FOLDERS:
        for p in walk(ROOT / folder, "*.md"):
            yield p, "md"
    for folder in PY_FOLDERS:
        for p in walk(ROOT / folder, "*.py"):
            yield p, "py"
    for p in sorted((ROOT / "scripts").glob("*.sh")):
        yield p, "sh"


def missing_in(path: Path, kind: str) -> Iterator[str]:
    try:
        texts = list(READERS[kind](path))
    except (SyntaxError, FileNotFoundError, UnicodeDecodeError):  # moved or half-written by someone meanwhile
        return
    rel, foreign = path.relative_to(ROOT), set()
    for first, text in sorted(texts):
        context: list[Path] = []  # folders the paragraph has named so far
        for offset, line in enumerate(text.split("\n")):
            if not line.strip("\x00 \t#>"):
                context = []
            if "/" not in line and "." not in line:
                continue
            for word in WORD.finditer(line):
                if "/" not in word.group() and "." not in word.group():
                    continue
                for name in names_in(word.group()):
                    if not is_name(name):
                        continue
                    where = f"{rel}:{first + offset}"
                    if name.startswith("/"):
                        before = line[:word.start()].rstrip()
                        example = name.startswith(SCRATCH) and (kind != "md" or line.startswith("\x00")
                                                                or re.search(r"(?:^|\s)--?[\w-]+$", before))
                        if not example:
                            yield f"{where}: absolute path {name}"
                        continue
                    found = located(name, path.parent, context)
                    if found is None:
                        foreign.add(name.rstrip("/").rsplit("/", 1)[-1])
                    elif found:
                        context.append(found if name.endswith("/") else found.parent)
                    elif name not in foreign:
                        yield f"{where}: {name}"


def missing_names() -> list[str]:
    return [line for path, kind in files() for line in missing_in(path, kind)]


def test_every_named_path_exists():
    missing = missing_names()
    assert not missing, f"{len(missing)} named paths do not exist:\n" + "\n".join(missing)


if __name__ == "__main__":
    print("\n".join(missing_names()))
