"""Every code block of the documentation runs, so the docs cannot rot.

From ``docs/*.md`` and ``README.md``, each page's fenced blocks run in order, in one fresh
subprocess per page (``PJRT_DEVICE=CPU``, a temporary working directory, the repository on
``PYTHONPATH``), so a page reads like one session:

* `````python`` blocks are executed in one namespace; a block whose first line starts with
  ``>>>`` is a doctest, and its printed output must match (``...`` matches anything);
* `````console`` blocks hold ``$ command`` lines followed by their expected output (stdout then
  stderr, ``...`` matches anything), run in the same working directory: ``tiekit ...`` lines
  (optionally followed by ``; echo "exit code $?"``) through ``tiekit.cli.main`` in the page's
  process, which is what the console script calls, anything else with ``bash``;
* other blocks (``text``, ``bash``, plain) are shown, not run.

An HTML comment on the line before a block's fence changes that, and is invisible on the site:

* ``<!-- docs-test: xla -->``: runs only where torch_xla is installed (else skipped);
* ``<!-- docs-test: skip: <reason> -->``: never runs. Only for blocks that need a TPU, a pod or
  a multi-process launch; the reason must say which (checked below).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
HAVE_XLA = importlib.util.find_spec("torch_xla") is not None

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<what>xla|skip)(?::\s*(?P<reason>.*?))?\s*-->\s*$")
SKIP_REASONS = re.compile(r"\b(TPU|pod|multi-process|launch)\b", re.IGNORECASE)
RUN_LANGUAGES = {"python", "console"}


@dataclass(frozen=True)
class Block:
    """One fenced block: its language, its first code line in the page (1-based) and its marker."""

    language: str
    line: int
    code: str
    marker: str = ""
    reason: str = ""


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of ``page`` in order, code dedented to the fence's indentation."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        language = opening["info"].strip().split(" ")[0].lower()
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        body: list[str] = []
        j = i + 1
        while j < len(lines) and not re.match(rf"^{re.escape(indent)}{fence[0]}{{{len(fence)},}}\s*$", lines[j]):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        if j == len(lines):
            raise AssertionError(f"{page.name}:{i + 1}: code block is never closed")
        found.append(
            Block(
                language,
                i + 2,
                "\n".join(body) + "\n",
                marker["what"] if marker else "",
                (marker["reason"] or "") if marker else "",
            )
        )
        i = j + 1
    return found


# The program each page runs in: reads the blocks as JSON on stdin, runs them in order.
RUNNER = textwrap.dedent(
    r"""
    import doctest, json, os, subprocess, sys, traceback

    page, blocks = json.load(sys.stdin)
    namespace = {"__name__": "__main__"}
    checker = doctest.OutputChecker()
    flags = doctest.ELLIPSIS

    def fail(block, message):
        print(f"{page}:{block['line']}: {message}", file=sys.stderr)
        sys.exit(1)

    def run_command(command):
        # `tiekit ...` runs in this process through tiekit.cli.main, which is all the console
        # script does, to save an interpreter start per line; anything else goes to bash.
        tail = '; echo "exit code $?"'
        plain = command.removesuffix(tail)
        if plain.startswith("tiekit ") and not set(plain) & set("|&;<>$`"):
            import contextlib, io, shlex
            from tiekit.cli import main
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    code = main(shlex.split(plain)[1:])
                except SystemExit as exc:
                    code = exc.code if isinstance(exc.code, int) else 1
            got = out.getvalue() + err.getvalue()
            return got + (f"exit code {code}\n" if command.endswith(tail) else "")
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True)
        return done.stdout + done.stderr

    for block in blocks:
        padding = "\n" * (block["line"] - 1)  # tracebacks point at the page's own lines
        if block["language"] == "python" and block["code"].lstrip().startswith(">>>"):
            test = doctest.DocTestParser().get_doctest(padding + block["code"], namespace, page, page, 0)
            runner = doctest.DocTestRunner(optionflags=flags)
            runner.run(test, clear_globs=False)
            if runner.failures:
                fail(block, f"{runner.failures} doctest example(s) failed (see above)")
        elif block["language"] == "python":
            try:
                exec(compile(padding + block["code"], page, "exec"), namespace)
            except BaseException:
                traceback.print_exc()
                fail(block, "this python block raised")
        else:
            command, expected, examples = None, [], []
            for line in block["code"].splitlines():
                if line.startswith("$ "):
                    if command is not None:
                        examples.append((command, expected))
                    command, expected = line[2:], []
                elif command is not None:
                    expected.append(line)
            if command is not None:
                examples.append((command, expected))
            for command, expected in examples:
                got = run_command(command)
                want = "\n".join(expected).rstrip() + "\n" if expected else ""
                if not checker.check_output(want, got, flags):
                    fail(block, f"$ {command}\n--- expected ---\n{want}--- got ---\n{got}")
    print(f"{page}: {len(blocks)} block(s) ran")
    """
)


def runnable(block: Block) -> bool:
    if block.language not in RUN_LANGUAGES or block.marker == "skip":
        return False
    return block.marker != "xla" or HAVE_XLA


def run_page(page: Path, workdir: Path) -> subprocess.CompletedProcess[str]:
    name = page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name
    todo = [asdict(b) for b in blocks(page) if runnable(b)]
    if not todo:
        return subprocess.CompletedProcess([], 0, f"{name}: nothing to run\n", "")
    env = {
        **os.environ,
        "PJRT_DEVICE": "CPU",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        # Keep the pages' console outputs free of library chatter.
        "TRANSFORMERS_VERBOSITY": "error",
        "TQDM_DISABLE": "1",
        "PYTHONWARNINGS": "ignore",
    }
    workdir.mkdir(parents=True, exist_ok=True)
    return subprocess.run(
        [sys.executable, "-c", RUNNER],
        input=json.dumps([name, todo]),
        capture_output=True,
        text=True,
        cwd=workdir,
        env=env,
        timeout=300,
    )


def has_xla_blocks(page: Path) -> bool:
    return any(b.marker == "xla" for b in blocks(page))


# Where torch_xla is installed, the pages with XLA blocks; the others run on the newest-torch
# stack only (their blocks use no XLA, and the features they show are tested on both stacks).
HERE = [p for p in PAGES if not HAVE_XLA or has_xla_blocks(p)]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, subprocess.CompletedProcess[str]]]:
    # Pages are independent: two at a time, one per core.
    with ThreadPoolExecutor(2) as pool:
        futures = {p.name: pool.submit(run_page, p, tmp_path_factory.mktemp(p.stem)) for p in HERE}
        yield {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize(
    "page",
    [p if has_xla_blocks(p) else pytest.param(p, marks=pytest.mark.newest_torch_only) for p in PAGES],
    ids=[p.name for p in PAGES],
)
def test_page_runs(page: Path, results: dict[str, subprocess.CompletedProcess[str]]) -> None:
    result = results[page.name]
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"


def test_markers_are_honest_and_blocks_are_found() -> None:
    counted = {"python": 0, "console": 0}
    for page in PAGES:
        for block in blocks(page):
            where = f"{page.name}:{block.line - 1}"
            if block.marker == "skip":
                assert SKIP_REASONS.search(block.reason), (
                    f"{where}: 'docs-test: skip' is only for blocks that need a TPU, a pod or a multi-process "
                    f"launch, and its reason must say so (got {block.reason!r})"
                )
            if block.language in counted:
                counted[block.language] += 1
    assert counted["python"] >= 20 and counted["console"] >= 3, counted


def test_every_export_has_an_api_entry() -> None:
    """Each name ``import tiekit`` exports is rendered in docs/api.md: its own ``:::`` entry (under
    the module that defines it, as ``tiekit.train.fit``) or a member listed under a module entry."""
    import tiekit

    api = (ROOT / "docs" / "api.md").read_text()
    missing = [
        name
        for name in tiekit.__all__
        if name != "__version__"
        and not re.search(rf"^::: tiekit(\.\w+)*\.{name}$|^ +- {name}$", api, flags=re.MULTILINE)
    ]
    assert not missing, f"docs/api.md has no entry for tiekit.{', tiekit.'.join(missing)}"


def test_extractor_reads_fences_markers_and_indentation(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n<!-- docs-test: xla -->\n```python\nimport torch_xla\n```\n\n- item\n\n  ```python\n"
        "  x = 1\n  if x:\n      y = 2\n  ```\n\n<!-- docs-test: skip: needs a TPU pod -->\n````console\n$ ls\n````\n"
        "```text\nnot run\n```\n"
    )
    found = blocks(page)
    assert [(b.language, b.line, b.marker) for b in found] == [
        ("python", 5, "xla"),
        ("python", 11, ""),
        ("console", 18, "skip"),
        ("text", 21, ""),
    ]
    assert found[1].code == "x = 1\nif x:\n    y = 2\n"
    assert found[2].reason == "needs a TPU pod"
    assert [runnable(b) for b in found] == [HAVE_XLA, True, False, False]


def test_a_failing_block_or_output_fails_its_page(tmp_path: Path) -> None:
    page = tmp_path / "broken.md"
    page.write_text("```python\nx = 1\n```\n\n```python\nassert x == 2, 'the page is wrong'\n```\n")
    result = run_page(page, tmp_path / "work")
    assert result.returncode == 1
    assert "broken.md:6: this python block raised" in result.stderr
    assert 'File "broken.md", line 6' in result.stderr and "the page is wrong" in result.stderr

    page.write_text("```console\n$ echo hello; echo world\nhello\n...\n$ echo one\ntwo\n```\n")
    result = run_page(page, tmp_path / "work")
    assert result.returncode == 1
    assert "broken.md:2: $ echo one\n--- expected ---\ntwo\n--- got ---\none\n" in result.stderr

    page.write_text(">>> no fence\n\n```python\n>>> print(1 + 1)\n3\n```\n")
    result = run_page(page, tmp_path / "work")
    assert result.returncode == 1 and "1 doctest example(s) failed" in result.stderr
