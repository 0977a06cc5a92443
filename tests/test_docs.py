"""Every code block in the README and ``docs/*.md`` runs, so a snippet cannot rot while its page stays.

A page's blocks run in order in one namespace (later blocks use earlier names), in a temporary working
directory, one test per page. ``python`` blocks written as a session (``>>>`` lines) are doctests: what
they print is compared, so printed values in the docs cannot go stale. ``bash`` blocks run line by line in a
shell. A block preceded by an HTML comment changes how it runs:

- ``<!-- docs-test: slow -->``: runs only under ``pytest -m slow`` (multi-process or long runs);
- ``<!-- docs-test: skip REASON -->``: never runs here (installs packages); the reason is required;
- ``<!-- docs-test: file NAME -->``: a script the page's next commands run (``torchrun ... NAME``): written to
  ``NAME``, not executed in the test's process.

Other fences (``text``, directives such as ``{toctree}``) are not code.
"""

from __future__ import annotations

import contextlib
import doctest
import io
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE_LANGUAGES = {"python", "bash"}
_MARKER = re.compile(r"<!--\s*docs-test:\s*(slow|skip|file)\s*(.*?)\s*-->")
_FENCE = re.compile(r"^(`{3,})(\S*)")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int          # 1-based line of the opening fence
    language: str
    code: str
    mode: str          # "run", "slow", "skip" or "file"
    reason: str        # why it is skipped; the file name of a "file" block
    expected: tuple[str, ...] = ()   # what the prose after it says it prints (each must be in its output)


_PRINTS = re.compile(r"\bprints `([^`]+)`")


def _expected_output(lines: list[str], after: int) -> tuple[str, ...]:
    """What the paragraph after a block (from line ``after``) says the block prints: the first backticked text after
    "prints", or, where the paragraph says "prints" and ends with a colon, the lines of the ``text`` block after it."""
    i = after
    while i < len(lines) and not lines[i].strip():
        i += 1
    paragraph = []
    while i < len(lines) and lines[i].strip() and not _FENCE.match(lines[i]):
        paragraph.append(lines[i].strip())
        i += 1
    text = " ".join(paragraph)
    if (m := _PRINTS.search(text)) is not None and m.start() < 40:
        return (m.group(1),)
    if "prints" in text and text.endswith(":"):
        while i < len(lines) and not lines[i].strip():
            i += 1
        if i < len(lines) and lines[i].strip() == "```text":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            return tuple(line.strip() for line in lines[i + 1:end] if line.strip())
    return ()


def code_blocks(page: Path) -> list[Block]:
    """The fenced blocks of one page, each with how it must run."""
    lines = page.read_text().splitlines()
    blocks, i, pending = [], 0, None
    while i < len(lines):
        marker = _MARKER.search(lines[i])
        if marker:
            pending = marker.groups()
        fence = _FENCE.match(lines[i])
        if not fence:
            if lines[i].strip() and not marker:
                pending = None
            i += 1
            continue
        ticks, language = fence.groups()
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == ticks)
        if language in CODE_LANGUAGES:
            mode, reason = pending if pending else ("run", "")
            if mode == "skip" and not reason:
                raise ValueError(f"{page.name}:{i + 1}: a skipped block must say why")
            blocks.append(Block(page, i + 1, language, "\n".join(lines[i + 1:end]) + "\n", mode, reason,
                                _expected_output(lines, end + 1)))
        pending = None
        i = end + 1
    return blocks


def _run_python(block: Block, namespace: dict) -> None:
    where = f"{block.page.name}:{block.line}"
    if re.search(r"^\s*>>> ", block.code, flags=re.M):
        test = doctest.DocTestParser().get_doctest(block.code, namespace, where, str(block.page), block.line)
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        out: list[str] = []
        runner.run(test, out=out.append, clear_globs=False)
        namespace.update(test.globs)   # a DocTest runs in a copy of the globals it is given
        if runner.failures:
            pytest.fail(f"{where}: the printed values differ from the page\n" + "".join(out), pytrace=False)
    else:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(block.code, where, "exec"), namespace)
        sys.stdout.write(printed.getvalue())
        _check_printed(block, printed.getvalue())


def _check_printed(block: Block, output: str) -> None:
    """Each line the prose says the block prints is in its output (runs of spaces compared as one)."""
    flat = " ".join(output.split())
    missing = [e for e in block.expected if " ".join(e.split()) not in flat]
    if missing:
        pytest.fail(f"{block.page.name}:{block.line}: the page says it prints {missing}, but it printed:\n"
                    f"{output[-2000:]}", pytrace=False)


