"""The documentation site (mkdocs.yml, issue 44): `mkdocs build --strict` passes, the Reference it generates names
what the code has, and every link resolves, in the site and in the repository's Markdown.

The site is built once, as CI and a reader build it (`python -m mkdocs build --strict` in a subprocess, into a
temporary folder); its HTML is then read back. What the generated pages must name is read here from the code
itself, not from docs/hooks/reference.py: the app's OpenAPI schema (the app built, not started), the typer
command tree, the settings model's fields, the packages' `__all__`, the spec files in replay_format/. A page
written by hand, or one that dropped an endpoint, an option or a setting, fails.

A last build (in this process, on a few pages) plants a link to a missing page and one to a missing anchor, and
checks that the strict build refuses exactly those two, and that a link to a repository file outside docs/ became
its path as code.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from tests.support.markdown import prose_lines

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("mkdocs", reason="mkdocs-material and mkdocstrings are in the test extra (pyproject.toml)")


class Page(HTMLParser):
    """One built HTML page: its element ids, its links, its headings (level, id, text) and the text under each."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.sections: list[dict] = []  # {"level", "id", "title", "text"}
        self._heading: dict | None = None
        self._skip = 0  # inside <script>/<style>
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if attrs.get("name") and tag == "a":
            self.ids.add(attrs["name"])
        for key in ("href", "src"):
            if attrs.get(key) and tag in ("a", "link", "img", "script"):
                self.links.append(attrs[key])
        if tag in ("script", "style"):
            self._skip += 1
        if re.fullmatch(r"h[1-6]", tag):
            self._heading = {"level": int(tag[1]), "id": attrs.get("id", ""), "title": "", "text": ""}
            self.sections.append(self._heading)

    def handle_endtag(self, tag):
        if tag in ("script", "style"):
            self._skip -= 1
        if re.fullmatch(r"h[1-6]", tag):
            self._heading = None

    def handle_data(self, data):
        if self._skip or not self.sections:
            return
        key = "title" if self._heading is not None else "text"
        self.sections[-1][key] += data

    def section(self, title: str) -> str:
        """The text under the heading whose text is `title` (permalink sign dropped), down to the next heading of
        its level or above."""
        for i, s in enumerate(self.sections):
            if s["title"].replace("¶", "").strip() == title:
                end = next((j for j in range(i + 1, len(self.sections))
                            if self.sections[j]["level"] <= s["level"]), len(self.sections))
                return " ".join(x["title"] + " " + x["text"] for x in self.sections[i:end])
        raise AssertionError(f"no heading {title!r}; headings: {[s['title'] for s in self.sections][:40]}")

    def titles(self) -> set[str]:
        return {s["title"].replace("¶", "").strip() for s in self.sections}


