#!/usr/bin/env bash
# Compiled-kernel tests and every benchmark on the GPU machine; results under $OUT.
#
#   OUT=DIR bash benchmarks/gpu_all.sh [STAGE...]   # default: every stage, in this order
#
# STAGEs: tests, lossless (speculative == plain greedy on the GPU), attention, decode
# (batch tables, cache baselines, decode speed), attention_small, eval, transfer, serving,
# serving_profile, engine, load, scale, scale_long, scale_profile. Each fits one 600 s
# device call (the device tool's limit): every step has its own timeout, so a slow or
# hung step costs itself, not the call.
# Arguments other than stage names go to bench_paged_attention.py.
# DRY_RUN=1 prints the commands instead. On a 2-GPU machine the transfer
# benchmark moves GPU 0 -> GPU 1; the rest use GPU 0.
# Two-GPU stages (not in the default list; one 600 s call each, all into
# $OUT/two_gpu.json): two_gpu (TP=2 vs TP=1, context TP=2 into generation TP=1,
# context and generation processes on GPUs 0 and 1), two_gpu_e2e (aggregated vs
# data-parallel vs disaggregated end to end), two_gpu_scale (TP=2 vs TP=1 step time
# at the Qwen3-8B shape).
# attention_b16 (not in the default list): verify-16 and draft-16 against decode.
# scale_unroll (not in the default list): the batch-1 8B-shaped steps with 4 scanned
# target layers per loop trip (StepConfig.scan_unroll), into scale_unroll4.json.
# scale_splits (not in the default list): the batch-1 8B-shaped steps with the Gluon
# attention's small-batch key splits of 256 keys (the default) and 512, on the same
# weights in one call, into scale_splits.json.
# scale_b1 (not in the default list): the batch-1 8B-shaped steps at 1K alone (the goal
# keys of `scale` without batch 32), into scale_b1.json.
# scale_lone (not in the default list): the batch-1 8B-shaped steps at 1K, then one
# speculative request on a 33-slot engine with decode calls padded to its rows beside a
# row per slot, into scale_lone.json.
# scale_b32_8k (not in the default list): batch 32 x 8K prompts, into scale_b32_8k.json.
# scale_batches, scale_32k (not in the default list): the 8B-shaped steps at batches 8 and
# 64 (1K), and at 32K contexts for batches 1 and 8, into scale_batches.json and
# scale_32k.json (a run cut at its limit keeps the rows it finished).
# graph_loops_serving, graph_loops_scale (not in the default list): XLA command buffers
# that also take loops (StepConfig.graph_loops) beside the default, same call: the demo
# and handoff with one profiled run each, into graphs_{off,on}/; the 8B-shaped batch-1
# steps into scale_b1_graphs_{off,on}.json.
# graph_copies (not in the default list): the demo with one program per step variant
# beside two alternated copies (StepConfig.graph_copies), and the copies' graph records.
# serving_8b (not in the default list): the demo and handoff parts on the Qwen3-8B-shaped pair
# (random weights), aggregated beside disaggregated-shared, into serving_8b.json; then the
# demo with one decode step per call (what a call of 8 steps adds to TTFT) into
# serving_8b_steps1/.
# serving_process (not in the default list): the demo with its context worker in a child
# process on the same GPU, beside the in-process pair (serving_process/serving.json).
# graph_calls (not in the default list): the demo and short handoffs with transfers,
# then prefills too, launched kernel by kernel rather than as CUDA graphs
# (StepConfig.graph_calls).
# handoff_timeline, graph_records (not in the default list): one handoff's calls and reads
# in order (benchmarks/profile_handoff.py), and how often the demo's calls record their
# CUDA graphs again (benchmarks/graph_records.py).
# train_draft (not in the default list): a candidate drafter for the shipped target, a new
# 4-layer one by default (the shipped drafter trained on further keeps its acceptance:
# docs/decisions.md), on 1K and 8K windows in turn, over DRAFT_STEPS (default 12,000:
# what 450 s holds on the H200, about 28 a second) on one warm-up-and-cosine schedule
# that may span several device calls: each call trains for TRAIN_S (450) s, and the run (its
# training state, the drafter so far as draft_long/draft, its loss curve) comes back as
# $OUT/train_draft.tar.* (15 MiB pieces: what a call hands back). To go on, put those
# pieces in .train/ (git ignores it), carry it, and give TRAIN_FROM=.train with the same
# DRAFT_STEPS, DRAFT_SHAPE and TRAIN_WINDOWS (and DRAFT_FROM, if any: make_default refuses
# other settings by name); `cat train_draft.tar.* | tar x` unpacks the drafter.
# Measure it with `python -m drafter.evaluate --draft DIR/draft_long/draft --compare-to
# shipped` (one call: the shipped drafter evaluated first in the same run; the acceptance
# set, 16 held-out prompts a length; the difference per length with a paired 95% interval
# over prompts), and ship it with drafter.default.import_draft only if it is better at
# every length.
# TRAIN_WINDOWS: the windows, LENGTHxBATCH each (default "1024x16 8192x2").
# DRAFT_SHAPE: the new drafter's make_default arguments (default "--draft-layers 4"; e.g.
# "--draft-layers 4 --draft-target-layers 1 3 5 --draft-attention full").
# DRAFT_FROM=DIR (a candidate's draft directory in the checkout), or DRAFT_FROM=shipped (the
# shipped drafter), trains that drafter on instead of a new one (peak learning rate 5e-4,
# against 2e-3 for a new one).
# eval_candidate (not in the default list): that measurement in one call, for the drafter
# in CANDIDATE (default .train/draft_long/draft: carry it), into eval_candidate_gpu.json;
# CANDIDATE_TARGET=DIR: a new pair, that drafter with this target.
# TARGET_FROM=DIR (a candidate target in the checkout, e.g. make_default's DIR/target) trains
# a new drafter for that target instead (DRAFT_SHAPE, default the shipped drafter's shape),
# or with DRAFT_FROM=DIR trains on a drafter trained for it before;
# measure the pair with `python -m drafter.evaluate --target DIR --draft ... --compare-to
# shipped`. EXTRA_CODE=1 trains on this machine's site-packages code too (--extra-code).
# train_target (not in the default list): a new target alone (make_default --draft-steps 0),
# the shipped target's shape, TARGET_STEPS (default 7,000: what TRAIN_S=450 holds on an
# H100, about 16 a second) on one warm-up-and-cosine schedule, on the stdlib's training
# files and with EXTRA_CODE=1 this machine's site-packages code; it comes back as
# $OUT/pair/target (9 MB) with its loss curve, and TARGET_FROM=DIR/pair/target trains a
# drafter for it (train_draft).
# TRAIN_ARGS: further make_default arguments for the run (e.g. "--anchor-spacing 8
# --draft-labels target", or "--greedy-tail 128": windows ending in the target's own greedy
# continuation, blocks anchored there; "--sampled-context 256" before it: the tail continues
# the target's own draws); part of its settings like the others.
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 TQDM_DISABLE=1
OUT=${OUT:-benchmarks/results}
stages=() bench_args=()
for a in "$@"; do
  case $a in
    tests|lossless|attention|attention_b16|serving_8b|graph_loops_serving|graph_loops_scale|scale_b1|scale_lone|serving_process|scale_batches|scale_b32_8k|scale_32k|attention_small|decode|eval|transfer|serving|serving_profile|handoff_timeline|graph_records|graph_copies|graph_calls|engine|load|scale|scale_unroll|scale_splits|scale_long|scale_profile|two_gpu|two_gpu_e2e|two_gpu_scale|train_target|train_draft|eval_candidate)
      stages+=("$a") ;;
    *) bench_args+=("$a") ;;
  esac
