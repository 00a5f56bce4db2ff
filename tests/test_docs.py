"""The documentation stands alone: every pointer into docs/ and every link out of it resolves.

* No file of the repository cites notes that live outside it.
* Every relative link of a docs/ page (file and, for a Markdown target, its
  section anchor) and every repository path a page cites in code font
  (``attn_symmetry/...py``) exists.
* Every pointer of the form "docs/PAGE.md" or "docs/PAGE.md, 'Section'" in the
  code, the README or the notebooks names an existing page, and a heading of
  that page that starts with the quoted section name.
"""

import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
# Directories that are not the repository's own files (environment, VCS, caches, builds).
SKIP_DIRS = {".venv", ".git", "__pycache__", ".pytest_cache", ".hypothesis", "build"}
# Spelled in pieces, so that this file does not contain what it looks for.
OUTSIDE_NOTES = ("DESIGN" + ".md", ".." + "/shared", "/work" + "/shared")
POINTER_SUFFIXES = (".py", ".md", ".toml", ".ipynb", ".cfg", ".txt")
CODE_ROOTS = ("attn_symmetry", "experiments", "tests", "benchmarks", "colabs", "results")

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE_PATH = re.compile(r"`((?:%s)/[\w./-]*)`" % "|".join(CODE_ROOTS))
POINTER = re.compile(r"docs/([\w-]+\.md)(?:, '([^']+)')?")


def _repository_files():
  """Tracked and untracked files that git does not ignore (workdirs, data and caches are);
  without git, every file outside SKIP_DIRS."""
  try:
    listing = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    listing = None
  if listing is not None:
    for name in sorted(set(listing.decode().split("\0")) - {""}):
      path = ROOT / name
      if path.is_file():  # not a file deleted in the working tree
        yield path
    return
  for dirpath, dirnames, filenames in os.walk(ROOT):
    dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS and not d.endswith(".egg-info")]
    for name in filenames:
      yield pathlib.Path(dirpath) / name


def _pages():
  pages = sorted(DOCS.glob("*.md"))
  assert pages, "docs/ holds no pages"
  return pages


def _without_fences(text: str) -> str:
  """The text with fenced blocks (code, math) blanked out, lines kept."""
  out, fenced = [], False
  for line in text.split("\n"):
    if line.lstrip().startswith("```"):
      fenced = not fenced
      out.append("")
      continue
    out.append("" if fenced else line)
  return "\n".join(out)


def _headings(page: pathlib.Path) -> list[str]:
  return [line.lstrip("#").strip() for line in _without_fences(page.read_text()).split("\n")
          if re.match(r"#{1,6} ", line)]


def _slug(heading: str) -> str:
  """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
  return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_slug_follows_github():
  assert _slug("Stage 2: the matrices of a matched pair") == "stage-2-the-matrices-of-a-matched-pair"
  assert _slug("2-D axial RoPE for ViT") == "2-d-axial-rope-for-vit"
  assert _slug("The commutant H(H)") == "the-commutant-hh"


def test_no_file_cites_notes_outside_the_repository():
  hits = []
  for path in _repository_files():
    data = path.read_bytes()
    for needle in OUTSIDE_NOTES:
      if needle.encode() in data:
        text = data.decode("utf-8", "replace").split("\n")
        lines = [i + 1 for i, line in enumerate(text) if needle in line]
        hits.append(f"{path.relative_to(ROOT)}:{lines} cites {needle}")
  assert not hits, "\n".join(hits)


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.name)
def test_links_of_a_page_resolve(page):
  text = _without_fences(page.read_text())
  broken = []
  for target in LINK.findall(text):
    if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
      continue
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    if not dest.exists():
      broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
    elif anchor and dest.suffix == ".md" and anchor not in {_slug(h) for h in _headings(dest)}:
      broken.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
  for cited in CODE_PATH.findall(text):
    if not (ROOT / cited).exists():
      broken.append(f"`{cited}`: no such path in the repository")
  assert not broken, f"{page.name}:\n" + "\n".join(broken)


def test_pointers_into_docs_resolve():
  headings = {page.name: _headings(page) for page in _pages()}
  broken, count = [], 0
  for path in _repository_files():
    if path.suffix not in POINTER_SUFFIXES or path == pathlib.Path(__file__).resolve():
      continue
    for number, line in enumerate(path.read_text(errors="replace").split("\n"), 1):
      for page, section in POINTER.findall(line):
        count += 1
        where = f"{path.relative_to(ROOT)}:{number}"
        if page not in headings:
          broken.append(f"{where}: docs/{page} does not exist")
        elif section and not any(h.startswith(section) for h in headings[page]):
          broken.append(f"{where}: docs/{page} has no section '{section}' "
                        f"(headings: {headings[page]})")
  assert count, "no file points into docs/"
  assert not broken, "\n".join(broken)


@pytest.mark.slow
def test_the_readmes_library_examples_run():
  """Every Python block of the README's "The library" section runs as written (its asserts
  included), each in a fresh namespace."""
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    text = f.read()
  section = text.split("\n## The library\n", 1)[1].split("\n## ", 1)[0]
  blocks = re.findall(r"```python\n(.*?)```", section, re.S)
  assert len(blocks) >= 2
  for block in blocks:
    exec(compile(block, "README.md", "exec"), {})  # pylint: disable=exec-used
