"""`python -m jaxrl.serve --openai`: bad command lines end as one line `jaxrl: ...` before anything
is loaded, and a Hugging Face directory is served to an `openai` client on an ephemeral port."""

import os
import re
import subprocess
import sys

import pytest

from jaxrl.cli import serve


@pytest.mark.parametrize("argv,want", [
    (["--hf", "x"], "name the protocol to serve: --openai"),
    (["--openai"], "give --run <run dir> or --hf <model dir>"),
    (["--openai", "--hf", "x", "--step", "3"], "--step needs --run"),
    (["--openai", "--hf", "x", "--num_slots", "0"], "--num_slots=0 must be >= 1"),
    (["--openai", "--hf", "x", "--port", "70000"], "--port=70000 must be in [0, 65535]"),
    (["--openai", "--hf", "/no/such/dir"], "/no/such/dir is not a directory"),
])
def test_bad_command_lines_end_as_one_line(argv, want, capsys):
  assert serve.main(argv) == 1
  err = capsys.readouterr().err
  assert err.startswith("jaxrl: ") and want in err and err.count("\n") == 1, err


def test_unknown_flags_end_as_one_line(capsys):
  with pytest.raises(SystemExit) as e:
    serve.main(["--openai", "--bogus"])
  assert e.value.code == 1
  err = capsys.readouterr().err
  assert err.startswith("jaxrl: python -m jaxrl.serve: unrecognized arguments: --bogus")


@pytest.mark.slow  # a child process that loads, compiles and serves: ~30 s on 2 busy cores
def test_serves_a_hugging_face_directory(tmp_path):
  openai = pytest.importorskip("openai")
  from openai_models import qwen_model

  tok, _, _ = qwen_model(tmp_path / "m")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen([sys.executable, "-m", "jaxrl.serve", "--openai", "--hf",
                           str(tmp_path / "m"), "--port", "0", "--max_prompt_len", "128",
                           "--max_new_tokens", "8", "--num_slots", "2"],
                          stderr=subprocess.PIPE, text=True, env=env)
  try:
    url = None
    for line in proc.stderr:
      m = re.search(r"serving 'm' at (http://127\.0\.0\.1:\d+/v1)", line)
      if m:
        url = m.group(1)
        break
    assert url, "the server never said where it listens"
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    ids = r.choices[0].model_extra["token_ids"]
    assert 1 <= len(ids) <= 8 and tok.decode(ids) == r.choices[0].message.content
    assert [m.id for m in client.models.list().data] == ["m"]
  finally:
    proc.terminate()
    proc.wait(60)


def test_run_directories_that_cannot_be_served_end_as_one_line(tmp_path, capsys):
  assert serve.main(["--openai", "--run", str(tmp_path)]) == 1
  assert "config.json is missing" in capsys.readouterr().err
  (tmp_path / "config.json").write_text("{}")
  assert serve.main(["--openai", "--run", str(tmp_path)]) == 1
  err = capsys.readouterr().err
  assert err.startswith("jaxrl: ") and "not started from a Hugging Face model" in err
