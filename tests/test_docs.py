"""The documentation keeps its promises: every relative link of README.md and docs/*.md resolves
(to a file, and an `#anchor` to a heading of it), no tracked text file names a path of one
machine, and every shell block marked runnable on CPU runs (slow: those are real runs).

A runnable block is a fenced `bash` or `sh` block whose previous non-blank line is
`<!-- runnable: cpu -->`, or `<!-- runnable: cpu; test appends: <flags> -->`: the test appends
those flags to every `python -m jaxrl.train` command of the block (to make a long run short; the
command stays what the reader types). The block runs under `bash -e` in an empty directory with
`configs/` linked to the recipes, the small data it names made there (docs/testing.md).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
LINK = re.compile(r"\[[^\]]*\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)")
MARKER = re.compile(r"^<!--\s*runnable:\s*cpu\s*(?:;\s*test appends:\s*(.*?))?\s*-->\s*$")


def prose_lines(text: str) -> list[tuple[int, str]]:
  """(line number, line) of the lines outside fenced code blocks (a fence closes on a fence of
  the same character at least as long)."""
  out, fence = [], ""
  for i, line in enumerate(text.splitlines(), 1):
    m = FENCE.match(line)
    if m and not fence:
      fence = m.group(1)
    elif m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and \
        not line.strip()[len(m.group(1)):]:
      fence = ""
    elif not fence:
      out.append((i, line))
  return out


def slug(heading: str) -> str:
  """A heading's anchor as GitHub makes it: link and code marks dropped, lower case, punctuation
  other than '-' and '_' removed, spaces to '-'."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
  text = text.replace("`", "").lower()
  text = re.sub(r"[^\w\- ]", "", text)
  return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
  seen: dict[str, int] = {}
  out = set()
  for _, line in prose_lines(path.read_text(encoding="utf-8")):
    m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
    if m:
      s = slug(m.group(1))
      n = seen.get(s, 0)
      seen[s] = n + 1
      out.add(s if n == 0 else f"{s}-{n}")
  return out


def test_slug_matches_githubs_anchors():
  assert slug("Run directories") == "run-directories"
  assert slug("`rollout.lag` and the *gate*, 2026-11-27") == "rolloutlag-and-the-gate-2026-11-27"
  assert slug("jaxrl vs TRL (issue 22 workload)") == "jaxrl-vs-trl-issue-22-workload"


