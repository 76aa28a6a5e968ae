"""Every ```python block of README.md and docs/*.md runs as written, and every page is reachable.

Conventions (docs/index.md, *Writing docs pages*):
- a block whose first line is ``# torchrun --nproc-per-node N name.py`` runs under torchrun with N CPU ranks
  (OMP_NUM_THREADS=1, a free master port, a timeout); any other block is exec'd in-process in a temporary
  directory;
- every block must print something; an HTML comment ``<!-- expect: REGEX -->`` on the lines right before the
  fence (one or more) adds checks: each REGEX must match the block's output (``re.search``, multiline).

Pages are discovered by glob, so a new page's blocks are tested without touching this file.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = re.compile(r"^# torchrun --nproc-per-node (\d+) (\S+\.py)\b")
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```", flags=re.S | re.M)
EXPECT = re.compile(r"<!--\s*expect:\s*(.*?)\s*-->")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    page: Path
    index: int
    code: str
    expects: tuple[str, ...]
    line: int

    @property
    def id(self) -> str:
        """``docs/page.md#2``, with the script's name for a torchrun block (``#0-quickstart.py``)."""
        launch = self.torchrun
        name = f"-{launch[1]}" if launch else ""
        return f"{self.page.relative_to(ROOT).as_posix()}#{self.index}{name}"

    @property
    def torchrun(self) -> tuple[int, str] | None:
        match = TORCHRUN.match(self.code)
        return (int(match[1]), match[2]) if match else None


def _expects_before(text: str, start: int) -> tuple[str, ...]:
    """The ``<!-- expect: ... -->`` comments on the lines directly above the fence at ``start``."""
    found: list[str] = []
    lines = text[:start].splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    while lines and EXPECT.fullmatch(lines[-1].strip()):
        found.insert(0, EXPECT.fullmatch(lines.pop().strip())[1])
    return tuple(found)


def blocks_of(page: Path) -> list[Block]:
    text = page.read_text()
    return [
        Block(page, i, m[1], _expects_before(text, m.start()), text.count("\n", 0, m.start()) + 1)
        for i, m in enumerate(FENCE.finditer(text))
    ]


ALL_BLOCKS = [b for p in pages() for b in blocks_of(p)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_torchrun(block: Block, nproc: int, name: str, tmp_path: Path) -> str:
    script = tmp_path / name
    script.write_text(block.code)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    cmd += ["--master-port", str(_free_port()), str(script)]  # port 0 hangs torchrun's rendezvous
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    failed = f"{block.id} (line {block.line}) failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    assert proc.returncode == 0, failed
    return proc.stdout


def _run_in_process(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> str:
    monkeypatch.chdir(tmp_path)
    code = compile(block.code, f"{block.id} (line {block.line})", "exec")
    exec(code, {"__name__": "__main__"})
    return capsys.readouterr().out


# peft's PeftModel.from_pretrained in a docs example (lora-and-eval.md) reads transformers' deprecated
# is_gradient_checkpointing: peft's warning about transformers, not the example's
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
@pytest.mark.parametrize("block", ALL_BLOCKS, ids=[b.id for b in ALL_BLOCKS])
def test_python_block_runs(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    launch = block.torchrun
    if launch is not None:
        out = _run_torchrun(block, *launch, tmp_path)
    else:
        out = _run_in_process(block, tmp_path, monkeypatch, capsys)
    assert out.strip(), f"{block.id} (line {block.line}) printed nothing: every docs block must print"
    for pattern in block.expects:
        assert re.search(pattern, out, flags=re.M), f"{block.id}: no match for {pattern!r} in:\n{out[-3000:]}"


def _links(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)  # links inside code are code
    return LINK.findall(text)


def _local(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target) and not target.startswith("#")


@pytest.mark.parametrize("page", pages(), ids=[p.relative_to(ROOT).as_posix() for p in pages()])
def test_relative_links_resolve(page: Path) -> None:
    broken = [t for t in _links(page) if _local(t) and not (page.parent / t.split("#")[0]).exists()]
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def _linked_pages(page: Path) -> set[Path]:
    targets = [(page.parent / t.split("#")[0]).resolve() for t in _links(page) if _local(t)]
    return {p for p in targets if p.suffix == ".md" and p.is_file()}


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    """Linked from README.md, or from docs/index.md when README.md links the index."""
    index = (ROOT / "docs" / "index.md").resolve()
    reachable = _linked_pages(ROOT / "README.md")
    if index in reachable:
        reachable |= _linked_pages(index)
    orphans = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in reachable]
    assert not orphans, f"docs pages linked from neither README.md nor docs/index.md: {orphans}"


@pytest.mark.parametrize("page", pages(), ids=[p.relative_to(ROOT).as_posix() for p in pages()])
def test_no_python_block_escapes_the_runner(page: Path) -> None:
    """An indented fence or a ```py / ```python3 tag would hide a block from the runner: refuse them."""
    text = page.read_text()
    fences = re.findall(r"^[ \t]*```(?:py|python|python3|pycon)[ \t]*$", text, flags=re.M)
    assert len(fences) == len(blocks_of(page)), (
        f"{page.relative_to(ROOT)}: a python block the runner does not see; open it with ```python at "
        "the start of a line"
    )


def test_docs_blocks_are_discovered() -> None:
    """The conventions above are what the pages use: a guard against a fence regex that silently finds
    nothing (and so tests nothing)."""
    launched = [b for b in ALL_BLOCKS if b.torchrun]
    assert len(ALL_BLOCKS) >= 10 and launched, [b.id for b in ALL_BLOCKS]
    assert {n for b in launched for n, _ in [b.torchrun]} >= {2, 4}
    assert all(b.expects for b in launched), [b.id for b in launched if not b.expects]
