"""`dsv4`: the harness command line.

Without `--json` a command's result (tables, verdicts, diffs) goes to stdout and progress and logs to stderr;
with `--json` stdout holds exactly one JSON document (an error too: {"error": ..., "exit_code": 2}) and all the
human output goes to stderr. Exit codes: 0 pass, 1 regression, 2 cannot judge / bad input (one line naming the
file, slice or field; a full disk too).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import click

from dsv4.harness import errors
from dsv4.harness.errors import BadInput, InputError, fail, one_line

LAZY = {   # commands that live beside the code they drive
    "train": ("dsv4.harness.train.loop", "train_cmd"),
    "flops": ("dsv4.harness.train.flops", "flops_cmd"),
    "convert": ("dsv4.harness.convert_cli", "convert_cmd"),
    "generate": ("dsv4.harness.generate_cli", "generate_cmd"),
    "plan": ("dsv4.harness.plan", "plan_cmd"),
}


def emit_json(doc) -> None:
    click.echo(json.dumps(doc, indent=1, default=str))


def _known_errors():
    from dsv4.harness.cases import CaseError
    from dsv4.harness.goldens import GoldenError
    from dsv4.harness.registry import RegistryError
    from dsv4.model.config import ConfigError
    return (RegistryError, GoldenError, CaseError, ConfigError, OSError, InputError)


def registry():
    from dsv4.harness.registry import Registry
    return Registry.load()


def select_triton_interpreter():
    """No GPU: golden cases that call Triton kernels run in its interpreter (must precede importing triton)."""
    from dsv4.kernels._testing import use_interpreter
    use_interpreter()


class DSv4Group(click.Group):
    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(LAZY))

    def get_command(self, ctx, name):
        cmd = super().get_command(ctx, name)
        if cmd is not None or name not in LAZY:
            return cmd
        mod, attr = LAZY[name]
        try:
            return getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            why = str(e)                 # `e` is unbound once the except block ends

            @click.command(name, help=f"(unavailable: {why})")
            def _missing():
                raise BadInput(f"command {name!r} is not available in this checkout ({why})")
            return _missing

    def main(self, args=None, **kw):
        """Every error, usage errors included, ends as errors.fail: one line, exit 2 (JSON under --json)."""
        args = list(sys.argv[1:] if args is None else args)
        errors.JSON = "--json" in args
        kw.pop("standalone_mode", None)
        try:
            rv = super().main(args, standalone_mode=False, **kw)
        except click.exceptions.NoArgsIsHelpError as e:     # `dsv4`, `dsv4 goldens`: the help, as click does
            e.show()
            sys.exit(e.exit_code)
        except click.ClickException as e:      # never exit 1: that means a regression
            errors.fail(e.format_message(), 2)
        except click.exceptions.Abort:
            errors.fail("aborted", 130)
        finally:
            errors.JSON = False
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except _known_errors() as e:
            raise BadInput(str(e)) from None          # OSError included: a full disk is one line naming the file


@click.group(cls=DSv4Group, context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """DeepSeek-V4 harness: slices, verification, goldens, graphs, training and benchmarks."""


# ------------------------------------------------------------------------------------------- slices
@main.command("slices")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
def slices_cmd(as_json):
    """Table of slices: id, title, status, deps, number of checks, golden coverage per platform."""
    from dsv4.harness import goldens as G
    from dsv4.harness.registry import PLATFORMS
    reg = registry()
    rows = []
    for sid in reg.order():
        s = reg.slices[sid]
        cov = {p: G.coverage(p, s.name) for p in PLATFORMS}
        rows.append({"id": s.id, "title": s.title, "kind": s.kind, "status": s.status, "depends_on": s.depends_on,
                     "dependents": reg.dependents(s.id), "provenance": s.provenance, "files": s.files,
                     "touches": s.touches,
                     "tests": s.tests, "golden_cases": s.golden_cases,
                     "n_checks": len(s.tests) + len(s.golden_cases), "golden_coverage": cov, "waiver": s.waiver})
    if as_json:
        emit_json({"slices": rows, "rounds": reg.rounds()})
        return
    import pandas as pd
    df = pd.DataFrame([{
        "id": r["id"], "title": r["title"][:46], "cpu": r["status"]["cpu"], "h200": r["status"]["h200"],
        "deps": ",".join(r["depends_on"]) if len(r["depends_on"]) < 6 else f"{len(r['depends_on'])} slices",
        "tests": len(r["tests"]), "cases": len(r["golden_cases"]),
        "waived": ",".join(w["dependency"] for w in r["waiver"]) or "-",
        "goldens cpu/h200/h100/gb200": "/".join(str(r["golden_coverage"][p]) for p in PLATFORMS)} for r in rows])
    with pd.option_context("display.max_rows", None, "display.width", 220, "display.max_colwidth", 60):
        click.echo(df.to_string(index=False))
    for r in rows:
        for w in r["waiver"]:
            click.echo(f"waiver: {r['id']} is checked without {w['dependency']}: {' '.join(w['reason'].split())}")


# ------------------------------------------------------------------------------------------- graph
@main.command("graph")
@click.option("--format", "fmt", type=click.Choice(["text", "mermaid", "dot", "png", "svg"]), default="text")
@click.option("--slice", "focus", default=None, help="Only this slice's ancestors and descendants.")
@click.option("--rounds", is_flag=True, help="Print the publication rounds.")
@click.option("--out", "out", type=click.Path(dir_okay=False), default=None, help="Output file (png/svg).")
@click.option("--platform", default="cpu", type=click.Choice(["cpu", "h200", "h100", "gb200"]),
              help="Whose status colours the nodes.")
@click.option("--labels", is_flag=True, help="Nodes show the slice title under its id (mermaid, dot, png, svg).")
@click.option("--json", "as_json", is_flag=True)
def graph_cmd(fmt, focus, rounds, out, platform, labels, as_json):
    """The slice dependency DAG (text tree, mermaid, dot, png, svg) and its publication rounds."""
    from dsv4.harness import goldens as G
    from dsv4.harness import graph as GR
    reg = registry()
    ids = GR.subgraph_ids(reg, focus)
    doc = {"nodes": ids, "edges": [[d, s] for s in ids for d in reg.slices[s].depends_on if d in ids]}
    if rounds:
        keep = set(ids)
        rr = [[s for s in r if s in keep] for r in reg.rounds()]
        doc["rounds"] = [r for r in rr if r]
        if not as_json:
            for k, r in enumerate(doc["rounds"]):
                click.echo(f"round {k}: {' '.join(r)}")
    if fmt in ("png", "svg"):
        path = Path(out or f"slice_graph.{fmt}")
        if path.suffix != f".{fmt}":
            raise BadInput(f"--out {path}: suffix must be .{fmt}")
        GR.draw(reg, ids, path, platform, labels)
        doc["file"] = str(path)
        if not as_json:
            click.echo(f"wrote {path}")
    elif not rounds or fmt != "text":
        text = GR.text_tree(reg, ids, platform) if fmt == "text" else \
            {"mermaid": GR.mermaid, "dot": GR.dot}[fmt](reg, ids, platform, labels)
        doc[fmt] = text
        if out:
            G.atomic_write_text(Path(out), text + "\n")
            doc["file"] = out
        if not as_json:
            click.echo(text)
    if as_json:
        emit_json(doc)


# ------------------------------------------------------------------------------------------- verify
@main.command("verify")
@click.option("--slice", "sid", default=None, help="Verify one slice (default: all, in dependency order).")
@click.option("--with-deps", is_flag=True, help="Also verify the slice's ancestors, first.")
@click.option("--platform", default="cpu", type=click.Choice(["cpu", "h200", "h100", "gb200"]))
@click.option("--mode", default=None, type=click.Choice(["deterministic", "approximate"]),
              help="Curve comparison mode (default: deterministic on cpu, approximate elsewhere).")
@click.option("--report", "report_dir", type=click.Path(file_okay=False), default=None,
              help="Write verify.json and verify.md here.")
@click.option("--junit", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Reuse test results from this junit xml instead of running pytest again.")
@click.option("--skip-tests", is_flag=True, help="Golden checks only (the slices' tests are not run or counted).")
@click.option("-n", "--workers", default=0, type=int, help="pytest-xdist workers for the tests (0 = in one process).")
@click.option("--against", default=None, type=click.Choice(["megatron-dev"]),
              help="Compare ours with Megatron-LM dev's outputs (goldens/megatron-dev/, see goldens import-megatron).")
@click.option("--json", "as_json", is_flag=True)
def verify_cmd(sid, with_deps, platform, mode, report_dir, junit, skip_tests, workers, as_json, against=None):
    """Run slices' tests and golden checks; print each check with its numbers and verdict."""
    if workers and not skip_tests and junit is None and importlib.util.find_spec("xdist") is None:
        raise BadInput(f"-n {workers}: pytest-xdist is not installed (pip install pytest-xdist, or run with -n 0)")
    if against:
        _verify_against_megatron(sid, report_dir, as_json)
    select_triton_interpreter()
    from dsv4.harness import verify as V
    reg = registry()
    mode = mode or ("deterministic" if platform == "cpu" else "approximate")
    if sid is None:
        ids = reg.order()
    else:
        s = reg.get(sid)
        ids = [x for x in reg.order() if x in reg.ancestors(s.id)] + [s.id] if with_deps else [s.id]
        if not s.implemented_on(platform):
            doc = {"platform": platform, "verdict": V.CANNOT_JUDGE, "exit_code": 2,
                   "slices": [{"id": s.id, "verdict": V.CANNOT_JUDGE, "status": s.status[platform],
                               "detail": f"slice {s.id} is {s.status[platform]} on {platform}: nothing to judge"}]}
            click.echo(f"verify {platform}: CANNOT JUDGE (slice {s.id} is {s.status[platform]} on {platform})",
                       err=as_json)
            if as_json:
                emit_json(doc)
            sys.exit(2)
    say = lambda m: click.echo(m, err=as_json)                     # noqa: E731 - results: stdout unless --json
    doc = V.verify(reg, ids, platform, mode, Path(junit) if junit else None, workers,
                   only_implemented=True, run_tests=not skip_tests, say=say)
    if report_dir:
        p = V.write_report(doc, Path(report_dir))
        click.echo(f"report: {p}", err=True)
    for line in V.summary_lines(doc):
        say(line)
    if as_json:
        emit_json(doc)
    sys.exit(doc["exit_code"])


