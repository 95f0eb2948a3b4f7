#!/usr/bin/env python3
"""CI's list of what did not run: every test a stage skipped, by name, with its reason.

Reads the ctest logs a stage left (Testing/Temporary/LastTest.log, copied aside after each
stage: a later ctest run in the same build overwrites it) and pytest's JUnit XML, prints every
skipped test with the reason its output gives, and exits 1 when one is not on the allowed list
(.ci/allowed-skips: a regular expression per line, matched against "stage: test name", with a
comment saying why this machine cannot run it). A test disabled in ctest counts as skipped.

usage: skips.py ALLOWED STAGE=LOG_OR_XML [STAGE=LOG_OR_XML ...]
"""

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

_BLOCK = re.compile(r"^\d+/\d+ Testing: (.*)$", re.M)


def _reason(output: str) -> str:
    """The skip's reason from a test's output: gtest's message after "Skipped", else the last
    line that says "skip", else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if line.endswith(": Skipped") and i + 1 < len(lines):
            return lines[i + 1]
    said = [line for line in lines if "skip" in line.lower() and "[  SKIPPED ]" not in line]
    return (said or lines or ["(no output)"])[-1][:200]


def ctest_skips(log: Path):
    """(name, reason) of each test the ctest run in `log` skipped."""
    text = log.read_text(errors="replace")
    starts = list(_BLOCK.finditer(text))
    for n, m in enumerate(starts):
        block = text[m.end() : starts[n + 1].start() if n + 1 < len(starts) else len(text)]
        skipped = re.search(
            r"Test Pass Reason:\s*\n\s*Skip (regular expression|return code)", block
        )
        if not skipped and "\nTest Skipped" not in block and "Test Not Run" not in block:
            continue
        output = block.split("Output:", 1)[-1].split("<end of output>", 1)[0]
        yield m.group(1).strip(), _reason(output)
    # ctest's list of the tests it did not run: the skipped ones (named above) and the disabled.
    disabled = log.with_name(log.stem + ".LastTestsDisabled.log")
    if disabled.exists():
        seen = {m.group(1).strip() for m in starts}
        for line in disabled.read_text().splitlines():
            name = line.split(":", 1)[-1].strip()
            if name and name not in seen:
                yield name, "disabled in ctest"


def pytest_skips(xml: Path):
    """(name, reason) of each test pytest skipped, from its JUnit XML."""
    for case in ET.parse(xml).getroot().iter("testcase"):
        skipped = case.find("skipped")
        if skipped is not None:
            name = f"{case.get('classname', '')}.{case.get('name', '')}"
            yield name, (skipped.get("message") or "").strip()[:200]


def allowed_patterns(path: Path):
    out = []
    for line in path.read_text().splitlines():
        pattern = line.split("#", 1)[0].strip()
        if pattern:
            out.append((re.compile(pattern), line.split("#", 1)[1].strip() if "#" in line else ""))
    return out


def main(argv) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    allowed = allowed_patterns(Path(argv[0]))
    skips = []
    for spec in argv[1:]:
        stage, _, source = spec.partition("=")
        path = Path(source)
        if not path.exists():
            print(f"skips: {stage}: {path} is missing (did the stage run its tests?)")
            return 1
        found = pytest_skips(path) if path.suffix == ".xml" else ctest_skips(path)
        skips += [(stage, name, reason) for name, reason in found]
    unexpected = 0
    print(f"::: skipped tests: {len(skips)}")
    for stage, name, reason in skips:
        key = f"{stage}: {name}"
        ok = any(p.search(key) for p, _ in allowed)
        unexpected += not ok
        print(f"  {'allowed   ' if ok else 'UNEXPECTED'} {key} -- {reason}")
    if unexpected:
        print(
            f"::: {unexpected} test(s) skipped that are not on {argv[0]}: run them here, or add "
            "them there with the reason this machine cannot"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
