#!/usr/bin/env bash
# Every GPU measurement the open issues still wait for, in priority order, for one GPU session
# (an H100 or H200 through the device tool). Each step writes under $OUT (default ./gpu-results)
# and a failing step is logged and skipped, so one broken kernel does not cost the rest.
#   bash benchmarks/gpu_session.sh tests        # correctness first: the GPU legs of the suite
#   bash benchmarks/gpu_session.sh bench        # the peers and the defaults, every family
#   bash benchmarks/gpu_session.sh tune         # the suite's tuning runs, then bench again
#   bash benchmarks/gpu_session.sh prefill      # both prefill schedules, ablation, bench, a profile
#   bash benchmarks/gpu_session.sh launch       # host cost per call, decode defaults, decode bench
#   bash benchmarks/gpu_session.sh backward     # backward tests, the knob sweep, bench with Flex
#   bash benchmarks/gpu_session.sh fp8          # FP8 tests, the sweep, bench fp8 in short runs, accuracy
#   bash benchmarks/gpu_session.sh multigpu     # on 2+ GPUs: tune --gpus all against --gpus 1, bench prefill/decode
#   bash benchmarks/gpu_session.sh fair         # issue 27: the eager comparisons again, peers timed as tunegen is
#   bash benchmarks/gpu_session.sh release      # issue 28: bench prefill D=128, this checkout against the one in .old
#   TRITON_SITE=/tmp/t39 bash benchmarks/gpu_session.sh other_tests other_bench
#                                               # issue 28: the GPU legs on a Triton carried in, bench against the installed
set -uo pipefail
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
REPO=$(cd "$(dirname "$0")/.." && pwd)

step() {  # step NAME COMMAND...: run, log, keep going
    local name=$1
    shift
    echo "=== $name: $*"
    if "$@" >"$OUT/$name.log" 2>&1; then echo "ok"; else echo "FAILED (see $OUT/$name.log)"; fi
    tail -n 25 "$OUT/$name.log"
}

copy_tests() {  # the tests run from a copy: inside the checkout, tunegen resolves to the source folder
    rm -rf /tmp/tunegen-tests && cp -r "$REPO/tests" /tmp/tunegen-tests && cp "$REPO/pyproject.toml" /tmp/
}

tests() {
    copy_tests
    step gpu-tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider /tmp/tunegen-tests
    step aot-demo python3 "$REPO/tests/export/aot_demo/run.py" --work /tmp/aot_demo
}

bench() {
    step ceilings tunegen bench ceilings -o "$OUT/ceilings.json"
    step dispatch-overhead python3 "$REPO/benchmarks/dispatch_overhead.py"
    step bench-decode tunegen bench decode -o "$OUT/decode.csv"
    step bench-fp8 tunegen bench fp8 -o "$OUT/fp8.json"
    step fp8-accuracy python3 "$REPO/benchmarks/fp8_accuracy.py" -o "$OUT/fp8_accuracy.json"
    step bench-backward tunegen bench backward -o "$OUT/backward.csv"
    step bench-prefill tunegen bench prefill --impl tunegen,tunegen-default,sdpa-flash,sdpa-cudnn,flex \
        -o "$OUT/prefill.csv"
    step report tunegen report "$OUT"/prefill.csv "$OUT"/decode.csv "$OUT"/backward.csv "$OUT"/fp8.json \
        --ceilings "$OUT/ceilings.json" -o "$OUT/report"
}