# ------------------------------------------------------------------------------------------- goldens
@main.group("goldens")
def goldens_grp():
    """Golden store: diff, regen (the only way goldens change), import (Megatron TensorBoard runs)."""


@goldens_grp.command("regen")
@click.option("--slice", "sid", required=True)
@click.option("--platform", default="cpu", type=click.Choice(["cpu", "h200", "h100", "gb200"]))
@click.option("--case", "cases", multiple=True, help="Only these cases.")
@click.option("--json", "as_json", is_flag=True)
def regen_cmd(sid, platform, cases, as_json):
    """Rerun a slice's golden cases and rewrite its goldens (atomic), printing the diff."""
    select_triton_interpreter()
    from dsv4.harness import verify as V
    reg = registry()
    changes = V.regen(reg, reg.get(sid), platform, list(cases) or None, say=lambda m: click.echo(m, err=as_json))
    if as_json:
        emit_json({"slice": reg.get(sid).id, "platform": platform, "changes": changes})


@goldens_grp.command("diff")
@click.option("--slice", "sid", required=True)
@click.option("--platform", default="cpu", type=click.Choice(["cpu", "h200", "h100", "gb200"]))
@click.option("--json", "as_json", is_flag=True)
def diff_cmd(sid, platform, as_json):
    """Rerun a slice's golden cases and show what a regen would change (writes nothing). Exit 1 if changed."""
    select_triton_interpreter()
    from dsv4.harness import goldens as G
    from dsv4.harness import verify as V
    from dsv4.harness.cases import MAX_ELEMS
    reg = registry()
    sl = reg.get(sid)
    out, changed = [], False
    for c in V.load_cases(sl):
        if platform not in c.platforms or c.name not in sl.golden_cases:
            continue
        enc = G.encode_outputs(V.run_case(c, V.PLATFORM_DEVICE[platform]), MAX_ELEMS)
        lines = G.diff_case(platform, sl.name, c.name, sl.id, enc)
        changed |= lines != ["  = unchanged"]
        click.echo(f"{sl.id}/{c.name}:", err=as_json)
        for line in lines:
            click.echo(line, err=as_json)
        out.append({"case": c.name, "diff": lines})
    if as_json:
        emit_json({"slice": sl.id, "platform": platform, "changed": changed, "cases": out})
    sys.exit(1 if changed else 0)