def test_every_relative_link_resolves():
  bad = []
  for doc in DOCS:
    for lineno, line in prose_lines(doc.read_text(encoding="utf-8")):
      for target in LINK.findall(line):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
          continue
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        where = f"{doc.relative_to(ROOT)}:{lineno}: {target}"
        if not dest.exists():
          bad.append(f"{where}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
          bad.append(f"{where}: no heading #{anchor} in {dest.relative_to(ROOT)}")
  assert not bad, "\n".join(bad)


# A path rooted in one machine's directories (scratch, home, a checkout, an install prefix), or
# an absolute path into a virtualenv. Built from parts so this file does not name one itself.
MACHINE_DIRS = ["work", "home", "Users", "opt", "root", "tmp", "mnt", "scratch", "private"]
MACHINE_PATH = re.compile(
    r"(?<![\w.~$}{)\]-])/(?:" + "|".join(MACHINE_DIRS) + r")/[\w.-]"
    + r"|(?<![\w.~$}{)\]-])/[\w.-]+(?:/[\w.-]+)*/\.?venv/")
# Recorded run directories: the paths in them are what that run wrote, data rather than advice.
ALLOWED = ("tests/fixtures/",)


def _git_files(root: Path, *flags: str) -> list[str]:
  try:
    return [p for p in subprocess.run(["git", "ls-files", *flags], cwd=root, capture_output=True,
                                      text=True, check=True).stdout.split("\n") if p]
  except (OSError, subprocess.CalledProcessError):
    pytest.skip("not a git checkout")


def checked_text_files(root: Path = ROOT) -> list[Path]:
  """The files the machine-path check reads: the tracked ones (staged included), and untracked
  ones in a top-level folder that holds tracked files (a new doc or module before `git add`;
  what the repo's own tools write there). Never the checkout's other untracked things: a
  virtualenv of any name (its scripts hold absolute paths), a user's run directories."""
  tracked = _git_files(root)
  folders = {p.split("/", 1)[0] for p in tracked if "/" in p}
  untracked = [p for p in _git_files(root, "-o", "--exclude-standard")
               if "/" in p and p.split("/", 1)[0] in folders]
  return [root / p for p in tracked + untracked if not p.startswith(ALLOWED) and
          (root / p).is_file() and not _in_virtualenv(root, p)]


def _in_virtualenv(root: Path, path: str) -> bool:
  """`path` lies under a folder holding `pyvenv.cfg` (a virtualenv, whatever its name)."""
  parts = path.split("/")[:-1]
  return any((root.joinpath(*parts[:i]) / "pyvenv.cfg").is_file() for i in range(1, len(parts) + 1))


def machine_paths(root: Path = ROOT) -> list[str]:
  """`file:line: text` of every line of `checked_text_files(root)` naming a machine path."""
  bad = []
  for path in checked_text_files(root):
    try:
      text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
      continue  # binary
    for lineno, line in enumerate(text.splitlines(), 1):
      if MACHINE_PATH.search(line):
        bad.append(f"{path.relative_to(root)}:{lineno}: {line.strip()[:120]}")
  return bad


def test_machine_path_pattern():
  sep = "/"
  assert MACHINE_PATH.search(f"{sep}work{sep}main/README.md")
  assert MACHINE_PATH.search(f"default {sep}home{sep}me{sep}trl-venv/bin/python")
  assert MACHINE_PATH.search(f"{sep}srv{sep}x{sep}.venv/bin/python")
  assert not MACHINE_PATH.search("~/trl-venv/bin/python and runs/tmp/x and .venv/bin/activate")
  assert not MACHINE_PATH.search(f"https://example.com{sep}home{sep}x and $HOME{sep}work{sep}x")


def test_no_absolute_machine_paths():
  bad = machine_paths()
  assert not bad, "absolute machine paths (use a flag, an environment variable or a relative " \
      "path):\n" + "\n".join(bad)


VENV_NAMES = ("venv", ".venv", "env", ".env", "ENV", "env.bak", "venv.bak")


def test_a_virtualenv_in_the_checkout_is_not_read(tmp_path):
  # A checkout (without the repo's .gitignore) with a virtualenv made in it as `venv/`, and a
  # copy inside a tracked folder: their scripts hold the checkout's absolute path, and the check
  # must read neither. A machine path in a tracked file, or in a new untracked doc, is found.
  sep = "/"
  subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
  (tmp_path / "docs").mkdir()
  (tmp_path / "docs" / "guide.md").write_text("run `. .venv/bin/activate` first\n")
  (tmp_path / "docs" / "old.md").write_text(f"see {sep}home{sep}me{sep}notes\n")
  subprocess.run(["git", "add", "docs"], cwd=tmp_path, check=True)
  (tmp_path / "docs" / "draft.md").write_text(f"x {sep}work{sep}y\n")
  subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")],
                 check=True)
  shutil.copytree(tmp_path / "venv", tmp_path / "docs" / "sandbox", symlinks=True)
  activate = (tmp_path / "venv" / "bin" / "activate").read_text()
  assert MACHINE_PATH.search(activate), "the venv's script names its absolute path"
  assert sorted(machine_paths(tmp_path)) == [f"docs/draft.md:1: x {sep}work{sep}y",
                                             f"docs/old.md:1: see {sep}home{sep}me{sep}notes"]
  # The usual names are ignored by the repo's .gitignore, so git lists none of their files.
  # (Asked in a new repo holding only that .gitignore: in the checkout git refuses any path under
  # a venv folder that is a symbolic link, and lists none.)
  probe = tmp_path / "probe"
  subprocess.run(["git", "init", "-q", str(probe)], check=True)
  shutil.copy(os.path.join(ROOT, ".gitignore"), probe / ".gitignore")
  listed = subprocess.run(["git", "check-ignore", "--no-index", *[f"{n}/bin/activate"
                                                                  for n in VENV_NAMES]],
                          cwd=probe, capture_output=True, text=True).stdout.split()
  assert listed == [f"{n}/bin/activate" for n in VENV_NAMES]