prefill() {  # what benchmarks/results/prefill_ws_h100.md was measured with (issue 13)
    copy_tests
    step prefill-tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider /tmp/tunegen-tests/kernels/test_prefill_ws.py
    step prefill-sweep python3 "$REPO/benchmarks/prefill_defaults.py" --seqlens 512,1024,2048,4096,8192,16384 \
        --head-dims 64,128 --schedules ws -o "$OUT/prefill_sweep.json"
    step prefill-ablation python3 "$REPO/benchmarks/prefill_ablation.py" --head-dim 128 --seqlens 4096,16384 \
        -o "$OUT/prefill_ablation.json"
    step prefill-bench tunegen bench prefill --head-dims 64,128 \
        --impl tunegen,tunegen-default,sdpa-flash,sdpa-cudnn,flex -o "$OUT/prefill_ws.csv"
    step prefill-ncu ncu --kernel-name attn_fwd --launch-skip 3 --launch-count 1 --section SpeedOfLight \
        --section WarpStateStats python3 "$REPO/benchmarks/profile_prefill.py" --head-dim 128 --seqlen 1024 --causal
}

launch() {  # what benchmarks/results/launch_h100.md was measured with (issue 14)
    copy_tests
    step launch-tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider /tmp/tunegen-tests/kernels/test_launcher.py \
        /tmp/tunegen-tests/kernels/test_decode.py /tmp/tunegen-tests/public/test_gpu_graphs.py
    step dispatch-overhead python3 "$REPO/benchmarks/dispatch_overhead.py" -o "$OUT/launch.json"
    step decode-sweep python3 "$REPO/benchmarks/decode_defaults.py" -o "$OUT/decode_defaults.json"
    step bench-decode tunegen bench decode -o "$OUT/decode.csv"
}

backward() {  # what benchmarks/results/backward_h100.md was measured with (issue 15)
    copy_tests
    step backward-tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider /tmp/tunegen-tests/kernels/test_backward_kernels.py \
        /tmp/tunegen-tests/public/test_gradients.py \
        /tmp/tunegen-tests/kernels/test_compile.py /tmp/tunegen-tests/kernels/test_launcher.py
    step backward-sweep-d128 python3 "$REPO/benchmarks/backward_defaults.py" --head-dims 128 \
        --seqlens 1024,4096,16384 -o "$OUT/backward_defaults_d128.json"
    step backward-sweep-d64-d256 python3 "$REPO/benchmarks/backward_defaults.py" --head-dims 64,256 \
        --seqlens 1024,4096,16384 -o "$OUT/backward_defaults_d64_d256.json"
    step bench-backward tunegen bench backward --seqlens 1024,2048,4096,8192,16384 -o "$OUT/backward.csv"
}

fp8() {  # what benchmarks/results/fp8_h100.md was measured with (issue 16), and what it still lacks
    copy_tests
    step fp8-tests python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider /tmp/tunegen-tests/kernels/test_fp8_quantize.py \
        /tmp/tunegen-tests/kernels/test_fp8.py /tmp/tunegen-tests/kernels/test_prefill_ws.py /tmp/tunegen-tests/kernels/test_decode_fp8.py
    (cd "$REPO/benchmarks" && step fp8-sweep-noncausal python3 fp8_defaults.py --seqlens 16384,2048 --causal false \
        -o "$OUT/fp8_defaults_noncausal.json")
    (cd "$REPO/benchmarks" && step fp8-sweep-causal python3 fp8_defaults.py --seqlens 4096,16384 --causal true \
        -o "$OUT/fp8_defaults_causal.json")
    # bench fp8 writes its JSON at the end: one length per run keeps each run inside a 600 s call.
    for n in 2048 4096 8192 16384; do
        PYTHONWARNINGS=ignore step "bench-fp8-$n" tunegen bench fp8 --seqlens $n --batches 64 --cache-lengths 32768 \
            --page-sizes 0 -o "$OUT/fp8_bench_n$n.json"
    done
    step fp8-accuracy python3 "$REPO/benchmarks/fp8_accuracy.py" --seeds 3 -o "$OUT/fp8_accuracy_h100.json"
}

multigpu() {  # issue 18, on a host with two or more GPUs of one model (an H200 pair)
    (cd "$REPO/benchmarks" && step multi-gpu python3 multi_gpu.py --preset llama3-8b --runs 1,all \
        -o "$OUT/multi_gpu")
    # D=64 and 128 were measured on one H200 (results/bench_prefill_h200_d64_d128.*); these remain.
    step bench-prefill tunegen bench prefill --head-dims 256 -o "$OUT/bench_prefill_h200_d256.csv"
    step bench-decode tunegen bench decode -o "$OUT/decode_bench_h200.csv"
}