@goldens_grp.command("code")
@click.argument("result", required=False, type=click.Path(dir_okay=False))
@click.option("--at", "rev", default="HEAD", show_default=True, help="The commit to compare with.")
@click.option("--json", "as_json", is_flag=True)
def code_cmd(result, rev, as_json):
    """The code hash (`goldens.code_hash`: model/, kernels/, harness/ .py files) of the files on disk and of commit
    --at; with RESULT (a bench / golden JSON), whether every code_hash it records (its provenance's, each row's)
    is that commit's. Exit 0: all match (or no RESULT), 1: a recorded hash is not the commit's, 2: RESULT
    unreadable or recording no code_hash (written before it existed: cannot judge)."""
    from dsv4.harness import goldens as G
    try:
        at = G.code_hash(rev)
    except (OSError, subprocess.SubprocessError) as e:
        fail(f"--at {rev}: not a commit of this repository ({one_line(e)})")
    doc = {"disk": G.code_hash(), "at": rev, "at_hash": at}
    code = 0
    if result:
        try:
            data = json.loads(Path(result).read_text())
        except (OSError, ValueError) as e:
            fail(f"{result}: cannot read a JSON result ({one_line(e)})")
        found = {}
        if isinstance(data, dict):
            if isinstance(data.get("provenance"), dict) and "code_hash" in data["provenance"]:
                found["provenance"] = data["provenance"]["code_hash"]
            for i, r in enumerate(data.get("results") or []):
                if isinstance(r, dict) and "code_hash" in r:
                    found[f"results[{i}] {r.get('impl', '')} {r.get('tokens', '')}".strip()] = r["code_hash"]
        if not found:
            fail(f"{result}: records no code_hash (written before provenance had one): cannot judge")
        doc["result"], doc["recorded"] = result, found
        doc["mismatch"] = sorted(k for k, v in found.items() if v != at)
        code = 1 if doc["mismatch"] else 0
    if as_json:
        emit_json(doc)
    else:
        click.echo(f"code hash on disk {doc['disk']}, at {rev} {at}")
        for k, v in doc.get("recorded", {}).items():
            click.echo(f"  {k}: {v} {'==' if v == at else '!='} {rev}")
    sys.exit(code)


