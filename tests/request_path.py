"""Follow one demo request through the product packages and count the package changes.

    PYTHONPATH=. python -m tests.request_path [--mode shared] [--list]

Runs the demo's engine (`python -m disagg demo`'s: `disagg.frontend.make_engine` on the
embedded pair) for one held-out prompt and records, under `sys.setprofile`, every function of the product
packages (pallas_kernels, unified_kv, models, drafter, disagg) the request calls, each
once, in the order of its first call: the code a reader walks to follow the request,
including what runs while the steps are traced. A package change is two neighbours of
that walk in different packages. The engine is built before recording starts; the
request is the first, so nothing is compiled yet.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

PACKAGES = ("pallas_kernels", "unified_kv", "models", "drafter", "disagg")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def walk_request(mode: str, max_new_tokens: int = 8) -> list[tuple[str, str, str]]:
    """(package, file, function) of every product function one request calls, in
    first-call order."""
    from disagg.frontend import load_pair, make_engine
    from drafter.default import load_prompts

    engine = make_engine(mode, load_pair(), eos=False)
    prompt = [p["tokens"] for p in load_prompts() if p["length"] <= 512][0]
    seen, walk = set(), []

    def record(frame, event, _):
        code = frame.f_code
        if event != "call" or code in seen:
            return
        seen.add(code)
        path = pathlib.Path(code.co_filename)
        if path.is_relative_to(ROOT) and path.relative_to(ROOT).parts[0] in PACKAGES:
            rel = path.relative_to(ROOT)
            walk.append((rel.parts[0], str(rel), code.co_qualname))

    sys.setprofile(record)
    try:
        engine.generate([prompt], max_new_tokens)
    finally:
        sys.setprofile(None)
    return walk


def package_runs(walk) -> list[str]:
    """The walk's packages with neighbours in one package merged."""
    runs = []
    for package, _, _ in walk:
        if not runs or runs[-1] != package:
            runs.append(package)
    return runs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", default="shared", choices=("aggregated", "shared", "private"),
                    help="the engine: aggregated, or disaggregated with the draft KV shared "
                    "or private")
    ap.add_argument("--list", action="store_true", help="print every function of the walk")
    args = ap.parse_args(argv)
    walk = walk_request(args.mode)
    runs = package_runs(walk)
    if args.list:
        for package, path, name in walk:
            print(f"{package:15s} {path}:{name}")
    print(" -> ".join(runs))
    report = {"mode": args.mode, "functions": len(walk),
              "files": len({path for _, path, _ in walk}), "package_changes": len(runs) - 1}
    print(report)
    return report


if __name__ == "__main__":
    main()