fair() {  # issue 27, on one H100 in under 8 minutes: every claim made from an eager comparison with
    # SDPA peers, measured again now that a peer's backend is chosen once around its timing rather
    # than by each call (see benchmarks/fair_summary.py, which writes $OUT/fair.md and prints it)
    step fair-launch python3 "$REPO/benchmarks/dispatch_overhead.py" -o "$OUT/fair_launch.json"
    step fair-decode tunegen bench decode --page-sizes 0 -o "$OUT/fair_decode.csv"
    step fair-prefill tunegen bench prefill --seqlens 512,1024 --head-dims 64,128 \
        --impl tunegen,sdpa-cudnn,sdpa-flash -o "$OUT/fair_prefill.csv"
    python3 "$REPO/benchmarks/fair_summary.py" "$OUT"
}

release() {  # issue 28: after a change for other Triton releases, the D=128 prefill of this release
    # against the checkout in $REPO/.old (`git archive <commit> | tar -x -C .old`), alternated
    # twice, each run from its own source tree
    local round tree
    for round in 1 2; do
        for tree in old new; do
            local src=$REPO
            [ "$tree" = old ] && src=$REPO/.old
            step "prefill-$tree$round" env PYTHONPATH="$src:${PYTHONPATH:-}" python3 -m tunegen.cli.main bench prefill \
                --head-dims 128 --impl tunegen -o "$OUT/prefill_d128_$tree$round.csv"
        done
    done
}

other_tests() {  # issue 28: the GPU legs on another Triton release, unpacked at $TRITON_SITE (the
    # machines have only the one their torch pins), put before everything else on PYTHONPATH
    copy_tests
    step other-version env PYTHONPATH="$TRITON_SITE:${PYTHONPATH:-}" python3 -c \
        "import torch, triton; print(torch.__version__, triton.__version__, triton.__file__)"
    step other-gpu-tests env PYTHONPATH="$TRITON_SITE:${PYTHONPATH:-}" python3 -m pytest -q -m gpu -n 8 \
        -p no:cacheprovider /tmp/tunegen-tests
}

other_bench() {  # issue 28: bench prefill D=128 on the installed Triton, then on the one at $TRITON_SITE
    local round=${ROUND:-1}
    step "prefill-installed$round" tunegen bench prefill --head-dims 128 --impl tunegen \
        -o "$OUT/prefill_d128_installed$round.csv"
    step "prefill-other$round" env PYTHONPATH="$TRITON_SITE:${PYTHONPATH:-}" tunegen bench prefill \
        --head-dims 128 --impl tunegen -o "$OUT/prefill_d128_other$round.csv"
}

tune() {
    export TUNEGEN_DB="sqlite:///$OUT/tuned.db"
    local lengths=512,1024,2048,4096,8192,16384
    step tune-d128 tunegen tune --shape 16,16,128 --seqlens $lengths --causal both --trials 30
    step tune-d64 tunegen tune --shape 32,32,64 --seqlens $lengths --causal both --trials 30
    step tune-d256 tunegen tune --shape 8,8,256 --seqlens $lengths --causal both --trials 30
    step tune-decode tunegen tune --family decode --preset llama3-8b --batches 1,16,64 --seqlens 4096,32768 \
        --trials 20
    step tune-fp8 tunegen tune --shape 16,16,128 --causal both --seqlens 1024,4096,16384 --fp8 --trials 20
    step tune-backward tunegen tune --family backward --shape 16,16,128 --seqlens $lengths --causal both \
        --trials 30 --trial-timeout 300
    step export-winners tunegen export --format json -o "$OUT/winners"
    step bench-tuned tunegen bench all -o "$OUT/tuned"
}

for part in "${@:-tests}"; do "$part"; done
