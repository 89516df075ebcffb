"""Scanned and unrolled layers are the same model: same tokens, same acceptance."""

import dataclasses

import jax
import numpy as np
import pytest

from drafter.engine import Engine
from drafter.steps import CALL_KINDS, GRAPH_COMMANDS, MAX_UNROLLED_GPU_LAYERS, NO_GRAPH_MIN_COMMANDS
from tests.drafter.tiny import tiny_pair


def test_scanned_and_unrolled_layers_generate_the_same_tokens_and_acceptance():
    params, cfg, _ = tiny_pair()
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 60, n).tolist() for n in (5, 23, 40)]  # past the windows
    runs = {}
    for loop in ("scan", "unrolled"):
        # batch-invariant: one shape a call kind, fewer compiles (rows are not the subject)
        engine = Engine(params, dataclasses.replace(cfg, layer_loop=loop), batch_invariant=True)
        stacked = isinstance(engine.params["target"]["layers"], dict)
        assert stacked == (loop == "scan")
        runs[loop] = [(r.tokens, r.acceptance) for r in engine.generate(prompts, 12)]
    assert runs["scan"] == runs["unrolled"]


def test_scanned_layers_unrolled_by_k_per_trip_generate_the_same_tokens(monkeypatch):
    params, cfg, _ = tiny_pair()
    unrolls = []
    real_scan = jax.lax.scan

    def recording_scan(*args, unroll=1, **kw):
        unrolls.append(unroll)
        return real_scan(*args, unroll=unroll, **kw)

    monkeypatch.setattr(jax.lax, "scan", recording_scan)
    rng = np.random.default_rng(6)
    prompts = [rng.integers(0, 60, n).tolist() for n in (7, 33)]
    runs = {}
    for k in (1, 2):
        engine = Engine(params, dataclasses.replace(cfg, layer_loop="scan", scan_unroll=k),
                        batch_invariant=True)
        runs[k] = [(r.tokens, r.acceptance) for r in engine.generate(prompts, 10)]
    assert runs[1] == runs[2]
    assert 2 in unrolls  # the target's layer scans took the factor


def test_layer_loop_auto_scans_except_shallow_models_on_gpus_and_unknown_names_are_refused(
        monkeypatch):
    _, cfg, _ = tiny_pair()
    assert cfg.scans_layers == (jax.default_backend() != "gpu")
    depth = MAX_UNROLLED_GPU_LAYERS + 1
    deep = dataclasses.replace(cfg, target=dataclasses.replace(
        cfg.target, num_layers=depth, layer_types=(cfg.target.layer_types[0],) * depth))
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not cfg.scans_layers and deep.scans_layers  # a deep model compiles one body
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert cfg.scans_layers and deep.scans_layers
    with pytest.raises(ValueError, match="layer_loop 'loop'"):
        dataclasses.replace(cfg, layer_loop="loop").scans_layers


def test_scanned_steps_on_gpus_compile_with_cublas_reading_the_weight_slice_in_place(
        monkeypatch):
    _, cfg, _ = tiny_pair()
    scan, unrolled = (dataclasses.replace(cfg, layer_loop=loop) for loop in ("scan", "unrolled"))
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert scan.compiler_options == {} and unrolled.compiler_options == {}
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    gpu_options = scan.compiler_options
    assert gpu_options == {"xla_gpu_enable_triton_gemm": False,
                           "xla_gpu_enable_dynamic_slice_fusion": True}
    assert unrolled.compiler_options == {}
    monkeypatch.undo()
    # XLA takes the options by name on any backend: a jit given them compiles and runs
    step = jax.jit(lambda x: x @ x, compiler_options=gpu_options)
    assert float(step(np.eye(2, dtype=np.float32))[0, 0]) == 1.0


def test_graph_loops_put_loops_and_conditionals_in_gpu_command_buffers(monkeypatch):
    _, cfg, _ = tiny_pair()
    graphs = dataclasses.replace(cfg, layer_loop="unrolled", graph_loops=True)
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert graphs.compiler_options == {}
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    options = graphs.compiler_options
    commands = options["xla_gpu_enable_command_buffer"].split(",")
    assert {"WHILE", "CONDITIONAL"} <= set(commands) and set(GRAPH_COMMANDS) <= set(commands)
    assert "xla_gpu_enable_command_buffer" not in dataclasses.replace(
        graphs, graph_loops=False).compiler_options
    monkeypatch.undo()
    # the command list parses (an unknown command would be refused by name)
    loop = jax.jit(lambda x: jax.lax.fori_loop(0, 3, lambda i, y: 2 * y, x),
                   compiler_options=options)
    assert float(loop(np.float32(1.0))) == 8.0


def test_calls_left_out_of_graph_calls_form_no_gpu_command_buffer(monkeypatch):
    """StepConfig.graph_calls: on GPUs a kind of call left out launches its kernels one
    by one (no command buffer forms below XLA's minimum graph size); the others keep
    the shared options; an unknown kind is refused by name."""
    _, cfg, _ = tiny_pair()
    cfg = dataclasses.replace(cfg, layer_loop="unrolled", graph_calls=("prefill", "decode"))
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert all(cfg.compiler_options_for(k) == {} for k in CALL_KINDS)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert cfg.compiler_options_for("decode") == cfg.compiler_options_for("prefill") == {}
    for kind in ("import", "export"):
        assert cfg.compiler_options_for(kind) == {
            "xla_gpu_graph_min_graph_size": NO_GRAPH_MIN_COMMANDS}
    looped = dataclasses.replace(cfg, graph_loops=True).compiler_options_for("export")
    assert "xla_gpu_enable_command_buffer" in looped and "xla_gpu_graph_min_graph_size" in looped
    with pytest.raises(ValueError, match=r"unknown call kind\(s\) \['imports'\]"):
        dataclasses.replace(cfg, graph_calls=("imports",)).compiler_options_for("decode")
    options = cfg.compiler_options_for("import")
    monkeypatch.undo()
    # XLA takes the option by name on any backend
    step = jax.jit(lambda x: x + 1, compiler_options=options)
    assert float(step(np.float32(1.0))) == 2.0