def runnable_blocks() -> list[tuple[str, str, str]]:
  """(file:line, script, flags to append) of every block marked runnable on CPU."""
  blocks = []
  for doc in DOCS:
    text = doc.read_text(encoding="utf-8")
    lines = text.splitlines()
    for lineno, line in prose_lines(text):
      m = MARKER.match(line)
      if not m:
        continue
      i = lineno - 1
      j = i + 1
      while j < len(lines) and not lines[j].strip():
        j += 1
      where = f"{doc.relative_to(ROOT)}:{i + 1}"
      fence = lines[j].strip() if j < len(lines) else ""
      assert fence in ("```bash", "```sh"), f"{where}: the marker must precede a bash/sh block"
      end = next(k for k in range(j + 1, len(lines)) if lines[k].strip() == "```")
      blocks.append((where, "\n".join(lines[j + 1:end]) + "\n", m.group(1) or ""))
  return blocks


def with_appended(script: str, flags: str) -> str:
  """`script` with `flags` appended to each `python -m jaxrl.train` command (continuation lines
  joined first)."""
  if not flags:
    return script
  out = []
  for command in script.replace("\\\n", " ").splitlines():
    if re.search(r"(^|\s)python -m jaxrl\.train(\s|$)", command):
      head, sep, comment = command.partition(" # ")
      command = f"{head.rstrip()} {flags}" + (f"  # {comment}" if sep else "")
    out.append(command)
  return "\n".join(out) + "\n"


def test_runnable_blocks_are_marked_and_parsed():
  blocks = runnable_blocks()
  assert any(w.startswith("README.md") for w, _, _ in blocks), "README.md has no runnable block"
  script = "python -m jaxrl.train --config.a=1 \\\n    --config.b=2   # a run\nls\n"
  assert with_appended(script, "--config.c=3") == \
      "python -m jaxrl.train --config.a=1      --config.b=2 --config.c=3  # a run\nls\n"


# Small data a block may name, made in its directory: a tiny random Qwen2 checkpoint in Hugging
# Face format where the Qwen recipe looks, and GSM8K-format JSONL with the real test split's 1,319
# rows (so a command that bounds its validation is seen to).
QWEN_DIR = "models/Qwen2.5-0.5B-Instruct"
GSM8K_TEST_ROWS = 1319


def make_qwen(path: Path) -> None:
  sys.path.insert(0, str(ROOT / "tests"))
  from hf_fixtures import qwen_files
  from jaxrl.data.hf_tokenizer import HFTokenizer
  from jaxrl.models import ModelConfig, init_model
  from jaxrl.models.hf_checkpoint import save_hf

  qwen_files(path)
  cfg = ModelConfig(vocab_size=HFTokenizer.from_dir(path).vocab_size + 13, d_model=64,
                    num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128,
                    scan_layers=True, rope_theta=1e6, qkv_bias=True, tie_embeddings=True)
  _, params = init_model(cfg, seed=0)
  save_hf(path, cfg, params, architecture="Qwen2ForCausalLM")


def make_gsm8k(path: Path, rows: int) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "w") as f:
    for i in range(rows):
      a, b = i % 50, i // 50 + 1
      f.write(json.dumps({"question": f"Tom has {a} apples and buys {b} more. How many now?",
                          "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n")


@pytest.mark.slow
@pytest.mark.parametrize("where,script,flags",
                         [pytest.param(*block, id=block[0]) for block in runnable_blocks()])
def test_runnable_block_runs_on_cpu(tmp_path, where, script, flags):
  (tmp_path / "configs").symlink_to(ROOT / "jaxrl" / "recipes")
  if QWEN_DIR in script or "qwen2_5_0_5b" in script:
    make_qwen(tmp_path / QWEN_DIR)
  if "data/gsm8k" in script:
    make_gsm8k(tmp_path / "data/gsm8k/train.jsonl", 64)
    make_gsm8k(tmp_path / "data/gsm8k/test.jsonl", GSM8K_TEST_ROWS)
  env = dict(os.environ, JAXRL_WARMUP_CACHE_DIR=str(tmp_path / "warmup-cache"))
  # As a reader's machine has it: one CPU device, not the suite's eight.
  env["XLA_FLAGS"] = re.sub(r"--xla_force_host_platform_device_count=\d+", "",
                            env.get("XLA_FLAGS", "")).strip()
  env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
  run = subprocess.run(["bash", "-e", "-c", with_appended(script, flags)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=1500)
  tail = f"{where}\n$ {shlex.quote(script)}\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
  assert run.returncode == 0, tail
  assert "Traceback" not in run.stderr, tail