@goldens_grp.command("spread")
@click.option("--slice", "sids", multiple=True, help="Slice(s) to measure (repeatable; default: every slice "
              "implemented or verified on cpu).")
@click.option("--case", "cases", multiple=True, help="Only these cases (default: every portable cpu case).")
@click.option("--json", "as_json", is_flag=True)
def spread_cmd(sids, cases, as_json):
    """Measure each cpu golden's spread across simulated hosts (harness/numerics.py) and check that its
    tolerances cover it; writes goldens/cpu/_spread/<slice>.json. Exit 1 if a portable golden does not hold."""
    from dsv4.harness import numerics
    reg = registry()
    slices = [reg.get(sid) for sid in sids] or [reg.get(i) for i in reg.order() if reg.get(i).implemented_on("cpu")]
    docs = numerics.spread_slices(slices, list(cases) or None)
    for d in docs:
        for r in d["checks"]:
            click.echo(numerics.fmt_spread(r), err=as_json)
    bad = [r for d in docs for r in d["checks"] if r["verdict"] != "pass"]
    if as_json:
        emit_json({"slices": docs, "exit_code": 1 if bad else 0})
    sys.exit(1 if bad else 0)


@goldens_grp.command("import")
@click.argument("logdir", type=click.Path(exists=True, file_okay=False))
@click.option("--platform", required=True, type=click.Choice(["cpu", "h200", "h100", "gb200"]))
@click.option("--slice", "sid", required=True, help="Slice the curve belongs to (e.g. D9).")
@click.option("--name", required=True, help="Golden name, e.g. proxy_curve.")
@click.option("--step-interval", default=1, type=int)
@click.option("--metrics", default=None, help="Comma list (default: all Megatron golden metrics found).")
@click.option("--force", is_flag=True, help="Replace an existing golden of that name (its diff is printed).")
@click.option("--note", default=None, help="A sentence kept in the provenance (how the run was made).")
@click.option("--json", "as_json", is_flag=True)
def import_cmd(logdir, platform, sid, name, step_interval, metrics, force, note, as_json):
    """Read a run's TensorBoard event files (Megatron or dsv4), or a dsv4 run dir's metrics.jsonl, into a golden
    (Megatron golden-values JSON)."""
    from dsv4.harness import tbimport
    reg = registry()
    sl = reg.get(sid)
    path, doc, diff = tbimport.import_run(Path(logdir), platform, sl, name, step_interval,
                                          metrics.split(",") if metrics else None, force, note)
    click.echo(f"wrote {path} ({', '.join(doc)})", err=as_json)
    for line in diff:
        click.echo(line, err=as_json)
    if as_json:
        emit_json({"file": str(path), "metrics": {k: len(v["values"]) for k, v in doc.items()}, "diff": diff})


