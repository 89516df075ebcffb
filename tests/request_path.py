"""Follow one demo request through the product packages and count the package changes.

    PYTHONPATH=. python -m tests.request_path [--mode shared] [--list] [--warm]

Runs the demo's engine (`python -m disagg demo`'s: `disagg.frontend.make_engine` on the
embedded pair) for one held-out prompt under `sys.setprofile`, and records every call
into the product packages (pallas_kernels, unified_kv, models, drafter, disagg) with the
chain of product packages above it on the call stack. Two counts:

  * chain: the package changes along a call chain, from the demo (`disagg.demo`,
    which calls `Engine.generate`) down to the callee (neighbours in one package
    merged), the most of any call the request makes. It is what a reader descends
    to follow the request from the front end to a kernel; the goal is at most 8.
  * walk: every product function once, in the order of its first call, and the
    changes between neighbours of that flat list (a step's calls into lower
    layers and back count each time), for reference.

The engine is built before recording starts. Without --warm the request is the
first, so the steps are traced while it runs (tracing is part of its path); with
--warm a first request runs before recording.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

PACKAGES = ("pallas_kernels", "unified_kv", "models", "drafter", "disagg")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _product_place(code) -> tuple[str, str] | None:
    """(package, path) of a product function's code, else None."""
    path = pathlib.Path(code.co_filename)
    if not path.is_relative_to(ROOT):
        return None
    rel = path.relative_to(ROOT)
    return (rel.parts[0], str(rel)) if rel.parts[0] in PACKAGES else None


def package_runs(packages) -> list[str]:
    """`packages` with neighbours in one package merged."""
    runs = []
    for package in packages:
        if not runs or runs[-1] != package:
            runs.append(package)
    return runs


def walk_request(mode: str, max_new_tokens: int = 8, warm: bool = False):
    """Returns (walk, longest_chain): walk is (package, file, function) of every product
    function the request calls, in first-call order; longest_chain is the product
    functions (package, function) of the call chain with the most package changes."""
    from disagg.frontend import load_pair, make_engine
    from drafter.default import load_prompts

    engine = make_engine(mode, load_pair(), eos=False)
    prompt = [p["tokens"] for p in load_prompts() if p["length"] <= 512][0]
    if warm:
        engine.generate([prompt], max_new_tokens)
    seen, walk = set(), []
    # Every Python frame: (package, name) or None; the demo's own call (disagg.demo)
    # is the chain's root.
    stack: list[tuple[str, str] | None] = [("disagg", "demo")]
    longest = {"changes": -1, "chain": []}

    def record(frame, event, _):
        if event == "call":
            code = frame.f_code
            place = _product_place(code)
            stack.append(None if place is None else (place[0], code.co_qualname))
            if place is None:
                return
            if code not in seen:
                seen.add(code)
                walk.append((place[0], place[1], code.co_qualname))
            chain = [f for f in stack if f is not None]
            changes = len(package_runs(p for p, _ in chain)) - 1
            if changes > longest["changes"]:
                longest.update(changes=changes, chain=list(chain))
        elif event == "return" and len(stack) > 1:
            stack.pop()

    sys.setprofile(record)
    try:
        engine.generate([prompt], max_new_tokens)
    finally:
        sys.setprofile(None)
    return walk, longest["chain"]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="shared", choices=("aggregated", "shared", "private"),
                    help="the engine: aggregated, or disaggregated with the draft KV shared "
                    "or private")
    ap.add_argument("--list", action="store_true", help="print every function of the walk")
    ap.add_argument("--warm", action="store_true", help="record a second request (steps "
                    "already compiled)")
    args = ap.parse_args(argv)
    walk, chain = walk_request(args.mode, warm=args.warm)
    if args.list:
        for package, path, name in walk:
            print(f"{package:15s} {path}:{name}")
    chain_runs = package_runs(p for p, _ in chain)
    print("longest chain:", " -> ".join(chain_runs))
    print("   through:", " -> ".join(f"{p}.{name}" for p, name in chain
                                      if name != "<genexpr>" and "<locals>" not in name))
    report = {"mode": args.mode, "warm": args.warm, "functions": len(walk),
              "files": len({path for _, path, _ in walk}),
              "chain_package_changes": len(chain_runs) - 1,
              "walk_package_changes": len(package_runs(p for p, _, _ in walk)) - 1}
    print(report)
    return report


if __name__ == "__main__":
    main()
