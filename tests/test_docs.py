"""The documentation: the site builds strict (no broken link or anchor), its generated tables match
their one definition (settings: torch_torus/config.py; algorithms: the C++ catalog), README.md stays
short with its two commands as CI runs them, and the command snippets marked in the docs run."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
MARKER = re.compile(r"<!-- docs-test: (.+?) -->\n```(\w+)\n(.*?)```", re.S)
SNIPPET_TIMEOUT_S = 120


def _env():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    return env


def _generate_tables():
    spec = importlib.util.spec_from_file_location("generate_tables", DOCS / "generate_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_tables_match_their_definitions():
    stale = _generate_tables().stale_pages()
    assert not stale, f"stale generated tables in {sorted(map(str, stale))}: run python docs/generate_tables.py"


def test_a_page_without_its_table_block_is_refused():
    with pytest.raises(ValueError, match="settings-table"):
        _generate_tables().render("no block here", "settings", "| a |")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    pytest.importorskip("mkdocs", reason="mkdocs is not installed (pip install mkdocs==1.6.1 mkdocs-material==9.8.1; "
                                         ".ci/run installs it)")
    pytest.importorskip("material", reason="mkdocs-material is not installed (pip install mkdocs-material==9.8.1; "
                                           ".ci/run installs it)")
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)], cwd=ROOT,
                           env=dict(_env(), NO_MKDOCS_2_WARNING="1"), capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}\n{build.stderr}"
    return out


def test_the_site_builds_strict(site):
    assert (site / "index.html").is_file()
    assert "TORUS_ALLREDUCE" in (site / "algorithms" / "index.html").read_text()
    history = (site / "history" / "index.html").read_text()
    assert "Benchmarks: the history" in history and 'href="../benchmarks/"' in history


def test_readme_links_reach_pages_and_anchors(site):
    readme = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)]+)\)", readme):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        assert (ROOT / path).exists(), f"README.md links to {path}, which does not exist"
        if path.startswith("docs/") and anchor:
            page = site / pathlib.Path(path).relative_to("docs").with_suffix("") / "index.html"
            assert f'id="{anchor}"' in page.read_text(), f"README.md links to {target}: no such anchor"


def test_benchmark_results_stay_summaries():
    files = [path for path in (ROOT / "benchmarks" / "results").rglob("*") if path.is_file()]
    assert sum(path.stat().st_size for path in files) < 1 << 20, "benchmarks/results/ holds 1 MiB or more"
    patches = [path for folder in ("benchmarks", "csrc", "docs", "examples", "tests", "torch_torus")
               for path in (ROOT / folder).rglob("*.patch")]
    assert not patches, f"{patches}: patch files stop applying as the code moves; describe the change instead"


def _ci_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    lines = [line for line in ci.splitlines() if line.rstrip().endswith("python -m pytest tests -q")]
    assert len(lines) == 1, "expected one test command in .ci/run"
    return lines[0]


def test_readme_is_short_and_its_test_command_is_the_one_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert f"```bash\n{_ci_test_command()}\n```" in readme
    assert ("```bash\npip install torch==2.13.0 ninja setuptools wheel && pip install --no-build-isolation -e . && "
            "torchrun --nproc-per-node 4 examples/ddp_resnet50.py --image-size 32\n```") in readme


def _snippets():
    found = []
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        for index, match in enumerate(MARKER.finditer(path.read_text())):
            found.append(pytest.param(match.group(1), match.group(2), match.group(3),
                                      id=f"{path.relative_to(ROOT)}-{index}"))
    return found


def test_some_snippets_are_marked():
    assert len(_snippets()) >= 3


def _needs(how: str) -> tuple[str, list[str]]:
    """A marker's launcher and the distributions its snippet needs: "torchrun --nproc-per-node 2;
    needs accelerate torch-torus" (torch-torus installed: its "torch.backends" entry point)."""
    launcher, _, needs = how.partition(";")
    words = needs.split()
    assert not words or words[0] == "needs", f"unknown snippet marker {how!r}"
    return launcher.strip(), words[1:]


def _missing(distribution: str) -> str | None:
    """Why `distribution` cannot serve a snippet, or None. torch-torus serves one only with the
    entry point that registers "torus" at `import torch` (an install older than it has none)."""
    try:
        found = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
    if distribution == "torch-torus" and not [e for e in found.entry_points if e.group == "torch.backends"]:
        return "installed without its torch.backends entry point (pip install --no-build-isolation -e . again)"
    return None


@pytest.mark.parametrize("how, language, code", _snippets())
def test_marked_snippet_runs(how, language, code, tmp_path):
    how, needs = _needs(how)
    for name in needs:
        missing = _missing(name)
        if missing:
            pytest.skip(f"the snippet needs {name}: {missing}")
    if how == "bash":
        assert language == "bash"
        command = ["bash", "-euo", "pipefail", "-c", code]
    else:
        launcher = how.split()
        assert launcher[0] == "torchrun" and language == "python", f"unknown snippet marker {how!r}"
        script = tmp_path / "snippet.py"
        script.write_text(code)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", *launcher[1:], str(script)]
    result = subprocess.run(command, cwd=ROOT, env=_env(), capture_output=True, text=True,
                            timeout=SNIPPET_TIMEOUT_S)
    assert result.returncode == 0, f"{' '.join(command)} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
