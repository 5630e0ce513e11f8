"""Registry: the real manifests load, follow the merge plan's edges, and every kind of bad manifest is refused
with one line naming the culprit."""
import shutil
from pathlib import Path

import pytest

from dsv4.harness.registry import Registry, RegistryError, SLICES_DIR, find_cycle

# The merge plan's edges, typed in here from shared/seeds/000_*.txt (independent of the manifests).
PLAN_EDGES = {
    "P2": {"P1"}, "P3": {"P2"}, "P4": {"P2"}, "P8": {"P7"}, "P10": {"#5008", "P4", "P7"},
    "P11": {"#5672", "P4", "P8"}, "P9": {"#4495"}, "D1": {"P1", "P6"}, "D2": {"D1", "P6"}, "D3": {"D2"},
    "D4": {"D2", "P2"}, "D5": {"D3", "P6"}, "D6": {"D2", "D5"}, "D7": {"D5"}, "D8": {"D6", "D7", "P9", "P11"},
}
ALL = {"#4531", "#4495", "#5008", "#5672"} | {f"P{i}" for i in range(1, 12)} | {f"D{i}" for i in range(1, 10)}


def test_real_manifests_follow_the_merge_plan():
    reg = Registry.load()
    # extension slices (X1, X2, ...: features beyond the merge plan) are not in the plan; they carry kind "extension"
    ext = {sid for sid, s in reg.slices.items() if s.kind == "extension"}
    assert all(sid[0] == "X" and sid[1:].isdigit() for sid in ext), ext
    assert set(reg.slices) - ext == ALL
    for sid, s in reg.slices.items():
        if sid in ext:
            continue
        if sid == "D9":
            # {D4, D8, all recipe prerequisites}: we read it as P1-P11 and the four externals
            assert set(s.depends_on) == {"D4", "D8"} | {x for x in ALL if x.startswith(("P", "#"))}
            assert s.depends_on_note
        else:
            assert set(s.depends_on) == PLAN_EDGES.get(sid, set()), sid


def test_rounds_and_order():
    reg = Registry.load()
    rounds = reg.rounds()
    where = {s: k for k, r in enumerate(rounds) for s in r}
    for sid, s in reg.slices.items():
        for d in s.depends_on:
            assert where[d] < where[sid]
        if s.depends_on:   # round k exactly: one base is in round k-1
            assert max(where[d] for d in s.depends_on) == where[sid] - 1
    assert rounds[0] == ["#4495", "#4531", "#5008", "#5672", "P1", "P5", "P6", "P7"]
    assert where["D8"] == 6 and where["D9"] == 7
    order = reg.order()
    assert all(order.index(d) < order.index(s) for s in order for d in reg.slices[s].depends_on)


def _copy(tmp_path) -> Path:
    root = tmp_path / "slices"
    shutil.copytree(SLICES_DIR, root, ignore=shutil.ignore_patterns("*.py", "__pycache__", "test_*"))
    for m in root.glob("*/manifest.toml"):   # files/tests are relative to the real repo; drop them here
        txt = m.read_text()
        import re
        txt = re.sub(r"(?m)^files = \[.*?\]$", "files = []", txt, flags=re.S)
        txt = re.sub(r"(?m)^tests = \[.*?\]$", "tests = []", txt, flags=re.S)
        txt = re.sub(r"(?m)^touches = \[.*?\]$", "touches = []", txt, flags=re.S)
        m.write_text(txt)
    return root


def _edit(root, folder, old, new):
    p = root / folder / "manifest.toml"
    txt = p.read_text()
    assert old in txt
    p.write_text(txt.replace(old, new, 1))


def test_refuses_unknown_dependency(tmp_path):
    root = _copy(tmp_path)
    _edit(root, "D3", 'depends_on = ["D2"]', 'depends_on = ["D2", "Q7"]')
    with pytest.raises(RegistryError, match=r"^slice D3: unknown dependency 'Q7'$"):
        Registry.load(root)


def test_refuses_cycle_and_prints_it(tmp_path):
    root = _copy(tmp_path)
    _edit(root, "P1", "depends_on = []", 'depends_on = ["D2"]')
    with pytest.raises(RegistryError) as e:
        Registry.load(root)
    msg = str(e.value)
    assert msg.startswith("dependency cycle: ") and "\n" not in msg
    cyc = msg.split(": ", 1)[1].split(" -> ")
    assert cyc[0] == cyc[-1] and {"P1", "D1", "D2"} <= set(cyc)


def test_refuses_duplicate_id(tmp_path):
    root = _copy(tmp_path)
    _edit(root, "P3", 'id = "P3"', 'id = "P2"')
    with pytest.raises(RegistryError, match=r"duplicate slice id 'P2'"):
        Registry.load(root)


@pytest.mark.parametrize("field", ["title", "depends_on", "status", "golden_cases"])
def test_refuses_missing_field(tmp_path, field):
    root = _copy(tmp_path)
    p = root / "P5" / "manifest.toml"
    lines = p.read_text().splitlines()
    if field == "status":
        lines = [ln for ln in lines if not ln.startswith(("[status]", "cpu =", "h200 =", "h100 =", "gb200 ="))]
    else:
        lines = [ln for ln in lines if not ln.startswith(f"{field} =")]
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(RegistryError, match=rf"^.*P5/manifest.toml: missing field '{field}'$"):
        Registry.load(root)


def test_refuses_bad_status_and_bad_toml(tmp_path):
    root = _copy(tmp_path)
    _edit(root, "P5", 'cpu = "', 'cpu = "done" #')
    with pytest.raises(RegistryError, match=r"P5/manifest.toml: status.cpu is 'done'"):
        Registry.load(root)
    root2 = _copy(tmp_path / "b")
    (root2 / "P6" / "manifest.toml").write_text("id = [\n")
    with pytest.raises(RegistryError, match=r"P6/manifest.toml: not valid TOML"):
        Registry.load(root2)


