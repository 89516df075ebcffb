"""Page accounting of a serving engine and the context workers feeding it.

Conservation: with no request running, every pool's free pages equal its
usable pages and nothing is reserved, on the generation engine and on each
in-process context worker. `page_report` settles idle engines first (slot
resets land on the step after a request ends) and says whether that holds.
"""

from __future__ import annotations

import numpy as np

from drafter.engine import Engine


def engine_pages(engine: Engine) -> dict:
    """One engine's pages per pool after its pending resets land (when idle)."""
    if not engine.scheduler.num_unfinished and engine.has_work:
        engine.run()
    usable = [p.num_usable_pages for p in engine.spec.pools]
    free = np.asarray(engine.state.kv.num_free).tolist()
    reserved = list(engine.admission.reserved_pages)
    return {"active": engine.num_active, "free": free, "usable": usable, "reserved": reserved,
            "conserved": (engine.num_active == 0 and free == usable
                          and reserved == [0] * len(usable))}


def page_report(engine: Engine) -> dict:
    """The generation engine's pages and each in-process context worker's."""
    contexts = getattr(engine.kv_source, "contexts", ())
    report = {"generation": engine_pages(engine),
              "contexts": [engine_pages(ctx.engine) for ctx in contexts]}
    report["conserved"] = all(r["conserved"] for r in [report["generation"],
                                                       *report["contexts"]])
    return report
