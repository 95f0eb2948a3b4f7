"""The README's commands run as written after its two set-up commands (ctest: readme_commands).

Every command line of the README's shell blocks (```sh, or no language) that runs a program of this repository (a
`build/...` binary, a `.venv/bin/python bench/...` script, with or without its environment
assignments) is run in its smallest form: the program, its subcommand where it has one, and
`--help`. That proves the program exists where the README says, parses its options, and, for the
Python benchmarks, starts from the README's environment. Then the package is imported the way the
benchmarks' child processes import it: `.venv/bin/python` with no PYTHONPATH, from another
directory (the build's strata-build.pth puts it on the environment's path).

Usage: readme_commands.py REPO_ROOT
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

# Programs whose first argument is a subcommand.
SUBCOMMANDS = {"strata-bench"}
# Commands of the README that need what a test cannot assume (a GPU, DeepSpeed's build, fio
# against a given disk, a second repository, root's /opt): named here, with why, and not run.
NOT_RUN = {
    "bench/gpu-check.sh": "needs a GPU (run on a lent one)",
    "../shared/tools/io-vs-fio.sh": "the shared tool outside this repository",
}


def sh_blocks(readme: str) -> list[str]:
    """The lines of the shell blocks (```sh, ```bash or no language), in order."""
    block, out = None, []
    for line in readme.splitlines():
        if line.startswith("```"):
            block = line.strip()[3:] if block is None else None
            continue
        if block in ("", "sh", "bash"):
            out.append(line)
    return out


def program_of(line: str) -> list[str] | None:
    """The command's program and subcommand (as words), or None when it runs nothing of ours."""
    line = line.split("#", 1)[0].strip()
    if not line:
        return None
    for piece in re.split(r"&&|;|\|\||\bdo\b|\bthen\b", line):
        try:
            words = shlex.split(piece)
        except ValueError:
            continue
        while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
            words = words[1:]  # environment assignments
        if not words:
            continue
        if words[0] == ".venv/bin/python" and len(words) > 1 and words[1].startswith("bench/"):
            return words[:2]
        prog = words[0].removeprefix("./")
        if prog.startswith("build/"):
            name = Path(prog).name
            if name in SUBCOMMANDS and len(words) > 1 and not words[1].startswith("-"):
                return [prog, words[1]]
            return [prog]
    return None


def main() -> int:
    root = Path(sys.argv[1]).resolve()
    readme = (root / "README.md").read_text()
    lines = sh_blocks(readme)
    # lines[:2] are the two set-up commands: CI runs them first (the readme-tests stage).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    seen, failed = set(), []
    for line in lines[2:]:
        words = program_of(line)
        if words is None or tuple(words) in seen:
            continue
        seen.add(tuple(words))
        if any(line.strip().startswith(k) for k in NOT_RUN):
            continue
        cmd = words + ["--help"]
        r = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120)
        status = "ok" if r.returncode == 0 else f"exit {r.returncode}"
        print(f"{status:8} {' '.join(cmd)}    (README: {line.strip()[:90]})")
        if r.returncode != 0:
            failed.append((cmd, r.stdout[-2000:] + r.stderr[-2000:]))
    # The package as a benchmark's child process imports it.
    probe = [
        str(root / ".venv/bin/python"),
        "-c",
        "import strata, strata.torch; print(strata.__file__)",
    ]
    r = subprocess.run(probe, cwd="/", env=env, capture_output=True, text=True, timeout=300)
    print(
        f"{'ok' if r.returncode == 0 else 'FAILED':8} .venv/bin/python -c 'import strata, strata.torch' "
        f"(no PYTHONPATH, from /): {r.stdout.strip() or r.stderr.strip()[-300:]}"
    )
    if r.returncode != 0:
        failed.append((probe, r.stderr[-2000:]))
    if len(seen) < 6:  # the README names more programs than this
        failed.append((["README"], f"only {len(seen)} commands found: the parser lost them"))
    for cmd, out in failed:
        print(f"\nFAILED: {' '.join(cmd)}\n{out}", file=sys.stderr)
    print(f"readme_commands: {len(seen) + 1} commands, {len(failed)} failing")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
