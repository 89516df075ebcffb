"""How often XLA records its CUDA graphs again, and what that costs, from XLA's log.

    TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 python ... 2> LOG
    python benchmarks/graph_records.py LOG

A CUDA graph holds the device addresses of its buffers. When a call's inputs, outputs or
temporaries sit elsewhere than in the graph's last launch, XLA records the graph again
before it launches it, on the host, inside the call. This counts those records per
graph size (its commands) and sums their host time, beside the graphs' first records.
"""

from __future__ import annotations

import argparse
import collections
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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log", help="stderr of a run with TF_CPP_VMODULE=command_buffer_thunk=3")
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
    return got


if __name__ == "__main__":
    main()
