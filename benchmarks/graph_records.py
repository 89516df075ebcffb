"""How often XLA records its CUDA graphs again, and what that costs, from XLA's log; and
what a program launches outside its graphs, from XLA's dump.

    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 \
        XLA_FLAGS=--xla_dump_to=DUMP python ... 2> LOG
    python benchmarks/graph_records.py LOG [--dump DUMP]

A CUDA graph holds the device addresses of its buffers. When a call's inputs, outputs or
temporaries sit elsewhere than in the graph's last launch, XLA records the graph again
before it launches it, on the host, inside the call. This counts those records per
graph size (its commands) and sums their host time, beside the graphs' first records.
`--dump`: per compiled program, its top-level thunks by kind (kCommandBuffer: one graph
launch; any other kind launches on its own, from the host, each call).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re

_RECORD = re.compile(r"Updated command buffer in (\d+) \S+; num_commands=(\d+)")
_FIRST = re.compile(r"Initialized command buffer .* in (\d+) \S+; num_commands=(\d+)")


def summarize(lines) -> dict:
    """{"records": n, "record_us": total, "first_records": n, "by_commands": {commands:
    [record us, ...]}} of the log's lines."""
    by_commands: dict[int, list[int]] = collections.defaultdict(list)
    first = 0
    for line in lines:
        if m := _RECORD.search(line):
            by_commands[int(m.group(2))].append(int(m.group(1)))
        elif _FIRST.search(line):
            first += 1
    return {"records": sum(map(len, by_commands.values())),
            "record_us": sum(map(sum, by_commands.values())),
            "first_records": first,
            "by_commands": dict(sorted(by_commands.items()))}


_THUNK = re.compile(r"^(\s*)\d+: (k\w+)")


def top_level_thunks(lines) -> collections.Counter:
    """Kinds of a thunk sequence dump's outermost thunks (the least indented entries;
    a command buffer's own thunks are nested under it)."""
    found = [(len(m.group(1)), m.group(2)) for line in lines if (m := _THUNK.match(line))]
    outer = min((depth for depth, _ in found), default=0)
    return collections.Counter(kind for depth, kind in found if depth == outer)


def program_thunks(dump_dir: str) -> dict[str, collections.Counter]:
    """Per program of an XLA dump, its top-level thunks by kind, after the thunk passes
    (where command buffers are formed) when the dump has them."""
    out = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*.thunk_sequence*.txt"))):
        name = os.path.basename(path)
        program = name.split(".thunk_sequence")[0]
        if program in out and "after_thunk_passes" not in name:
            continue
        with open(path, errors="replace") as f:
            out[program] = top_level_thunks(f)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", help="stderr of a run with TF_CPP_VMODULE=command_buffer_thunk=3")
    ap.add_argument("--dump", default=None, help="the run's XLA dump (--xla_dump_to)")
    args = ap.parse_args(argv)
    with open(args.log, errors="replace") as f:
        got = summarize(f)
    n = got["records"]
    print(f"graphs recorded again: {n}, {got['record_us'] / 1e3:.1f} ms in all "
          f"({got['record_us'] / max(n, 1):.0f} us each); first records: {got['first_records']}")
    for commands, us in sorted(got["by_commands"].items(), key=lambda x: -sum(x[1])):
        us = sorted(us)
        print(f"  {commands:4d} commands: {len(us)} records, median {us[len(us) // 2]} us, "
              f"max {us[-1]} us")
    if args.dump:
        got["programs"] = {name: dict(kinds) for name, kinds in program_thunks(args.dump).items()}
        print("top-level thunks per program (kCommandBuffer: one graph launch each):")
        for name, kinds in got["programs"].items():
            print(f"  {name[:70]}: {sum(kinds.values())} "
                  f"{dict(sorted(kinds.items(), key=lambda x: -x[1]))}")
    return got


if __name__ == "__main__":
    main()
