"""Run every sample through ``amp-doctor diagnose`` and compare with the acceptance table.

``make demo`` runs this; ``tests/test_gallery.py`` uses :func:`check` for the
acceptance suite, so the table in ``expected.py`` is the one source of truth.
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


def check(script: str, extra: tuple[str, ...] = (), workdir: Path | None = None) -> Verdict:
    expected = EXPECTED[script]
    anomaly = any(op is not None or kind.startswith("nonfinite") for kind, _, op in expected)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(workdir or tmp)
        report = out / f"{Path(script).stem}.json"
        cmd = [sys.executable, "-m", "amp_doctor", "diagnose", "--quiet",
               "--logdir", str(out / "runs" / Path(script).stem), "--json", str(report),
               *(["--anomaly"] if anomaly else []), *extra, str(HERE / script)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if not report.exists():
            raise RuntimeError(f"{script}: no JSON report; stderr:\n{proc.stderr[-3000:]}")
        findings = json.loads(report.read_text())["findings"]
    missing = [w for w in expected if not any(_matches(f, w) for f in findings)]
    if expected:
        unexpected = []
    else:
        unexpected = [f for f in findings if f["severity"] in BAD_SEVERITIES]
    return Verdict(script, not missing and not unexpected, expected, findings, missing,
                   unexpected, proc.returncode)


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
