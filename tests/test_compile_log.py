"""tests.compile_log sees a compile inside its block, and only there."""

import jax
import jax.numpy as jnp

from tests.compile_log import compiled_in


def test_a_compile_inside_the_block_is_listed_and_one_before_is_not(caplog):
    def compiled_only_here(x):
        return x * 3 + 1

    def compiled_before(x):
        return x - 2

    jax.jit(compiled_before)(jnp.arange(3))
    with compiled_in(caplog, "compiled_") as found:
        jax.jit(compiled_only_here)(jnp.arange(5))
    assert len(found) == 1 and "compiled_only_here" in found[0], found
    with compiled_in(caplog, "compiled_") as found:
        jax.jit(compiled_only_here)(jnp.arange(5))   # cached: nothing compiles
    assert found == []