# ------------------------------------------------------------------------------------------- megatron-dev oracle
@goldens_grp.command("import-megatron")
@click.option("--megatron-lm", "megatron_lm", required=True, type=click.Path(exists=True, file_okay=False),
              help="A Megatron-LM checkout at a dev commit with DSv4 code (csa.py, hyper_connection.py).")
@click.option("--slice", "sid", default=None, help="Only this slice's megatron-dev cases.")
@click.option("--json", "as_json", is_flag=True)
def import_megatron_cmd(megatron_lm, sid, as_json):
    """Run Megatron-LM dev's own functions on our cases' inputs; write goldens/megatron-dev/<slice>/<case>.json."""
    from dsv4.harness import megatron_import as MI
    try:
        written = MI.import_megatron(Path(megatron_lm), sid, log=lambda m: click.echo(m, err=True))
    except MI.ImportError_ as e:
        raise BadInput(str(e)) from None
    if as_json:
        emit_json({"platform": MI.PLATFORM, "written": written})


# ------------------------------------------------------------------------------------------- NVIDIA's Muon
@goldens_grp.command("import-muon")
@click.option("--python", "python", default="/work/venv-eo/bin/python", show_default=True,
              help="An interpreter with emerging-optimizers==0.3.0 installed (its own venv, see harness/muon_import.py).")
@click.option("--json", "as_json", is_flag=True)
def import_muon_cmd(python, as_json):
    """Run NVIDIA emerging-optimizers' newton_schulz / Muon on our cases; write goldens/emerging-optimizers/D9/."""
    from dsv4.harness import muon_import as MU
    try:
        written = MU.import_muon(python, log=lambda m: click.echo(m, err=True))
    except MU.MuonImportError as e:
        raise BadInput(str(e)) from None
    if as_json:
        emit_json({"platform": MU.PLATFORM, "written": written})


