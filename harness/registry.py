"""Slice registry: one `slices/<folder>/manifest.toml` per node of the merge plan's dependency DAG.

The registry refuses, with one line naming the culprit: a manifest that cannot be parsed, a missing or
mistyped field, a duplicate id, an unknown dependency, a cycle (printed), an unknown status value, and a slice
`verified` on a platform where one of its dependencies is `planned`, unless its manifest waives that dependency:

    [[waiver]]
    dependency = "P11"
    reason = "why the slice's checks do not need it"

Files follow the slices: `files` lists what a slice introduces and `touches` (optional) what it extends, e.g.
P5's clamp in `model/moe.py`, which P4 introduces. Both must exist; a file is in the `files` of at most one
slice (a duplicate is refused naming both slices), is not in one slice's `files` and `touches` at once, and a
touched file is introduced by another slice. `unowned_sources()` lists the tracked .py files under
OWNED_ROOTS (model/ and kernels/) that no slice lists in `files` or `tests`; harness/tests/test_registry.py
requires it empty. harness/ is left out: its verification tooling (CLI, registry, goldens, verify, reports)
belongs to no slice.
"""
from __future__ import annotations

import dataclasses
import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SLICES_DIR = REPO / "slices"
PLATFORMS = ("cpu", "h200", "h100", "gb200")
STATUSES = ("planned", "implemented", "verified")
OWNED_ROOTS = ("model", "kernels")   # every tracked .py here is in some slice's files (or tests)
KINDS = ("external", "prerequisite", "dsv4", "extension")   # extension: X1, X2, ... beyond the merge plan

# field -> python type it must have
REQUIRED = {
    "id": str, "title": str, "kind": str, "delivers": str, "provenance": list, "depends_on": list,
    "files": list, "tests": list, "golden_cases": list, "status": dict,
}


# optional manifest fields: a note on the edges, and the differences found between implementations
OPTIONAL = {"depends_on_note": str, "differences": list, "touches": list}
# a [[differences]] entry: what differs, what Megatron-LM dev does, what we do, which side we follow and why
DIFF_REQUIRED = ("what", "dev", "ours", "follow", "why")
DIFF_OPTIONAL = ("hf", "official", "measured", "checked_by")
DIFF_FOLLOW = ("ours", "dev", "hf", "official", "both")


class RegistryError(ValueError):
    """Bad slice data; the message is one line naming the file / slice / field."""


@dataclasses.dataclass
class Slice:
    id: str
    title: str
    kind: str
    delivers: str
    provenance: list
    depends_on: list
    files: list
    tests: list
    golden_cases: list
    status: dict
    folder: Path
    depends_on_note: str = ""
    waiver: list = dataclasses.field(default_factory=list)    # [{dependency, reason}]
    differences: list = dataclasses.field(default_factory=list)
    touches: list = dataclasses.field(default_factory=list)   # files introduced by another slice, extended here

    def waived(self, dep: str) -> str | None:
        return next((w["reason"] for w in self.waiver if w["dependency"] == dep), None)

    @property
    def name(self) -> str:          # folder name, used for golden paths: goldens/<platform>/<name>/
        return self.folder.name

    def implemented_on(self, platform: str) -> bool:
        return self.status.get(platform, "planned") in ("implemented", "verified")

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["folder"] = _rel(self.folder)
        return d


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)


