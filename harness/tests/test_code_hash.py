"""`goldens.code_hash`: a hash of the code files themselves, so that a result names the code it ran even where the
checkout's .git is stale (the device machine's copy: session 26's bench rows recorded 3381012 while the tree was
69c89cb). On a scratch git repository: the files on disk and the same files at a commit hash alike; an edit to a
model / kernel / harness .py changes it, other files do not; `dsv4 goldens code RESULT` exits 0 / 1 / 2."""
import json
import os
import subprocess

import pytest
from click.testing import CliRunner

from dsv4.harness import goldens as G
from dsv4.harness.cli import main


def _git(repo, *args):
    subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(repo), "PATH": os.environ["PATH"]})


@pytest.fixture
def repo(tmp_path, monkeypatch):
    for f, text in {"model/a.py": "x = 1\n", "kernels/k/b.py": "y = 2\n", "harness/c.py": "z = 3\n",
                    "slices/P1/test_p.py": "w = 4\n", "model/notes.md": "n\n"}.items():
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text(text)
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "one")
    monkeypatch.setattr(G, "REPO", tmp_path)
    return tmp_path


def test_disk_and_commit_agree_and_only_code_moves_it(repo):
    h0 = G.code_hash()
    assert h0 == G.code_hash("HEAD") and len(h0) == 16
    (repo / "slices/P1/test_p.py").write_text("w = 5\n")            # not code a number depends on
    (repo / "model/notes.md").write_text("m\n")                     # not a .py file
    (repo / "model/__pycache__").mkdir()
    (repo / "model/__pycache__/a.py").write_text("cached\n")
    assert G.code_hash() == h0
    (repo / "kernels/k/b.py").write_text("y = 3\n")
    assert G.code_hash() != h0 and G.code_hash("HEAD") == h0        # the disk moved, the commit did not
    _git(repo, "commit", "-qam", "two")
    assert G.code_hash() == G.code_hash("HEAD") != G.code_hash("HEAD~1") == h0
    (repo / "harness/d.py").write_text("")                          # a new (empty) file counts too
    assert G.code_hash() != G.code_hash("HEAD")


def test_goldens_code_judges_a_result(repo, tmp_path):
    at = G.code_hash("HEAD")
    run = lambda *a: CliRunner().invoke(main, ["goldens", "code", *a])   # noqa: E731
    ok, bad, old = (tmp_path / n for n in ("ok.json", "bad.json", "old.json"))
    ok.write_text(json.dumps({"provenance": {"code_hash": at}, "results": [{"impl": "ours", "code_hash": at}]}))
    bad.write_text(json.dumps({"provenance": {"code_hash": at}, "results": [{"impl": "ours", "code_hash": "0" * 16}]}))
    old.write_text(json.dumps({"provenance": {"git_sha": "abc"}}))
    r = run(str(ok), "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["mismatch"] == []
    r = run(str(bad), "--json")
    assert r.exit_code == 1 and json.loads(r.stdout)["mismatch"] == ["results[0] ours"]
    for args in ([str(old)], [str(tmp_path / "none.json")], [str(ok), "--at", "nosuchrev"]):
        r = run(*args)
        assert r.exit_code == 2 and r.output.count("\n") == 1, r.output