def _run_bash(block: Block, cwd: Path) -> None:
    env = dict(os.environ, MPLBACKEND="Agg", PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], cwd=cwd, env=env,
                            capture_output=True, text=True, timeout=1800)
    if result.returncode:
        pytest.fail(f"{block.page.name}:{block.line}: exit {result.returncode}\n{result.stdout[-3000:]}"
                    f"\n{result.stderr[-3000:]}", pytrace=False)
    _check_printed(block, result.stdout)


def _run_page(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, modes: set[str]) -> int:
    """Run a page's blocks whose mode is in ``modes``; the number run."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # the pages refer to the repository's scripts by relative path, as a user in a clone would; a copy, so
    # that what they write stays out of the repository
    for folder in ("examples", "benchmarks"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    namespace: dict = {"__name__": "__docs__"}
    ran = 0
    for block in code_blocks(page):
        if block.mode == "file":
            (tmp_path / block.reason).write_text(block.code)
            continue
        if block.mode not in modes:
            continue
        if block.language == "python":
            _run_python(block, namespace)
        else:
            _run_bash(block, tmp_path)
        ran += 1
    return ran


def _pages_with(mode: str) -> list[Path]:
    return [p for p in PAGES if any(b.mode == mode for b in code_blocks(p))]


def count_blocks() -> dict[str, int]:
    """How many code blocks run by default, only under ``-m slow``, are scripts, or never run."""
    counts = {"run": 0, "slow": 0, "file": 0, "skip": 0}
    for p in PAGES:
        for b in code_blocks(p):
            counts[b.mode] += 1
    return counts


@pytest.mark.parametrize("page", _pages_with("run"), ids=lambda p: p.name)
def test_the_pages_code_blocks_run_as_written(page, tmp_path, monkeypatch):
    assert _run_page(page, tmp_path, monkeypatch, {"run"}) > 0


@pytest.mark.slow
@pytest.mark.parametrize("page", _pages_with("slow"), ids=lambda p: p.name)
def test_the_pages_long_code_blocks_run_as_written(page, tmp_path, monkeypatch):
    assert _run_page(page, tmp_path, monkeypatch, {"run", "slow"}) > 0


def test_every_code_block_is_run_or_says_why_not():
    blocks = [b for p in PAGES for b in code_blocks(p)]
    assert blocks, "no code blocks found: the collector's fence pattern is broken"
    # a page whose only runnable commands are slow still has its scripts written and run under -m slow
    assert all(b.reason for b in blocks if b.mode == "file")
    skipped = [b for b in blocks if b.mode == "skip"]
    assert all(b.reason for b in skipped)
    # installing packages is the only reason a block may never run here
    assert all("install" in b.reason for b in skipped), [f"{b.page.name}:{b.line}" for b in skipped]


def test_the_collector_reads_markers_fences_and_doctests(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("text\n\n```python\nx = 2\n```\n\n<!-- docs-test: slow -->\n```bash\nexit 3\n```\n\n"
                    "```text\nnot code\n```\n\n```python\n>>> x + 1\n4\n```\n")
    blocks = code_blocks(page)
    assert [(b.language, b.mode) for b in blocks] == [("python", "run"), ("bash", "slow"), ("python", "run")]
    (tmp_path / "run").mkdir()
    with pytest.raises(pytest.fail.Exception, match="printed values differ"):   # x + 1 is 3, not 4
        _run_page(page, tmp_path / "run", monkeypatch, {"run"})


def test_what_the_prose_says_a_block_prints_is_checked(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text("```python\nprint('sigma', 2)\n```\n\nIt prints `sigma 2`, as said.\n\n"
                    "```python\nprint('a 1'); print('b  2')\n```\n\nprints the table:\n\n```text\na 1\nb 2\n```\n\n"
                    "```python\nprint(3)\n```\n\nprints `4`.\n")
    blocks = code_blocks(page)
    assert [b.expected for b in blocks] == [("sigma 2",), ("a 1", "b 2"), ("4",)]
    (tmp_path / "run").mkdir()
    with pytest.raises(pytest.fail.Exception, match=r"says it prints \['4'\]"):
        _run_page(page, tmp_path / "run", monkeypatch, {"run"})