@pytest.fixture(scope="module")
def site():
    """The site, built by mkdocs' command line with --strict: (the build's result, the site folder)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "site"
        command = [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", "mkdocs.yml", "-d", str(out)]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180,
                                env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # Material's end-of-life banner
        yield result, out


def plain(text: str) -> str:
    """Prose as a page shows it: code spans without their backticks, white space collapsed."""
    return " ".join(text.replace("`", "").split())


def page(site_dir: Path, uri: str) -> Page:
    path = site_dir / uri / "index.html"
    assert path.is_file(), f"{uri} was not built"
    return Page(path.read_text(encoding="utf-8"))


def test_the_site_builds_with_strict(site):
    result, _ = site
    assert result.returncode == 0, result.stderr[-6000:]


def test_the_http_reference_names_every_operation_of_the_app(site):
    from replay_service.app import create_app
    from replay_service.settings import ServiceSettings

    with tempfile.TemporaryDirectory() as tmp:
        schema = create_app(ServiceSettings(data_dir=Path(tmp) / "data", tokens_file=None)).openapi()
    http = page(site[1], "reference/http")
    assert schema["paths"]
    for path, item in schema["paths"].items():
        for method, op in item.items():
            if method not in ("get", "put", "post", "delete", "patch"):
                continue
            text = http.section(f"{method.upper()} {path}")
            assert plain(op["summary"]) in plain(text), (method, path)
            for param in op.get("parameters", []):
                assert param["name"] in text, (method, path, param["name"])
            for status in op.get("responses", {}):
                assert re.search(rf"\b{status}\b", text), (method, path, status)
            for media in op.get("requestBody", {}).get("content", {}):
                assert media in text, (method, path, media)
    for name, spec in schema["components"]["schemas"].items():
        text = http.section(name)
        for field in spec.get("properties", {}):
            assert field in text, (name, field)


def test_the_cli_reference_names_every_command_and_option(site):
    import typer

    from replay_service.ops.cli import app

    root = typer.main.get_command(app)
    ctx = root.context_class(root, info_name="replay-service")
    cli = page(site[1], "reference/cli")
    names = root.list_commands(ctx)
    assert {"serve", "reindex", "verify", "delete", "gc", "export"} <= set(names)
    for name in names:
        command = root.get_command(ctx, name)
        text = cli.section(f"replay-service {name}")
        for param in command.get_params(root.context_class(command, info_name=name, parent=ctx)):
            for opt in param.opts if param.param_type_name == "option" else [param.name]:
                assert opt in text, (name, opt)
        if command.help:
            assert plain(command.help)[:60] in plain(text), name


def test_the_settings_reference_names_every_variable(site):
    from capture.vllm import config as plugin
    from replay_service.settings import ServiceSettings

    settings = page(site[1], "reference/settings")
    assert len(ServiceSettings.model_fields) > 20
    for name, field in ServiceSettings.model_fields.items():
        text = settings.section(f"REPLAY_{name.upper()}")
        assert plain(field.description or "")[:50].lower() in plain(text).lower(), name
        default = field.default
        if isinstance(default, bool):
            assert ("true" if default else "false") in text, name
        elif isinstance(default, int | float | str):
            assert str(default) in text, name
    plugin_text = settings.section("vLLM plugin: ROUTING_REPLAY_*")
    variables = [v for k, v in vars(plugin).items() if k.startswith("ENV_")]
    assert "ROUTING_REPLAY_URL" in variables
    for variable in variables:
        assert variable in plugin_text, variable


def test_the_python_reference_documents_every_export(site):
    import importlib
    import pkgutil

    import capture
    import replay_client
    import replay_format

    client = page(site[1], "reference/python/replay_client")
    for name in replay_client.__all__:
        assert f"replay_client.{name}" in client.ids, name
    formats = page(site[1], "reference/python/replay_format")
    for name in replay_format.__all__:
        assert f"replay_format.{name}" in formats.ids, name
    for module in pkgutil.iter_modules(replay_format.__path__):
        if module.name != "core" and not module.name.startswith("_"):  # core's names are the package's
            assert f"replay_format.{module.name}" in formats.ids, module.name
            public = getattr(importlib.import_module(f"replay_format.{module.name}"), "__all__", None)
            for name in public or []:
                assert f"replay_format.{module.name}.{name}" in formats.ids, (module.name, name)
    captured = page(site[1], "reference/python/capture")
    for name in capture.__all__:
        home = capture._HOME[name]  # each export is documented where it lives (imported on first use)
        assert f"{home}.{name}" in captured.ids, name


def test_every_format_spec_is_a_page(site):
    specs = sorted((ROOT / "replay_format").glob("*.md"))
    assert len(specs) > 10
    for spec in specs:
        uri = "reference/formats" if spec.name == "README.md" else f"reference/formats/{spec.stem}"
        built = page(site[1], uri)
        first = next(line for line in spec.read_text().splitlines() if line.startswith("# "))
        assert plain(first[2:].replace("**", "")) in built.titles(), spec.name
        for heading in re.findall(r"^## (.+)$", spec.read_text(), re.M):
            assert plain(heading.replace("**", "")) in built.titles(), (spec.name, heading)


def test_every_link_in_the_site_resolves(site):
    site_dir = site[1]
    pages = {p: Page(p.read_text(encoding="utf-8")) for p in site_dir.rglob("*.html")}
    assert len(pages) > 30
    broken: dict[str, list[str]] = {}  # what is missing -> the pages that link to it
    for path, built in pages.items():
        for link in built.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith(("mailto:", "data:")) or not (parts.path or
                                                                                              parts.fragment):
                continue
            if path.name == "404.html" and parts.path.startswith("/"):
                continue  # the 404 page is served at any depth: its links are absolute from the site root
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            missing = None
            if not target.exists():
                missing = str(target.relative_to(site_dir.resolve()) if site_dir.resolve() in target.parents
                              else link)
            elif parts.fragment and target.suffix == ".html":
                ids = pages[target].ids if target in pages else Page(target.read_text()).ids
                if unquote(parts.fragment) not in ids:
                    missing = f"{target.relative_to(site_dir.resolve())}#{parts.fragment}"
            if missing:
                broken.setdefault(missing, []).append(str(path.relative_to(site_dir)))
    assert not broken, "\n".join(f"{missing} (linked from {len(where)} pages: {', '.join(sorted(where)[:3])})"
                                  for missing, where in sorted(broken.items()))


# --------------------------------------------------------------------------------------------------------------
# The repository's own Markdown (outside docs/, which the strict build checks): README.md, CHANGELOG.md, ...

_MD_LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^()\s]+)\)")


def github_anchors(text: str) -> set[str]:
    """The heading anchors GitHub gives a Markdown file (lower case, punctuation dropped, spaces to hyphens, a
    repeated one numbered)."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(text):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def repository_markdown() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    return [ROOT / p for p in listed if not p.startswith("docs/") and (ROOT / p).is_file()]