def _load_manifest(path: Path) -> Slice:
    rel = _rel(path)
    try:
        data = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise RegistryError(f"{rel}: not valid TOML ({str(e).splitlines()[0]})") from None
    for field, typ in REQUIRED.items():
        if field not in data:
            raise RegistryError(f"{rel}: missing field '{field}'")
        if not isinstance(data[field], typ):
            raise RegistryError(f"{rel}: field '{field}' must be a {typ.__name__}")
    extra = set(data) - set(REQUIRED) - set(OPTIONAL) - {"waiver"}
    if extra:
        raise RegistryError(f"{rel}: unknown field '{sorted(extra)[0]}'")
    for k, d in enumerate(data.get("differences", [])):
        if not isinstance(d, dict):
            raise RegistryError(f"{rel}: differences[{k}] must be a table")
        for f in DIFF_REQUIRED:
            if not isinstance(d.get(f), str) or not d[f].strip():
                raise RegistryError(f"{rel}: differences[{k}] needs a non-empty string '{f}'")
        unknown = set(d) - set(DIFF_REQUIRED) - set(DIFF_OPTIONAL)
        if unknown:
            raise RegistryError(f"{rel}: differences[{k}] has unknown key '{sorted(unknown)[0]}'")
        if d["follow"] not in DIFF_FOLLOW:
            raise RegistryError(f"{rel}: differences[{k}].follow is {d['follow']!r}, expected one of {', '.join(DIFF_FOLLOW)}")
    if data["kind"] not in KINDS:
        raise RegistryError(f"{rel}: field 'kind' is {data['kind']!r}, expected one of {', '.join(KINDS)}")
    for p in PLATFORMS:
        v = data["status"].get(p)
        if v not in STATUSES:
            raise RegistryError(f"{rel}: status.{p} is {v!r}, expected one of {', '.join(STATUSES)}")
    unknown_pf = set(data["status"]) - set(PLATFORMS)
    if unknown_pf:
        raise RegistryError(f"{rel}: status has unknown platform '{sorted(unknown_pf)[0]}'")
    for field in ("files", "tests", "touches"):
        seen = set()
        for f in data.get(field, []):
            if not isinstance(f, str):
                raise RegistryError(f"{rel}: field '{field}' must list paths (strings), got {f!r}")
            if f in seen:
                raise RegistryError(f"{rel}: field '{field}' lists {f} twice")
            seen.add(f)
            if not (REPO / f).exists():
                raise RegistryError(f"{rel}: field '{field}' lists {f}, which does not exist")
    both = sorted(set(data["files"]) & set(data.get("touches", [])))
    if both:
        raise RegistryError(f"{rel}: {both[0]} is in both 'files' and 'touches' (a slice introduces a file or "
                            f"extends it, not both)")
    for i, w in enumerate(data.get("waiver", [])):
        if not isinstance(w, dict) or set(w) != {"dependency", "reason"} or not all(
                isinstance(v, str) and v.strip() for v in w.values()):
            raise RegistryError(f"{rel}: waiver[{i}] must be a table with exactly a 'dependency' and a 'reason'")
        if w["dependency"] not in data["depends_on"]:
            raise RegistryError(f"{rel}: waiver[{i}] waives {w['dependency']!r}, which is not in depends_on")
    return Slice(folder=path.parent, **data)


def find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """A cycle in `graph` (node -> deps) as a list [a, b, ..., a], or None."""
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        color[n] = 1
        stack.append(n)
        for d in graph.get(n, []):
            if color.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if color.get(d) is None:
                c = visit(d)
                if c:
                    return c
        color[n] = 2
        stack.pop()
        return None

    for n in sorted(graph):
        if color.get(n) is None:
            c = visit(n)
            if c:
                return c
    return None


