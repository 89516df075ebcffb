"""The XLA programs a block of a test compiles, from jax's compile log."""

import contextlib
import logging

import jax


@contextlib.contextmanager
def compiled_in(caplog, name: str = ""):
    """Yields a list that, once the block ends, holds the compile-log lines of the
    programs compiled inside it whose name contains `name`."""
    found, start = [], len(caplog.records)
    jax.config.update("jax_log_compiles", True)
    try:
        with caplog.at_level(logging.WARNING):
            yield found
    finally:
        jax.config.update("jax_log_compiles", False)
    found += [r.getMessage() for r in caplog.records[start:]
              if "Finished XLA compilation" in r.getMessage() and name in r.getMessage()]
