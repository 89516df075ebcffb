"""The two-GPU benchmark (benchmarks/bench_two_gpu.py, issue 30), by part: common
(shared helpers), tensor_parallel (tp and hetero), streams (Poisson request streams and
their metrics), cross_process (remote: two processes over jax.experimental.transfer),
e2e (aggregated vs data-parallel vs disaggregated), runner (the parent's child
processes), children (a child's entry) and report (the goal keys)."""
