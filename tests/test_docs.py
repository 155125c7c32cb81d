"""The docs site builds in strict mode, its generated pages are current, and its commands are the ones CI runs."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# A fenced bash block and the HTML comment right above it (if any).
BLOCK = re.compile(r"(?:<!--\s*(?P<mark>.*?)\s*-->\s*\n)?```bash\n(?P<body>.*?)```", re.S)


def ci_commands() -> dict[str, str]:
    """The README's commands marked ``<!-- ci: NAME -->``, which .ci/run runs, by name."""
    found = {}
    for match in BLOCK.finditer(README.read_text()):
        mark = match.group("mark") or ""
        if mark.startswith("ci: "):
            found[mark[4:].strip()] = match.group("body").strip()
    return found


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs and mkdocs-material are not installed: pip install 'asyncrl[docs]' (scripts/install.sh does on CPU)",
)
def test_the_site_builds_in_strict_mode(tmp_path):
    """A broken link, a missing anchor, a page out of the nav or any other warning fails the build."""
    done = run("-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "reference" / "config" / "index.html").exists()


def test_the_generated_reference_pages_are_current():
    done = run("scripts/gen_reference.py", "--check")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_benchmark_tables_and_headline_are_current():
    """bench/README.md, headline.json, the README's headline block and docs/benchmarks.md, from the records."""
    done = run("bench/report.py", "--check")
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_getting_started_command_runs_in_ci_or_says_why_not():
    """A block marked ``<!-- ci: NAME -->`` is run by CI: the README's command of that name, or a page's own
    (``.ci/docs_commands.py`` lists those for ``.ci/run``); any other block says ``<!-- not in ci: REASON -->``."""
    commands = ci_commands()
    assert set(commands) == {"quickstart", "tests"}
    problems, own = [], {}
    pages = sorted((ROOT / "docs" / "getting-started").glob("*.md"))
    assert pages
    for page in pages:
        for match in BLOCK.finditer(page.read_text()):
            mark, body = (match.group("mark") or "").strip(), match.group("body").strip()
            where = f"{page.relative_to(ROOT)}: {body.splitlines()[0]!r}"
            if mark.startswith("ci: "):
                name = mark[4:].strip()
                if name in commands and commands[name] != body:
                    problems.append(f"{where} is marked ci: {name} but is not the README's command of that name")
                elif name not in commands and own.setdefault(name, body) != body:
                    problems.append(f"{where}: two commands are marked ci: {name}")
            elif not re.fullmatch(r"not in ci: \S.*", mark, re.S):
                problems.append(
                    f"{where} is neither run in CI (<!-- ci: NAME -->) nor marked <!-- not in ci: REASON -->"
                )
    assert not problems, "\n".join(problems)
    listed = run(".ci/docs_commands.py").stdout.split()
    assert set(listed[1::2]) == {*own, *(set(listed[1::2]) & set(commands))}, "CI runs every page's own command"
    assert own, "the getting-started pages show CPU commands of their own, and CI runs them"


def test_the_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 200
    for name in ("quickstart", "tests"):
        assert f"<!-- ci: {name} -->\n```bash\n" in text
    for anchor in ("processes", "ray", "backends", "status", "configuration", "your-dataset-and-reward"):
        assert f'<a id="{anchor}"></a>' in text, f"README.md#{anchor} is linked from elsewhere: keep it"


def test_readme_links_into_docs_resolve():
    """The README is not part of the site, so its links into docs/ are checked here."""
    text = README.read_text()
    missing = []
    for target in re.findall(r"\]\((docs/[^)#]*)(?:#[^)]*)?\)", text):
        if not (ROOT / target).exists():
            missing.append(target)
    assert not missing, f"README links to missing docs: {missing}"