def test_find_cycle_small():
    assert find_cycle({"a": ["b"], "b": []}) is None
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) in (["a", "b", "c", "a"],)


def _drop_waiver(root, folder):
    p = root / folder / "manifest.toml"
    txt = p.read_text()
    p.write_text(txt[:txt.index("[[waiver]]")])


def test_verified_over_a_planned_dependency_needs_a_waiver(tmp_path):
    root = _copy(tmp_path)
    _drop_waiver(root, "D8")
    p11 = root / "P11" / "manifest.toml"                   # P11 as it was before session 23: planned on cpu too
    p11.write_text(p11.read_text().replace('cpu = "implemented"', 'cpu = "planned"'))
    with pytest.raises(RegistryError, match=r"D8/manifest.toml: status.cpu is 'verified' but its dependency P11 "
                                            r"is 'planned' on cpu \(add a \[\[waiver\]\] with a reason\)$"):
        Registry.load(root)
    reg = Registry.load(_copy(tmp_path / "b"))             # the real manifests: every violation is waived
    assert [w["dependency"] for w in reg.slices["D8"].waiver] == ["P11"]
    assert "CUDA graph" in reg.slices["D9"].waived("P11")


@pytest.mark.parametrize("waiver,why", [
    ('[[waiver]]\ndependency = "P7"\nreason = "x"\n', "waives 'P7', which is not in depends_on"),
    ('[[waiver]]\ndependency = "P11"\n', "must be a table with exactly a 'dependency' and a 'reason'"),
    ('[[waiver]]\ndependency = "P11"\nreason = " "\n', "must be a table with exactly a 'dependency' and a 'reason'"),
])
def test_refuses_a_bad_waiver(tmp_path, waiver, why):
    root = _copy(tmp_path)
    _drop_waiver(root, "D8")
    p = root / "D8" / "manifest.toml"
    p.write_text(p.read_text() + waiver)
    with pytest.raises(RegistryError, match=rf"D8/manifest.toml: waiver\[0\] {why}" if "waives" in why else why):
        Registry.load(root)


def test_slices_table_is_on_stdout_and_shows_waivers():
    from click.testing import CliRunner
    from dsv4.harness.cli import main
    r = CliRunner().invoke(main, ["slices"])
    assert r.exit_code == 0, r.output
    d9 = [ln for ln in r.stdout.splitlines() if ln.lstrip().startswith("D9 ")]      # `dsv4 slices | grep D9`
    assert len(d9) == 1 and "P11" in d9[0]                                          # the waived column
    assert any(ln.startswith("waiver: D8 is checked without P11: ") for ln in r.stdout.splitlines())


# ------------------------------------------------------------------ files / touches


def test_real_manifests_own_every_model_and_kernel_file():
    """Every tracked .py under model/ and kernels/ is introduced ('files') or tested ('tests') by some slice;
    each file is in one slice's 'files'; what a slice extends is in its 'touches' (P5's clamp in P4's moe.py)."""
    reg = Registry.load()
    assert reg.unowned_sources() == []
    assert reg.owner["model/moe.py"] == "P4" and "model/moe.py" in reg.slices["P5"].touches
    assert all(reg.owner[f] != sid for sid, s in reg.slices.items() for f in s.touches)
    assert {f for f in reg.owner if f.startswith("model/interop/")} == {
        f"model/interop/{n}.py" for n in ("__init__", "common", "hf_config", "hf", "official", "megatron",
                                          "megatron_config", "released")}


def test_unowned_sources_names_an_unlisted_file(tmp_path):
    root = _copy(tmp_path)              # files / tests emptied: every model / kernels source is unowned
    un = Registry.load(root).unowned_sources()
    assert "model/moe.py" in un and "model/interop/hf.py" in un and all(f.endswith(".py") for f in un)


def test_refuses_a_file_in_two_slices_files(tmp_path):
    root = _copy(tmp_path)
    _edit(root, "P4", "files = []", 'files = ["model/moe.py"]')
    _edit(root, "P5", "files = []", 'files = ["model/moe.py"]')
    with pytest.raises(RegistryError, match=r"^model/moe\.py is in 'files' of both slice P4 and slice P5 "):
        Registry.load(root)


def test_refuses_missing_or_unintroduced_touches(tmp_path):
    root = _copy(tmp_path)
    _edit(root, "P5", "touches = []", 'touches = ["model/no_such_file.py"]')
    with pytest.raises(RegistryError, match=r"P5/manifest.toml: field 'touches' lists model/no_such_file.py, "
                                            r"which does not exist$"):
        Registry.load(root)
    _edit(root, "P5", 'touches = ["model/no_such_file.py"]', 'touches = ["model/moe.py"]')
    with pytest.raises(RegistryError, match=r"^slice P5: 'touches' lists model/moe.py, which no slice's 'files' "
                                            r"introduces$"):
        Registry.load(root)
    _edit(root, "P4", "files = []", 'files = ["model/moe.py"]')
    assert Registry.load(root).slices["P5"].touches == ["model/moe.py"]


def test_refuses_a_file_both_introduced_and_touched(tmp_path):
    root = _copy(tmp_path)
    _edit(root, "P4", "files = []", 'files = ["model/moe.py"]\ntouches = ["model/moe.py"]')
    with pytest.raises(RegistryError, match=r"P4/manifest.toml: model/moe.py is in both 'files' and 'touches'"):
        Registry.load(root)
