"""Run every sample through ``amp-doctor diagnose`` and compare with the acceptance table.

``make demo`` runs this; ``tests/test_gallery.py`` uses :func:`check` for the
acceptance suite, so the table in ``expected.py`` is the one source of truth.

:func:`check` runs ``python -m amp_doctor diagnose`` in a subprocess, as a
user does; ``in_process=True`` calls the same CLI entry point
(``amp_doctor.cli.main``) in the calling process instead, which skips the
seconds of interpreter and torch start-up per sample (the fast test suite).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from expected import EXPECTED, Finding  # noqa: E402

# Op-level findings need the op-level (anomaly) mode; the rest come from the default watch.
BAD_SEVERITIES = ("error", "warning")


@dataclass
class Verdict:
    script: str
    ok: bool
    expected: tuple[Finding, ...]
    found: list[dict[str, object]]
    missing: list[Finding]
    # Healthy sample: its warnings and errors. Pathological: errors the table does not list.
    unexpected: list[dict[str, object]]
    exit_code: int

    def line(self) -> str:
        mark = "ok  " if self.ok else "FAIL"
        if not self.expected:
            want = "healthy"
            got = ("healthy" if not self.unexpected else
                   ", ".join(f"{f['kind']}@{f['module']}" for f in self.unexpected))
        else:
            want = ", ".join(f"{k}@{m or '*'}" + (f"[{o}]" if o else "")
                             for k, m, o in self.expected)
            got = "all found" if not self.missing else "missing " + ", ".join(
                f"{k}@{m or '*'}" for k, m, _ in self.missing)
            if self.unexpected:
                got += "; extra errors: " + ", ".join(
                    f"{f['kind']}@{f['module']}" + (f"[{f['op']}]" if f["op"] else "")
                    for f in self.unexpected)
        return f"{mark} {self.script:<38} expected: {want}\n     {'':<38} found:    {got}"


def _module_matches(found: object, expected: str | None) -> bool:
    if expected is None:
        return True
    if not isinstance(found, str):
        return False
    # With several models the tool prefixes layer names by the model's name.
    return found == expected or found.endswith("." + expected)


def _matches(f: dict[str, object], want: Finding) -> bool:
    kind, module, op = want
    return f["kind"] == kind and _module_matches(f["module"], module) and (
        op is None or f["op"] == op)


def extra_errors(findings: list[dict[str, object]],
                 expected: tuple[Finding, ...]) -> list[dict[str, object]]:
    """The error findings the table does not account for.

    One error per root cause: each listed finding accounts for at most one
    error, so a second error matching the same entry (a follow-on duplicate)
    is extra. The errors are matched to the entries with augmenting paths, so
    the order of the findings does not matter.
    """
    errors = [f for f in findings if f["severity"] == "error"]
    owner: dict[int, int] = {}  # index into expected -> index into errors

    def assign(i: int, seen: set[int]) -> bool:
        for j, want in enumerate(expected):
            if j in seen or not _matches(errors[i], want):
                continue
            seen.add(j)
            if j not in owner or assign(owner[j], seen):
                owner[j] = i
                return True
        return False

    return [e for i, e in enumerate(errors) if not assign(i, set())]


def _diagnose_in_process(args: list[str]) -> int:
    """``amp_doctor.cli.main(args)`` in this process; its exit status, as the shell sees it."""
    from amp_doctor.cli import main as cli_main

    try:
        cli_main(args)
    except SystemExit as e:
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


def check(script: str, extra: tuple[str, ...] = (), workdir: Path | None = None,
          in_process: bool = False) -> Verdict:
    expected = EXPECTED[script]
    anomaly = any(op is not None or kind.startswith("nonfinite") for kind, _, op in expected)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(workdir or tmp)
        report = out / f"{Path(script).stem}.json"
        args = ["diagnose", "--quiet",
                "--logdir", str(out / "runs" / Path(script).stem), "--json", str(report),
                *(["--anomaly"] if anomaly else []), *extra, str(HERE / script)]
        if in_process:
            returncode, stderr = _diagnose_in_process(args), "(in process: see captured stderr)"
        else:
            proc = subprocess.run([sys.executable, "-m", "amp_doctor", *args],
                                  capture_output=True, text=True, timeout=300)
            returncode, stderr = proc.returncode, proc.stderr
        if not report.exists():
            raise RuntimeError(f"{script}: no JSON report; stderr:\n{stderr[-3000:]}")
        findings = json.loads(report.read_text())["findings"]
    missing = [w for w in expected if not any(_matches(f, w) for f in findings)]
    if expected:
        unexpected = extra_errors(findings, expected)
    else:
        unexpected = [f for f in findings if f["severity"] in BAD_SEVERITIES]
    return Verdict(script, not missing and not unexpected, expected, findings, missing,
                   unexpected, returncode)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scripts", nargs="*", help="only these samples (default: all)")
    args = p.parse_args(argv)
    scripts = args.scripts or list(EXPECTED)
    failed = 0
    for s in scripts:
        v = check(s)
        failed += not v.ok
        print(v.line(), flush=True)
    print(f"{len(scripts) - failed} of {len(scripts)} samples diagnosed as expected")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