def test_every_link_in_the_repository_markdown_resolves():
    broken = []
    for md in repository_markdown():
        text = md.read_text(encoding="utf-8")
        body = re.sub(r"`[^`\n]*`", "", "\n".join(prose_lines(text)))  # code holds no links
        for m in _MD_LINK.finditer(body):
            target = m.group(1) or m.group(2)
            parts = urlsplit(target)
            if parts.scheme or parts.netloc or target.startswith("mailto:"):
                continue
            where = md.parent / unquote(parts.path) if parts.path else md
            if not where.exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
            elif parts.fragment and where.suffix == ".md" and parts.fragment not in github_anchors(where.read_text()):
                broken.append(f"{md.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_a_copied_file_links_from_its_own_folder():
    """A file the site copies (CHANGELOG.md, a spec) is read where it lies: its links to docs/ pages and to other
    copied files become links to their pages, one to another repository file its path as code."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_reference_hook", ROOT / "docs" / "hooks" / "reference.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    hook._copies.update({"changelog.md": ROOT / "CHANGELOG.md",
                         "reference/formats/rows.md": ROOT / "replay_format" / "rows.md"})
    text = ("[a design page](docs/design/store.md#the-index) [rows](replay_format/rows.md) "
            "[replay_service/app.py](replay_service/app.py) [gone](no-such-file.md) `[code](docs/index.md)`\n"
            "```\n[fenced](docs/index.md)\n```\n")
    out = hook.rewrite_links(text, source=ROOT / "CHANGELOG.md", page_uri="changelog.md", docs_dir=ROOT / "docs")
    assert out == ("[a design page](design/store.md#the-index) [rows](reference/formats/rows.md) "
                   "`replay_service/app.py` [gone](no-such-file.md) `[code](docs/index.md)`\n"
                   "```\n[fenced](docs/index.md)\n```\n")
    spec_page = hook.rewrite_links("[the row batch](rows.md) [its module](rows.py)", source=ROOT / "replay_format" /
                                   "segment.md", page_uri="reference/formats/segment.md", docs_dir=ROOT / "docs")
    assert spec_page == "[the row batch](rows.md) its module (`replay_format/rows.py`)"


# --------------------------------------------------------------------------------------------------------------
# A planted broken link fails the strict build


# The strict build with a planted page, in a process of its own (as `site` runs mkdocs' command line): in a test
# worker's process it met what earlier files left there (2026-12-06, pytest-xdist: the root logger at ERROR after an
# in-process vLLM engine, so no warning was counted; once a build that ran out the 300 s timeout).
PLANTED_BUILD = """
import json, logging, sys
from mkdocs.commands.build import build
from mkdocs.config import load_config
from mkdocs.exceptions import Abort
from mkdocs.plugins import BasePlugin
from mkdocs.structure.files import File

site_dir, planted, kept = sys.argv[1], sys.argv[2], set(json.loads(sys.argv[3]))


class Plant(BasePlugin):
    def on_files(self, files, config):  # after the hook's: only the planted page and the kept generated pages
        for f in [f for f in files.documentation_pages() if f.src_uri not in kept]:
            files.remove(f)
        files.append(File.generated(config, "planted.md", content=planted))
        return files


warnings = []


class Collect(logging.Handler):
    def emit(self, record):
        if record.levelno >= logging.WARNING:
            warnings.append(record.getMessage())


config = load_config("mkdocs.yml", site_dir=site_dir, strict=True)
config["nav"] = sorted(kept)
plant = Plant()
plant.load_config({})
config.plugins["plant"] = plant
logger = logging.getLogger("mkdocs")
logger.setLevel(logging.INFO)  # as mkdocs' command line sets it
logger.addHandler(Collect())
try:
    build(config)
    aborted = False
except Abort:
    aborted = True
print(json.dumps({"aborted": aborted, "warnings": warnings}))
"""


def test_a_broken_link_fails_the_strict_build(tmp_path):
    planted = ("# Planted\n\n[a page that is not there](no-such-page.md)\n\n"
               "[a setting that is not there](reference/settings.md#replay_no_such_setting)\n\n"
               "[a setting that is](reference/settings.md#replay_data_dir)\n\n"
               "[the app factory](../replay_service/app.py)\n")
    kept = ["planted.md", "reference/settings.md", "reference/cli.md"]  # the two generated pages link each other
    done = subprocess.run([sys.executable, "-c", PLANTED_BUILD, str(tmp_path / "site"), planted, json.dumps(kept)],
                          cwd=ROOT, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["aborted"], said
    warnings = said["warnings"]
    assert len(warnings) == 2, warnings
    assert any("no-such-page.md" in w for w in warnings), warnings
    assert any("replay_no_such_setting" in w for w in warnings), warnings
    html = (tmp_path / "site" / "planted" / "index.html").read_text()
    assert "<code>replay_service/app.py</code>" in html
    assert os.path.exists(tmp_path / "site" / "reference" / "settings" / "index.html")
