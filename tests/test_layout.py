"""The package's shape, read from its source with `ast` (nothing is imported): the layers of
`docs/architecture.md` (each folder imports only from its own layer or below), no import circle
between modules (imports under `TYPE_CHECKING` count), no `jaxrl` import inside a function
outside `cli/` unless it keeps an optional extra optional (commented), only the command shims
directly in `jaxrl/`, no two module names that differ only by a suffix, no module over 500 lines and no
function over 100 (the recipes' `get_config` aside)."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "jaxrl"

# docs/architecture.md, "The layers": lowest first.
LAYERS = [
    ("core", "recipes"),
    ("losses", "kernels", "models", "parallel", "envs", "data"),
    ("rollout", "pipeline", "learner", "runtime", "observe", "config"),
    ("run", "serving", "aot"),
    ("cli", "train", "evaluate", "export", "plot", "serve", "plan"),  # cli/ and the `python -m jaxrl.X` shims
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every module of the package."""
  out = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
      parts = parts[:-1]
    out[".".join(parts)] = path
  return out


MODULES = _modules()


def _target(name: str) -> str:
  """The module an import of dotted `name` loads last: `name` itself, or the nearest enclosing
  module (`from jaxrl.pipeline import LagPipeline` reads `jaxrl.pipeline`)."""
  while name not in MODULES:
    name = name.rpartition(".")[0]
  return name


def _imports(path: pathlib.Path) -> list[tuple[str, int, bool]]:
  """`(module, line, inside a function)` of every jaxrl import in `path`."""
  tree = ast.parse(path.read_text())
  found = []

  def visit(node, in_function: bool):
    for child in ast.iter_child_nodes(node):
      inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                ast.Lambda))
      if isinstance(child, ast.Import):
        for alias in child.names:
          if alias.name.split(".")[0] == "jaxrl":
            found.append((_target(alias.name), child.lineno, in_function))
      elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module and \
          child.module.split(".")[0] == "jaxrl":
        for alias in child.names:
          found.append((_target(f"{child.module}.{alias.name}"), child.lineno, in_function))
      visit(child, inner)

  visit(tree, False)
  return found


def _folder(module: str) -> str:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else "core"  # `jaxrl` itself imports nothing


GRAPH = {m: _imports(p) for m, p in MODULES.items()}


def test_every_folder_has_a_layer():
  assert {_folder(m) for m in MODULES} <= set(LAYER), sorted({_folder(m) for m in MODULES}
                                                            - set(LAYER))


def test_no_import_from_a_higher_layer():
  upward = [f"{m} (layer {LAYER[_folder(m)]}) imports {t} (layer {LAYER[_folder(t)]}), line {n}"
            for m, edges in GRAPH.items() for t, n, _ in edges
            if LAYER[_folder(t)] > LAYER[_folder(m)]]
  assert not upward, "\n".join(upward)


def test_the_command_shims_import_only_cli():
  for shim in ("train", "evaluate", "export", "plot", "serve", "plan"):
    assert {_folder(t) for t, _, _ in GRAPH[f"jaxrl.{shim}"]} == {"cli"}, shim


def test_no_import_circle():
  edges = {m: sorted({t for t, _, _ in es if t != m}) for m, es in GRAPH.items()}
  state: dict[str, int] = {}  # 1: on the current path, 2: done
  path: list[str] = []

  def walk(m):
    state[m] = 1
    path.append(m)
    for t in edges[m]:
      if state.get(t) == 1:
        raise AssertionError("import circle: " + " -> ".join(path[path.index(t):] + [t]))
      if t not in state:
        walk(t)
    path.pop()
    state[m] = 2

  for m in sorted(edges):
    if m not in state:
      walk(m)


def test_imports_inside_functions_only_in_cli_or_for_an_extra():
  lines = {m: MODULES[m].read_text().splitlines() for m in MODULES}
  bad = []
  for m, edges in GRAPH.items():
    if LAYER[_folder(m)] == LAYER["cli"]:
      continue
    for t, n, inside in edges:
      # The comment saying which extra it keeps optional: on the line or just above it.
      near = " ".join(lines[m][max(0, n - 3):n]).lower()
      if inside and "extra" not in near:
        bad.append(f"{m}:{n} imports {t} inside a function")
  assert not bad, "\n".join(bad)


def test_only_the_command_shims_are_directly_in_the_package():
  top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
  assert top == sorted(f"{m}.py" for m in LAYERS[-1][1:]), top


SUFFIXES = ("s", "es", "er", "ers", "ing", "ion", "ions", "ation", "or", "ors")


def _confusable(a: str, b: str) -> bool:
  """`b` is `a` plus a suffix: a word after "_", or an inflection (plot/plotting,
  evaluate/evaluation, sampler/samplers, train/trainer)."""
  if a == b or not b.startswith(a[:-1]):
    return False
  rest = b[len(a):] if b.startswith(a) else None
  if rest is not None and (rest.startswith("_") or rest in SUFFIXES or
                           (rest[:1] == a[-1:] and rest[1:] in SUFFIXES)):
    return True
  # A final "e" dropped before the suffix: evaluate -> evaluation.
  return a.endswith("e") and b[len(a) - 1:] in SUFFIXES[4:]


# The command `python -m jaxrl.serve` (named by its users' habits) next to the package it runs.
NAMED_PAIRS = {("serve", "serving")}


def test_no_two_module_names_differ_only_by_a_suffix():
  # Recipes are named for the model and task they train; the others for their job.
  names = sorted({part for m in MODULES for part in m.split(".")[1:]}
                 - {m.split(".")[-1] for m in MODULES if m.startswith("jaxrl.recipes.")})
  pairs = [(a, b) for a in names for b in names if _confusable(a, b)
           and (a, b) not in NAMED_PAIRS]
  assert not pairs, pairs


@pytest.mark.parametrize("a,b", [("plot", "plotting"), ("evaluate", "evaluation"),
                                 ("sampler", "samplers"), ("train", "trainer"),
                                 ("config", "config_schema"), ("config", "configs")])
def test_the_suffix_rule_catches_the_pairs_it_is_for(a, b):
  assert _confusable(a, b)


@pytest.mark.parametrize("a,b", [("state", "stats"), ("distill", "distributed"),
                                 ("common", "pallas_common"), ("tokenizer", "hf_tokenizer")])
def test_the_suffix_rule_passes_names_that_only_share_letters(a, b):
  assert not _confusable(a, b) and not _confusable(b, a)


def test_module_and_function_sizes():
  too_long = []
  for m, path in MODULES.items():
    src = path.read_text()
    if len(src.splitlines()) > 500:
      too_long.append(f"{m}: {len(src.splitlines())} lines")
    for node in ast.walk(ast.parse(src)):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        n = node.end_lineno - first + 1
        if n > 100 and not (m.startswith("jaxrl.recipes.") and node.name == "get_config"):
          too_long.append(f"{m}.{node.name}: {n} lines")
  assert not too_long, "\n".join(too_long)


def test_the_loop_is_short():
  # The run's successor of the old 523-line trainer, and the RL loop itself.
  assert len(MODULES["jaxrl.run.driver"].read_text().splitlines()) <= 300
  tree = ast.parse(MODULES["jaxrl.run.loop"].read_text())
  rl = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "rl")
  assert rl.end_lineno - rl.lineno + 1 <= 80
  assert len(rl.args.args) + len(rl.args.kwonlyargs) <= 6