class Registry:
    def __init__(self, slices: list[Slice]):
        self.slices: dict[str, Slice] = {}
        for s in slices:
            if s.id in self.slices:
                raise RegistryError(
                    f"duplicate slice id {s.id!r} in {_rel(s.folder)} and {_rel(self.slices[s.id].folder)}")
            self.slices[s.id] = s
        self.owner: dict[str, str] = {}      # file -> the slice whose `files` introduce it
        for s in slices:
            for f in s.files:
                if f in self.owner:
                    raise RegistryError(f"{f} is in 'files' of both slice {self.owner[f]} and slice {s.id} (one "
                                        f"slice introduces it; list it in the other's 'touches')")
                self.owner[f] = s.id
        for s in slices:
            for f in s.touches:
                if f not in self.owner:
                    raise RegistryError(f"slice {s.id}: 'touches' lists {f}, which no slice's 'files' introduces")
        for s in slices:
            for d in s.depends_on:
                if d not in self.slices:
                    raise RegistryError(f"slice {s.id}: unknown dependency {d!r}")
            if len(set(s.depends_on)) != len(s.depends_on):
                raise RegistryError(f"slice {s.id}: a dependency is listed twice")
        cyc = find_cycle({k: v.depends_on for k, v in self.slices.items()})
        if cyc:
            raise RegistryError("dependency cycle: " + " -> ".join(cyc))
        for s in slices:
            for p in PLATFORMS:
                for d in s.depends_on if s.status[p] == "verified" else []:
                    if self.slices[d].status[p] == "planned" and not s.waived(d):
                        raise RegistryError(f"{_rel(s.folder)}/manifest.toml: status.{p} is 'verified' but its "
                                            f"dependency {d} is 'planned' on {p} (add a [[waiver]] with a reason)")

    @classmethod
    def load(cls, root: Path = SLICES_DIR) -> "Registry":
        paths = sorted(root.glob("*/manifest.toml"))
        if not paths:
            raise RegistryError(f"{root}: no slice manifests found")
        return cls([_load_manifest(p) for p in paths])

    # ---------------------------------------------------------------- files
    def unowned_sources(self, roots: tuple[str, ...] = OWNED_ROOTS) -> list[str]:
        """Tracked .py files under `roots` (git ls-files; every .py outside __pycache__ when git is missing)
        that no slice lists in 'files' or 'tests'."""
        try:
            out = subprocess.run(["git", "-C", str(REPO), "ls-files", "--", *roots], capture_output=True,
                                 text=True, check=True).stdout.split()
        except (OSError, subprocess.CalledProcessError):
            out = [_rel(p) for r in roots for p in (REPO / r).rglob("*.py") if "__pycache__" not in p.parts]
        listed = {f for s in self.slices.values() for f in s.files + s.tests}
        return sorted(f for f in out if f.endswith(".py") and f not in listed)

    # ---------------------------------------------------------------- lookups
    def get(self, sid: str) -> Slice:
        if sid in self.slices:
            return self.slices[sid]
        for s in self.slices.values():        # accept the folder name too (ext_4531 for #4531)
            if s.name == sid or s.id == "#" + sid:
                return s
        raise RegistryError(f"slice {sid!r}: unknown (known: {', '.join(self.order())})")

    def order(self) -> list[str]:
        """Dependency order (every slice after its bases), ties by round then id."""
        rounds = self.rounds()
        return [sid for r in rounds for sid in r]

    def rounds(self) -> list[list[str]]:
        """Publication rounds: a slice is in round k when all its bases are in earlier rounds."""
        level: dict[str, int] = {}

        def lv(sid):
            if sid not in level:
                deps = self.slices[sid].depends_on
                level[sid] = 1 + max((lv(d) for d in deps), default=-1)
            return level[sid]

        for sid in self.slices:
            lv(sid)
        out: list[list[str]] = [[] for _ in range(max(level.values()) + 1)]
        for sid, k in level.items():
            out[k].append(sid)
        return [sorted(r, key=_sort_key) for r in out]

    def ancestors(self, sid: str) -> set[str]:
        seen: set[str] = set()
        todo = list(self.slices[sid].depends_on)
        while todo:
            d = todo.pop()
            if d not in seen:
                seen.add(d)
                todo.extend(self.slices[d].depends_on)
        return seen

    def descendants(self, sid: str) -> set[str]:
        return {k for k in self.slices if sid in self.ancestors(k)}

    def dependents(self, sid: str) -> list[str]:
        return sorted((k for k, s in self.slices.items() if sid in s.depends_on), key=_sort_key)


def _sort_key(sid: str):
    # externals first, then P1..P11, then D1..D9, numerically
    if sid.startswith("#"):
        return (0, int(sid[1:]))
    return ({"P": 1, "D": 2}.get(sid[0], 3), int(sid[1:]) if sid[1:].isdigit() else 0)