def _verify_against_megatron(sid, report_dir, as_json):
    """`dsv4 verify --against megatron-dev`: ours vs the imported dev goldens (no Megatron checkout needed)."""
    from dsv4.harness import megatron_import as MI
    from dsv4.harness import verify as V
    try:
        doc = MI.verify_against(sid, log=lambda m: click.echo(m, err=True))
    except MI.ImportError_ as e:
        raise BadInput(str(e)) from None
    if report_dir:
        click.echo(f"report: {V.write_report(doc, Path(report_dir))}", err=True)
    click.echo(f"verify against {MI.PLATFORM}: {doc['verdict'].upper()} ({doc['n_modules']} cases, "
               f"{sum(s['verdict'] == 'pass' for s in doc['slices'])}/{len(doc['slices'])} slices pass) "
               f"in {doc['elapsed_s']}s", err=True)
    if as_json:
        emit_json(doc)
    sys.exit(doc["exit_code"])


# ------------------------------------------------------------------------------------------- bench
class BenchGroup(click.Group):
    """`bench train` (end-to-end vs Hugging Face) and `bench kernels` (Triton vs naive vs peers)."""

    def list_commands(self, ctx):
        return ["kernels", "train"]

    def get_command(self, ctx, name):
        if name == "train":
            from dsv4.harness.train.bench import bench_train_cmd
            return bench_train_cmd
        if name == "kernels":
            try:
                cmd = importlib.import_module("dsv4.harness.bench").bench_cmd
            except (ImportError, AttributeError) as e:
                why = str(e)

                @click.command("kernels", help=f"(unavailable: {why})")
                def _missing():
                    raise BadInput(f"bench kernels is not available in this checkout ({why})")
                return _missing
            if isinstance(cmd, click.Group):
                return cmd.get_command(ctx, "kernels") or cmd
            return cmd
        return None


@main.group("bench", cls=BenchGroup)
def bench_grp():
    """H200 benchmarks, results as JSON with provenance (store them under goldens/h200/)."""


# ------------------------------------------------------------------------------------------- compare
@main.command("compare")
@click.argument("run", type=click.Path(exists=True))
@click.argument("golden", type=click.Path(exists=True))
@click.option("--mode", default="deterministic", type=click.Choice(["deterministic", "approximate"]))
@click.option("--metrics", default=None,
              help="Comma list (default, as Megatron: lm loss, num-zeros and mtp_1 loss when present).")
@click.option("--report", "report_dir", type=click.Path(file_okay=False), default=None,
              help="Write a Markdown report with PNG plots here.")
@click.option("--steps", "steps", default=None, metavar="N|A:B",
              help="Judge only steps 1..N (or A..B) of both curves, e.g. a run's first 100 steps.")
@click.option("--json", "as_json", is_flag=True)
def compare_cmd(run, golden, mode, metrics, report_dir, steps, as_json):
    """Compare a run's curves (Megatron golden-values JSON or a run dir) with a golden, per metric."""
    from dsv4.harness import report as R
    doc = R.compare_files(Path(run), Path(golden), mode, metrics.split(",") if metrics else None,
                          R.parse_steps(steps))
    for r in doc["checks"]:
        tol = "exact" if r.get("atol") == 0 and r.get("rtol") == 0 else f"rtol {r.get('rtol')}"
        click.echo(f"  [{r['verdict'].upper():4}] {r['check']:24} max|abs| {r.get('max_abs', float('nan')):.3e} "
                   f"max|rel| {r.get('max_rel', float('nan')):.3e} tol {tol}"
                   + (f" failing {r.get('n_failing')}/{r.get('steps')} (allowed {r.get('allowed_failures')})"
                      if r.get("steps") else "") + (f"  -- {r['detail']}" if r.get("detail") else ""), err=as_json)
    if report_dir:
        doc["report"] = str(R.write_report(doc, Path(report_dir)))
        click.echo(f"report: {doc['report']}", err=True)
    why = next((f"{c['check']}: {c['detail'].removeprefix('cannot judge: ')}" for c in doc["checks"]
                if c["verdict"] == doc["verdict"] == "cannot-judge"), "")
    click.echo(f"compare: {doc['verdict'].upper().replace('-', ' ')}" + (f" ({why})" if why else ""), err=as_json)
    if as_json:
        emit_json(doc)
    sys.exit(doc["exit_code"])


if __name__ == "__main__":
    main()
