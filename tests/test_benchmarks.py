"""The benchmark harness's provenance rule (benchmarks/_harness.py): a result measured on
code that differs from its commit is not stored, unless asked for with `--allow-dirty`,
and then the docs render it flagged. Run on a throwaway git repository with a section
that measures nothing, so no timing is involved."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import _harness  # noqa: E402


def _git(root, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root,
                   check=True, capture_output=True)


@pytest.fixture
def repo(tmp_path, monkeypatch):
    """A committed tree with src/, benchmarks/results/ and docs/; the harness pointed at it."""
    for path in ("src/mod.py", "benchmarks/results/.keep", "docs/benchmarks.md"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("# Benchmarks\n" if path.startswith("docs") else "x = 1\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "start")
    monkeypatch.setattr(_harness, "ROOT", tmp_path)
    monkeypatch.setattr(_harness, "RESULTS", tmp_path / "benchmarks" / "results")
    monkeypatch.setattr(_harness, "DOCS", tmp_path / "docs" / "benchmarks.md")
    monkeypatch.setattr(_harness, "SCRIPTS", ("demo",))
    docs = Path(_harness.__file__).parent.parent / "docs" / "benchmarks.md"
    before = docs.read_bytes()
    yield tmp_path
    assert docs.read_bytes() == before  # the project's own page is never written


SECTIONS = {"only": lambda args: {"value": 2.0}}


def _run(*argv):
    args = _harness.cli("demo", SECTIONS, argv=list(argv))
    return _harness.run("demo", SECTIONS, lambda s: {"only": f"value {s['only']['value']}"},
                        lambda s: [_harness.target("demo value", ">=", 1,
                                                   {"x": s["only"]["value"]})], args)


def test_clean_tree_stores_and_renders_unflagged(repo):
    # The harness's own outputs (results JSON, docs) do not make the tree dirty: `make
    # bench` runs the scripts one after another.
    _run()
    _run()
    report = json.loads((repo / "benchmarks/results/demo.json").read_text())
    assert report["sections"]["only"]["run"]["dirty"] == []
    assert "uncommitted" not in (repo / "docs/benchmarks.md").read_text()


def test_dirty_tree_is_refused_before_measuring(repo):
    (repo / "src/mod.py").write_text("x = 2\n")
    (repo / "src/new.py").write_text("y = 1\n")
    with pytest.raises(SystemExit, match=r"src/mod\.py.*src/new\.py.*--allow-dirty"):
        _run()
    assert not (repo / "benchmarks/results/demo.json").exists()


def test_allow_dirty_stores_the_diff_hash_and_renders_flagged(repo):
    (repo / "src/mod.py").write_text("x = 2\n")
    _run("--allow-dirty")
    run = json.loads((repo / "benchmarks/results/demo.json").read_text())["sections"]["only"]["run"]
    assert run["dirty"] == ["src/mod.py"] and len(run["diff_sha256"]) == 64
    docs = (repo / "docs/benchmarks.md").read_text()
    assert f"uncommitted changes (src/mod.py; diff sha256 {run['diff_sha256'][:12]})" in docs
    assert "| demo value (uncommitted changes) |" in docs  # the summary row too
    # Another change gives another hash: the stored hash names the code that ran.
    (repo / "src/mod.py").write_text("x = 3\n")
    _run("--allow-dirty")
    again = json.loads((repo / "benchmarks/results/demo.json").read_text())
    assert again["sections"]["only"]["run"]["diff_sha256"] != run["diff_sha256"]


def test_benchmark_scripts_stay_short():
    # A benchmark script is the measurement and its table over the harness, not a second
    # harness: each stays under 350 lines (issue 27, item 13).
    scripts = sorted((Path(_harness.__file__).parent).glob("[!_]*.py"))
    assert len(scripts) >= 6
    lengths = {p.name: len(p.read_text().splitlines()) for p in scripts}
    assert max(lengths.values()) <= 350, lengths
