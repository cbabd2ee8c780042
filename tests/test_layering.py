"""The layering contract (pyproject.toml, import-linter): config and parallel below data and model,
below train / convert / evaluate, below glue and the CLI. It holds for the package, and a deliberate
upward import, hidden inside a function, breaks it. The style rules (pyproject.toml, ruff) hold too."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = str(Path(sys.executable).with_name("lint-imports"))


def lint(package_parent: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(package_parent))
    return subprocess.run([LINT, "--config", str(ROOT / "pyproject.toml"), "--no-cache"], cwd=package_parent,
                          env=env, capture_output=True, text=True, timeout=120)


def test_the_package_keeps_its_layers():
    run = lint(ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Contracts: 1 kept, 0 broken." in run.stdout


def test_an_upward_import_inside_a_function_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "megamlm", tmp_path / "megamlm", ignore=shutil.ignore_patterns("__pycache__", "assets"))
    with open(tmp_path / "megamlm/model/heads.py", "a") as f:
        f.write("\n\ndef _sneaky():\n    from megamlm.train.loop import train  # noqa: F401\n")
    run = lint(tmp_path)
    assert run.returncode == 1
    assert "Contracts: 0 kept, 1 broken." in run.stdout
    assert "megamlm.model.heads -> megamlm.train.loop" in run.stdout


def test_the_code_keeps_the_style_rules():
    run = subprocess.run([str(Path(sys.executable).with_name("ruff")), "check", "megamlm", "tests", "benchmarks"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_the_command_line_and_the_tokenizer_workers_start_without_torch():
    """`megamlm --help` and a one-line mistake took ~6 s and 440 MB (every verb's modules, torch and
    megatron-core, imported at the start), and each of `shards build --workers N`'s processes imported the same
    to tokenize text. The verbs import what they run; the package's names load on first use."""
    code = ("import sys, megamlm, megamlm.cli, megamlm.data.tokenizing; "
            "print(sorted(m for m in ('torch', 'megatron', 'deepspeed', 'transformers') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr


def _architecture_tree() -> dict[str, str]:
    """README's Architecture tree as {module path: its line}: a name at two spaces per folder level under the
    folders above it ("a.py, b.py, c/" lines name several); deeper lines continue the line above."""
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Architecture", 1)[1].split("```", 2)[1]
    named, folders = {}, []
    for line in block.splitlines():
        found = re.match(r"^( *)((?:[\w]+\.py, )*[\w]+(?:\.py|/))(?:\s|$)", line)
        if not found or len(found[1]) % 2 or len(found[1]) // 2 > len(folders):
            continue
        folders = folders[: len(found[1]) // 2]
        for name in found[2].split(", "):
            if name.endswith("/"):
                folders.append(name[:-1])
            else:
                named["/".join([*folders, name])] = line.strip()
    return named


def test_the_readmes_architecture_names_every_module_where_it_lives():
    """The tree is the design's living copy (../shared/DESIGN.md): session 59 found 22 of the package's modules
    missing from it and `config.py` where a package of five modules had been."""
    tree = _architecture_tree()
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "megamlm").rglob("*.py")
               if p.name != "__init__.py" and "hf_modeling" not in p.parts} | {"megamlm/cli/__init__.py"}
    assert sorted(modules - set(tree)) == []
    assert sorted(m for m in tree if m.startswith("megamlm/") and not (ROOT / m).exists()) == []