done
[ ${#stages[@]} -eq 0 ] && stages=(tests lossless attention attention_small decode eval transfer serving serving_profile engine load scale
                                    scale_long scale_profile)
run() {  # run SECONDS NAME CMD...: CMD's output to the terminal and $OUT/NAME.txt
  local limit=$1 name=$2; shift 2
  if [ -n "${DRY_RUN:-}" ]; then echo "[$limit s] $*"; return; fi
  # -k: a step that drains on SIGTERM (serve's loop finishes its accepted requests, and a
  # benchmark then goes on to its next pass) is killed 10 s later, so it cannot keep the
  # GPU busy under the steps after it
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$OUT/$name.txt"
  case "${PIPESTATUS[0]}" in 124|137) echo "$name: stopped at its ${limit}s limit" | tee -a "$OUT/$name.txt" ;; esac
}
site_packages() {  # this machine's installed Python code (EXTRA_CODE's corpus)
  python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
}
[ -z "${DRY_RUN:-}" ] && nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem \
  --format=csv | tee "$OUT/gpu.txt"
for stage in "${stages[@]}"; do
  case $stage in
    tests)
      # the compiled tests (3-9 s each: a compile apiece, 184 of them: over 500 s in one
      # process), over 4 pytest processes sharing the GPU (compiles are the host's work;
      # no process takes the GPU's memory up front); the interpret-mode suite is CI's.
      # The pools of 2^31 elements and more (several GB each, and their references) run
      # after, alone: beside three other processes they ran out of an H100's 80 GB.
      files=(tests/pallas_kernels/test_gpu_compiled.py
             tests/pallas_kernels/test_paged_attention_gluon.py
             tests/pallas_kernels/test_gluon_call.py tests/pallas_kernels/test_rope_store.py
             tests/drafter/test_tensor_parallel.py)
      run 420 pytest_gpu env XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q \
        -p no:cacheprovider -n 4 --dist load -k "not 2_31" "${files[@]}"
      run 150 pytest_gpu_large_pools env XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m \
        pytest -q -p no:cacheprovider -k 2_31 "${files[@]}" ;;
    lossless)
      # speculative == plain greedy token for token with the GPU's kernels and lookahead;
      # sampling: truncation and rejection sampling's distribution, and a sampled request
      # truncated to one token == greedy, speculative and plain; log-probabilities: the
      # target's, and asking for them changes no token; penalties and logit bias: the
      # reference's tokens, and on the shipped pair penalized speculative == plain with
      # drafts accepted (the GPU's own rounding of the one penalty expression); min_tokens
      # bans, speculative == plain; prompt log-probabilities, the target's across chunks;
      # every step, export and import call updates the caches in place (no second copy)
      run 400 pytest_lossless env XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q \
        -p no:cacheprovider -n 4 --dist load \
        tests/drafter/test_lossless.py tests/drafter/test_precision.py \
        tests/drafter/test_sampling.py \
        "tests/drafter/test_engine_sampling.py::test_sampling_truncated_to_the_most_likely_token_is_greedy" \
        "tests/drafter/test_engine_sampling.py::test_logprobs_are_the_targets_own_for_every_kept_token" \
        "tests/drafter/test_engine_sampling.py::test_penalties_score_each_token_against_the_tokens_generated_before_it" \
        "tests/drafter/test_engine_sampling.py::test_logit_bias_forces_and_bans_tokens_from_the_first_one_on" \
        "tests/drafter/test_engine_sampling.py::test_min_tokens_bans_stop_and_eos_ids_from_the_first_tokens_only" \
        "tests/drafter/test_engine_sampling.py::test_prompt_logprobs_are_the_targets_own_across_chunks" \
        "tests/drafter/test_default_pair.py::test_speculative_equals_plain_on_shipped_prompts_and_acceptance_floor" \
        "tests/drafter/test_engine.py::test_every_step_call_writes_the_cache_in_place" \
        "tests/drafter/test_kv_io.py::test_export_and_import_calls_keep_each_cache_in_place" ;;
    attention)
      run 330 paged_attention python3 benchmarks/bench_paged_attention.py --out "$OUT" \
        "${bench_args[@]}"
      run 200 paged_attention_prefill python3 benchmarks/bench_paged_attention.py --out "$OUT" \
        --prefill-only
      run 240 gluon_attention python3 benchmarks/bench_gluon_attention.py --out "$OUT" ;;
    attention_b16)
      # verify-16 and the 16-query draft block (DFlash-b16) against decode, no prefill
      run 300 gluon_attention_b16 python3 benchmarks/bench_gluon_attention.py --out "$OUT" \
        --block 16 --no-prefill ;;
    attention_small)
      # batch 1-4: fixed key-split sizes against the default plan (launch_plan)
      run 400 small_batch_attention python3 benchmarks/bench_small_batch_attention.py \
        --out "$OUT" ;;
    decode)
      run 100 batch_tables python3 benchmarks/bench_batch_tables.py --out "$OUT"
      run 230 cache_baselines python3 benchmarks/bench_cache_baselines.py --out "$OUT" \
        --contexts 4096 131072 1048576
      run 230 decode_speed python3 benchmarks/bench_decode_speed.py --out "$OUT" ;;
    train_target)
      rm -rf "$OUT/pair"
      run $(( ${TRAIN_S:-450} + 90 )) train_target python3 -m drafter.make_default --out "$OUT/pair" \
        --target-steps "${TARGET_STEPS:-7000}" --draft-steps 0 --budget-s "${TRAIN_S:-450}" \
        $([ -n "${EXTRA_CODE:-}" ] && echo --extra-code "$(site_packages)") ;;
    train_draft)
      rm -rf "$OUT/draft_long" "$OUT"/train_draft.tar.*
      if [ -n "${TRAIN_FROM:-}" ] && [ -z "${DRY_RUN:-}" ]; then
        cat "$TRAIN_FROM"/train_draft.tar.* | tar -xf - -C "$OUT" || { echo "TRAIN_FROM=$TRAIN_FROM: no train_draft.tar.* pieces there"; exit 1; }
      fi
      if [ -n "${TARGET_FROM:-}" ] && [ "${DRAFT_FROM:-}" = shipped ]; then
        echo "TARGET_FROM with DRAFT_FROM=shipped: the shipped drafter is the shipped target's; give DRAFT_FROM=DIR (a drafter trained for TARGET_FROM's target)"; exit 1
      elif [ -n "${TARGET_FROM:-}" ]; then
        pair_args=(--target-from "$TARGET_FROM"
                   $([ -n "${DRAFT_FROM:-}" ] && echo --draft-from "$DRAFT_FROM" || echo ${DRAFT_SHAPE:-}))
      else
        pair_args=(--from-default $([ -n "${DRAFT_FROM:-}" ] && [ "$DRAFT_FROM" != shipped ] && echo --draft-from "$DRAFT_FROM")
                   $([ -z "${DRAFT_FROM:-}" ] && echo --fresh-draft ${DRAFT_SHAPE:---draft-layers 4}))
      fi
      [ -n "${EXTRA_CODE:-}" ] && pair_args+=(--extra-code "$(site_packages)")
      run $(( ${TRAIN_S:-450} + 90 )) train_draft python3 -m drafter.make_default --out "$OUT/draft_long" \
        "${pair_args[@]}" \
        --windows ${TRAIN_WINDOWS:-1024x16 8192x2} \
        --draft-steps "${DRAFT_STEPS:-12000}" --state-dir "$OUT/draft_long/state" \
        --draft-lr "$([ -n "${DRAFT_FROM:-}" ] && echo 5e-4 || echo 2e-3)" --budget-s "${TRAIN_S:-450}" \
        ${TRAIN_ARGS:-}
      if [ -z "${DRY_RUN:-}" ] && [ -d "$OUT/draft_long/state/state" ]; then
        # the newest saved step alone (orbax keeps two), so the pieces stay within what a
        # call hands back
        (cd "$OUT/draft_long/state/state" && ls -d [0-9]* | sort -n | head -n -1 | xargs -r rm -rf)
        tar -C "$OUT" -cf - draft_long | split -b 15m - "$OUT/train_draft.tar." \
          && rm -rf "$OUT/draft_long"
      fi ;;
    eval)
      # the acceptance set over 64 new tokens a prompt (the default), then over 256
      run 250 eval python3 -m drafter.evaluate --json "$OUT/eval_default_gpu.json"
      run 330 eval_max_new_256 python3 -m drafter.evaluate --max-new 256 \
        --json "$OUT/eval_default_max_new_256_gpu.json" ;;
    eval_candidate)
      run 570 eval_candidate python3 -m drafter.evaluate --draft "${CANDIDATE:-.train/draft_long/draft}" \
        $([ -n "${CANDIDATE_TARGET:-}" ] && echo --target "$CANDIDATE_TARGET") \
        --compare-to shipped --json "$OUT/eval_candidate_gpu.json" ;;
    transfer)
      run 270 transfer python3 benchmarks/bench_transfer.py --out "$OUT" ;;
    serving)
      run 450 serving python3 benchmarks/bench_serving.py --out "$OUT" \
        --parts demo handoff --repeats 15 ;;
    serving_8b)
      run 400 serving_8b python3 benchmarks/bench_serving.py --out "$OUT" --pair 8b \
        --parts demo handoff --repeats 5 --demo-modes disagg-shared --handoff-lengths 128 2048 8192
      mkdir -p "$OUT/serving_8b_steps1"
      run 150 serving_8b_steps1 python3 benchmarks/bench_serving.py --pair 8b --parts demo \
        --repeats 3 --demo-modes disagg-shared --demo-decode-steps 1 \
        --out "$OUT/serving_8b_steps1" ;;
    serving_process)
      # the demo with its context worker in a child process on the same GPU (two host loops
      # in two processes, KV through jax.experimental.transfer) beside the in-process pair;
      # each process takes 40% of the GPU's memory
      mkdir -p "$OUT/serving_process"
      run 300 serving_process env XLA_PYTHON_CLIENT_MEM_FRACTION=0.4 python3 \
        benchmarks/bench_serving.py --out "$OUT/serving_process" --parts demo --repeats 9 \
        --demo-modes disagg-shared disagg-shared-process ;;
    serving_profile)
      # where the demo's time goes: host time by function, kernels and host dispatch per
      # jitted function of one run (aggregated beside disaggregated-shared)
      mkdir -p "$OUT/serving_profile"
      run 200 serving_profile python3 benchmarks/bench_serving.py --out "$OUT/serving_profile" \
        --parts demo --repeats 3 --demo-modes disagg-shared --profile "$OUT/serving_profile"
      rm -rf "$OUT/serving_profile"/trace_* ;;
    handoff_timeline)
      # one request's calls, reads and device spans, aggregated beside disaggregated
      # (unprofiled: the host costs as served; profiled: the device spans and the order)
      run 200 handoff_timeline python3 benchmarks/profile_handoff.py --lengths 128 2048 \
        --out "$OUT/handoff_timeline" ;;
    graph_records)
      # the demo's engines under XLA's command-buffer log: how often graphs are recorded
      # again (a call's buffers moved) and the host time that takes; and, from XLA's dump of
      # the step, import and export programs, what each launches outside its graphs
      mkdir -p "$OUT/graph_records"
      run 240 graph_records_log env TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=command_buffer_thunk=3 \
        XLA_FLAGS="--xla_dump_to=/tmp/graph_records_dump --xla_dump_hlo_module_re=.*(packed_step|import_step|export_step).*" \
        python3 benchmarks/bench_serving.py --out "$OUT/graph_records" --parts demo \
        --repeats 1 --demo-modes disagg-shared
      run 30 graph_records python3 benchmarks/graph_records.py "$OUT/graph_records_log.txt" \
        --dump /tmp/graph_records_dump
      [ -z "${DRY_RUN:-}" ] && gzip -f "$OUT/graph_records_log.txt" && rm -rf /tmp/graph_records_dump ;;
    graph_copies)
      # one program per step variant beside two alternated copies (StepConfig.graph_copies:
      # each copy's CUDA graph sees the same buffer addresses call after call), then the
      # copies under XLA's command-buffer log (how often graphs are still recorded again)
      mkdir -p "$OUT/graph_copies_log"
      for n in 1 2; do
        mkdir -p "$OUT/graph_copies_$n"
        run 150 serving_graph_copies_$n python3 benchmarks/bench_serving.py \
          --out "$OUT/graph_copies_$n" --parts demo --repeats 5 \
          --demo-modes disagg-shared --graph-copies $n
      done
      run 120 graph_copies_records_log env TF_CPP_MIN_LOG_LEVEL=0 \
        TF_CPP_VMODULE=command_buffer_thunk=3 python3 benchmarks/bench_serving.py \
        --out "$OUT/graph_copies_log" --parts demo --repeats 1 --demo-modes disagg-shared \
        --graph-copies 2
      run 30 graph_copies_records python3 benchmarks/graph_records.py \
        "$OUT/graph_copies_records_log.txt"
      [ -z "${DRY_RUN:-}" ] && gzip -f "$OUT/graph_copies_records_log.txt" ;;
    graph_calls)
      # the demo and a 128/512-token handoff with every kind of call as CUDA graphs (the
      # default) beside transfers, then prefills too, launched kernel by kernel
      # (StepConfig.graph_calls), and transfers so with two copies of each step program
      for v in "all:prefill decode import export:1" "steps:prefill decode:1" \
               "decode:decode:1" "steps2:prefill decode:2"; do
        IFS=: read -r name calls copies <<< "$v"
        mkdir -p "$OUT/graph_calls_$name"
        run 145 serving_graph_calls_$name python3 benchmarks/bench_serving.py \
          --out "$OUT/graph_calls_$name" --parts demo handoff --repeats 5 \
          --demo-modes disagg-shared --handoff-lengths 128 512 --graph-calls $calls \
          --graph-copies $copies
      done ;;
    graph_loops_serving)
      for g in off on; do
        mkdir -p "$OUT/graphs_$g"
        run 160 serving_graphs_$g python3 benchmarks/bench_serving.py --out "$OUT/graphs_$g" \
          --parts demo handoff --repeats 5 --demo-modes disagg-shared \
          --profile "$OUT/graphs_$g" $([ $g = on ] && echo --graph-loops)
        rm -rf "$OUT/graphs_$g"/trace_* "$OUT/graphs_$g"/demo_profile_*  # the log has them
      done ;;
    graph_loops_scale)
      for g in off on; do
        run 280 scale_graphs_$g python3 benchmarks/bench_scale.py --out "$OUT" --batches 1 \
          --layer-loop scan --steps 8 --tag _b1_graphs_$g $([ $g = on ] && echo --graph-loops)
      done ;;
    engine)
      # batch 16 then batch 1 (each compiles its own steps: one call for both; the part
      # writes after each batch, so a run cut at its limit keeps batch 16)
      mkdir -p "$OUT/engine"
      run 560 serving_engine python3 benchmarks/bench_serving.py --out "$OUT/engine" \
        --parts engine --engine-batches 16 1 ;;
    load)
      # 200 requests through serve, both modes, each engine warmed first then two passes of
      # the stream (requests differing between passes of one mode and between modes);
      # batch-invariant engines: every answer must equal across passes and modes
      mkdir -p "$OUT/load"
      run 585 serving_load python3 benchmarks/bench_serving.py --out "$OUT/load" --parts load \
        --load-modes aggregated disagg-shared --load-passes 2 --batch-invariant ;;
    scale)
      # the Qwen3-8B-shaped pair, scanned layers (an unrolled 36-layer step compiles for
      # about a minute per program): batch 1 first (the goal keys), then batch 32
      run 470 scale python3 benchmarks/bench_scale.py --out "$OUT" --batches 1 32 \
        --layer-loop scan --steps 8 ;;
    scale_lone)
      run 560 scale_lone python3 benchmarks/bench_scale.py --out "$OUT" --batches 1 \
        --layer-loop scan --steps 8 --lone-request-slots 33 --tag _lone ;;
    scale_unroll)
      # batch 1 with 4 scanned target layers per loop trip, beside `scale`'s 1 (the same
      # arithmetic; fewer trips of the layer loop)
      run 330 scale_unroll python3 benchmarks/bench_scale.py --out "$OUT" --batches 1 \
        --layer-loop scan --scan-unroll 4 --steps 8 --tag _unroll4 ;;
    scale_b1)
      run 330 scale_b1 python3 benchmarks/bench_scale.py --out "$OUT" --batches 1 \
        --layer-loop scan --steps 8 --tag _b1 ;;
    scale_batches)
      run 560 scale_batches python3 benchmarks/bench_scale.py --out "$OUT" --batches 8 64 \
        --layer-loop scan --steps 8 --tag _batches ;;
    scale_b32_8k)
      # batch 32 x 8K prompts: the weights drawn in step form, in one piece below a 23 GiB
      # cache (an H100 held both only that way), then batched 8K prefill and the steps
      run 560 scale_b32_8k python3 benchmarks/bench_scale.py --out "$OUT" --batches 32 \
        --contexts 8192 --layer-loop scan --steps 8 --tag _b32_8k ;;
    scale_32k)
      run 560 scale_32k python3 benchmarks/bench_scale.py --out "$OUT" --batches 1 8 \
        --contexts 32768 --layer-loop scan --steps 8 --tag _32k ;;
    scale_splits)
      run 540 scale_splits python3 benchmarks/bench_scale.py --out "$OUT" --batches 1 \
        --layer-loop scan --steps 8 --split-keys 256 512 --tag _splits ;;
    scale_long)
      # 8K prompts at batch 1: prefill utilisation and the step over a longer context
      run 330 scale_long python3 benchmarks/bench_scale.py --out "$OUT" --batches 1 \
        --contexts 8192 --layer-loop scan --steps 8 --tag _8k
      # speculative == plain greedy at a real per-layer shape, the shipped precision
      run 240 precision python3 -m pytest -q -p no:cacheprovider -rA \
        tests/drafter/test_precision.py ;;
    scale_profile)
      # kernel by kernel at 8 layers: unrolled (the GPU default) and scanned, same run
      run 170 profile_unrolled python3 benchmarks/profile_step.py --layers 8 \
        --layer-loop unrolled --precision auto --out "$OUT"
      run 170 profile_scan python3 benchmarks/profile_step.py --layers 8 \
        --layer-loop scan --precision auto --out "$OUT"
      # the embedded pair at batch 16: the engine's calls beside the device loop, kernel by
      # kernel (engine_over_device_b16)
      run 120 profile_engine_b16 python3 benchmarks/profile_step.py --pair embedded \
        --batch 16 --context 128 --engine 8 --out "$OUT"
      ;;
    two_gpu)
      # every part a child process under its own limit (130 + 90 + 300 s)
      run 590 two_gpu python3 benchmarks/bench_two_gpu.py --out "$OUT" --parts tp hetero remote ;;
    two_gpu_e2e)
      run 590 two_gpu_e2e python3 benchmarks/bench_two_gpu.py --out "$OUT" --parts e2e ;;
    two_gpu_scale)
      run 590 two_gpu_scale python3 benchmarks/bench_two_gpu.py --out "$OUT" --parts tp --scale ;;
  esac
done
