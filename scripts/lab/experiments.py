"""Whether each docs/experiments record still applies to this tree (CPU, no GPU).

    python3 scripts/lab.py experiments                 # applies here or not, per record
    python3 scripts/lab.py experiments --history       # and the commits a git patch applies at
    python3 scripts/lab.py experiments --compile       # and compile what applies (NVRTC, spills)

A git patch (a .patch holding `diff --git`) is checked with `git apply --check` against the
work tree. --history finds, for one that does not apply, the commits whose files match every
pre-image blob its `index` lines name: the commits it was written against and applies at.
A .blocks file (and a .patch without a diff: the same format, blocks 'OLD\\n===\\nNEW' separated
by lines '%%%', which patch-ab, trace-steps --patch and count-events apply to the rendered kernel)
is applied to the fp8 kernel of each cell and variant in BLOCKS_ON, as api picks it on the H200
(as scripts/precompile.py does). Prints a markdown table; docs/experiments/README.md keeps the
latest one. Run it after a template change to update that README.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, HERE]
EXPERIMENTS = os.path.join(ROOT, "docs", "experiments")

# A source-patch record: the cells (head_dim,seqlen,causal) and spec overrides its header names.
BLOCKS_ON = {
    "fp8-defer-from-oreg.blocks": [("256,16384,1", "defer_o_store=1")],
    "fp8-o-stg128.blocks": [("256,8192,0", ""), ("256,8192,0", "defer_o_store=0"), ("128,8192,0", "")],
    "fp8-pingpong-after-pv.patch": [("256,16384,0", "pingpong=1"), ("128,8192,0", "pingpong=1")],
    "fp8-q-prefetch-early.blocks": [("256,16384,0", "")],
    "fp8-q-prefetch-late.blocks": [("256,16384,0", "")],
    "fp8-vote-count.blocks": [("256,16384,1", "lazy_rescale=0")],
}
DEFAULT_CELLS = [("256,16384,0", ""), ("128,8192,0", "")]


def git(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", ROOT, *args], input=stdin, capture_output=True, text=True)


def pre_images(text: str) -> list[tuple[str, str]]:
    """(path, abbreviated pre-image blob) per file of a git diff, from its `index A..B` lines."""
    found, path = [], None
    for line in text.splitlines():
        m = re.match(r"diff --git a/(\S+) b/", line)
        if m:
            path = m.group(1)
            continue
        m = re.match(r"index ([0-9a-f]+)\.\.", line)
        if m and path:
            found.append((path, m.group(1)))
            path = None
    return found


def commits_matching(pre: list[tuple[str, str]]) -> list[str]:
    """The commits (newest first) whose files are every pre-image: where the diff applies."""
    commits = git("rev-list", "--all").stdout.split()
    query = "".join(f"{c}:{path}\n" for c in commits for path, _ in pre)
    lines = git("cat-file", "--batch-check", stdin=query).stdout.splitlines()
    n = len(pre)
    return [c for i, c in enumerate(commits)
            if all(line.split()[0].startswith(blob) for line, (_, blob) in zip(lines[i * n:(i + 1) * n], pre))]


def describe(commit: str) -> str:
    return git("log", "-1", "--format=%h (%ad)", "--date=short", commit).stdout.strip()


def git_patch_status(path: str, history: bool) -> str:
    done = git("apply", "--check", path)
    if done.returncode == 0:
        return "applies (git apply --check)"
    first = (done.stderr.strip().splitlines() or ["?"])[0].removeprefix("error: ")
    status = f"does not apply ({first})"
    if history:
        matching = commits_matching(pre_images(open(path).read()))
        if matching:
            span = describe(matching[0]) if len(matching) == 1 else \
                f"{describe(matching[-1])} to {describe(matching[0])}"
            status += f"; applies at {span}, {len(matching)} commits"
        else:
            status += "; no commit in this repository has all its pre-images"
    return status


def blocks_status(name: str, text: str, compile_it: bool) -> str:
    from facodegen.ops import api
    from facodegen import bench
    from facodegen.runtime import compiler
    from facodegen.codegen import render
    from sweep import parse_cell
    from trace_steps import apply_patch

    parts = []
    for cell, variant in BLOCKS_ON.get(name, DEFAULT_CELLS):
        c = parse_cell(cell, "fp8")
        arch, fields = bench.parse_variant("sm90:" + variant)
        fields.pop("dtype", None)
        shape = (c["batch"], c["seqlen_q"], c["seqlen_k"], c["heads_q"])
        spec = api.spec_for_shape(arch, c["head_dim"], "fp8", c["causal"], shape, **dict(fields, gpu="h200"))
        where = f"{cell}{' ' + variant if variant else ''}"
        plain = render.emit(spec)
        try:
            source = apply_patch(plain, text)
        except SystemExit as err:
            parts.append(f"{where}: does not apply ({err})")
            continue
        if compile_it:
            spills = compiler.compile_source(source, spec.arch, spec.variant, verbose=False).resources.spill_stores
            plain_spills = compiler.compile_source(plain, spec.arch, spec.variant, verbose=False).resources.spill_stores
            parts.append(f"{where}: applies, compiles, spills {spills} B (plain {plain_spills} B)")
        else:
            parts.append(f"{where}: applies")
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--history", action="store_true", help="for a git patch that does not apply: where it does")
    p.add_argument("--compile", action="store_true", help="compile each applied source patch (NVRTC, no GPU)")
    p.add_argument("files", nargs="*", help="records to check (default: every .patch and .blocks there)")
    args = p.parse_args(argv)
    files = args.files or sorted(glob.glob(os.path.join(EXPERIMENTS, "*.patch")) +
                                 glob.glob(os.path.join(EXPERIMENTS, "*.blocks")))
    print(f"at {git('rev-parse', '--short', 'HEAD').stdout.strip() or '?'}"
          f"{' (uncommitted changes)' if git('status', '--porcelain').stdout.strip() else ''}")
    print("| record | kind | status |\n|---|---|---|")
    for path in files:
        text = open(path).read()
        name = os.path.basename(path)
        if "\ndiff --git " in "\n" + text:
            kind, status = "git patch", git_patch_status(os.path.abspath(path), args.history)
        else:
            kind, status = "rendered-source blocks", blocks_status(name, text, args.compile)
        print(f"| `{name}` | {kind} | {status} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
