"""Slice registry: one `slices/<folder>/manifest.toml` per node of the merge plan's dependency DAG.

The registry refuses, with one line naming the culprit: a manifest that cannot be parsed, a missing or
mistyped field, a duplicate id, an unknown dependency, a cycle (printed), an unknown status value.
"""
from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SLICES_DIR = REPO / "slices"
PLATFORMS = ("cpu", "h200", "h100", "gb200")
STATUSES = ("planned", "implemented", "verified")
KINDS = ("external", "prerequisite", "dsv4", "extension")   # extension: X1, X2, ... beyond the merge plan

# field -> python type it must have
REQUIRED = {
    "id": str, "title": str, "kind": str, "delivers": str, "provenance": list, "depends_on": list,
    "files": list, "tests": list, "golden_cases": list, "status": dict,
}


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
    extra = set(data) - set(REQUIRED) - {"depends_on_note"}
    if extra:
        raise RegistryError(f"{rel}: unknown field '{sorted(extra)[0]}'")
    if data["kind"] not in KINDS:
        raise RegistryError(f"{rel}: field 'kind' is {data['kind']!r}, expected one of {', '.join(KINDS)}")
    for p in PLATFORMS:
        v = data["status"].get(p)
        if v not in STATUSES:
            raise RegistryError(f"{rel}: status.{p} is {v!r}, expected one of {', '.join(STATUSES)}")
    unknown_pf = set(data["status"]) - set(PLATFORMS)
    if unknown_pf:
        raise RegistryError(f"{rel}: status has unknown platform '{sorted(unknown_pf)[0]}'")
    for field in ("files", "tests"):
        for f in data[field]:
            if not (REPO / f).exists():
                raise RegistryError(f"{rel}: field '{field}' lists {f}, which does not exist")
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
        for s in slices:
            for d in s.depends_on:
                if d not in self.slices:
                    raise RegistryError(f"slice {s.id}: unknown dependency {d!r}")
            if len(set(s.depends_on)) != len(s.depends_on):
                raise RegistryError(f"slice {s.id}: a dependency is listed twice")
        cyc = find_cycle({k: v.depends_on for k, v in self.slices.items()})
        if cyc:
            raise RegistryError("dependency cycle: " + " -> ".join(cyc))

    @classmethod
    def load(cls, root: Path = SLICES_DIR) -> "Registry":
        paths = sorted(root.glob("*/manifest.toml"))
        if not paths:
            raise RegistryError(f"{root}: no slice manifests found")
        return cls([_load_manifest(p) for p in paths])

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
