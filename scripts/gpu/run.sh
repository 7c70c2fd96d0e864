#!/usr/bin/env bash
# On the GPU machine, from the repo root, after scripts/gpu/pack.sh here (carry .gpu/):
#
#   bash scripts/gpu/run.sh            # everything below, in this order (estimated ~35 min)
#   bash scripts/gpu/run.sh fp16       # one part: tests | example | speed | fp16 | reshard | tiered | tiered_bench
#                                      # | calibrate | mc (several: a list)
#
# A lent device gives a session ~15 minutes in all and 10 per command, so run the part an issue
# needs, one command per part. Figures go to $OUT (default /tmp/gpu-out), which the device tool
# brings back.
#   tests    the CUDA tests (tests/gpu), ~5-6 min (test_cuda_reshard.py's ~1 min an estimate)
#   example  the README example on one GPU (NCCL) for 200 steps, then resumed to 260, ~2 min
#   speed    issue 29: step_time.py against TorchRec at world 1, at the 26 x 500k size that ran
#            out of memory side by side (one contender at a time now), and two ranks sharing
#            the GPU over gloo (prefetch on a side stream), ~6-8 min
#   fp16     issue 25: the FP16/BF16 CUDA tests, then low_precision.py (FP16 tables and comms
#            against FP32: memory and step time) at world 1 and two ranks over gloo, ~5-7 min
#   reshard  issue 39: whether reshard's host staging can be turned on (docs/gpu.md, "Reshard's
#            host staging"): tests/gpu/test_cuda_reshard.py (staging forced on: parity through a
#            chain of plans, a held state_dict, a failure before the commit, the device's peak
#            growth against the bound), then reshard.py with two ranks sharing the GPU over gloo,
#            4 x 1M x 64 FP32, dense and fused, one and all tables moved, staging on and off side
#            by side (peak allocated growth against the bound, time to host against the
#            all-to-alls), ~4 min (an estimate: never run)
#   tiered   issue 47: tiered tables with a GPU cache over pinned host memory (MODULAR_CUDA_TIERS=1
#            turns the path on): tests/gpu/test_cuda_tiered.py (parity with the same tables
#            resident on the GPU, worlds 1 and 2, prefetched steps missing nothing), ~2 min (an
#            estimate: never run); then docs/tiered_tables.md says whether to turn it on
#   tiered_bench  issue 47: benchmarks/tiered_cuda.py, world 1: a DLRM of 8 x 8,388,608 x 128 FP32
#            tables (32 GiB in host memory) with caches of 5% in HBM, modular tiered (prefetch)
#            against TorchRec's FUSED_UVM_CACHING and the same tables resident in HBM; again
#            without prefetch if the tiered contender did not run; ~4 min (an estimate: never run)
#   calibrate issue 51: `python -m planners calibrate --device cuda --quick` at world 1 over NCCL
#            and at world 2 over gloo, the two ranks sharing the GPU (NCCL refuses two ranks on
#            one GPU), each writing $OUT/calibrate_*.json; then tables_ranking.yaml planned at
#            world 2 with the H100 defaults and with the measured file, shown and compared under
#            both, ~3-4 min (an estimate: never run; docs/gpu.md, "Calibrating on CUDA")
#   mc       issue 46: managed-collision tables on CUDA ranks (split collision state on the host,
#            its collectives on NCCL at world 1 and through gloo with two ranks sharing the GPU):
#            tests/gpu/test_cuda_mc.py, MC-EBC/MC-EC against torchrec's unsharded module on the
#            GPU, ~1-2 min (an estimate: never run)
source scripts/gpu/setup.sh || exit 1
export PYTHONWARNINGS=ignore
OUT="${OUT:-/tmp/gpu-out}"; mkdir -p "$OUT"
TR="python3 -m torch.distributed.run --standalone --nproc-per-node 1"

tests() {
    python3 -m pytest tests/gpu -q -rfE -p no:cacheprovider --timeout=150 | tee "$OUT/tests_gpu.txt"
    RAN_TESTS=1
}

example() {
    $TR examples/train_dlrm.py --steps 200 --checkpoint-dir /tmp/ck --no-progress
    $TR examples/train_dlrm.py --steps 260 --checkpoint-dir /tmp/ck --resume --no-progress
}

speed() {
    python3 benchmarks/step_time.py --device cuda --world-size 1 --steps 40 | tee "$OUT/step_time.txt"
    python3 benchmarks/step_time.py --device cuda --world-size 1 --tables 26 --rows 500000 --dim 128 \
        --batch 16384 --optimizers fused --steps 8 --blocks 1 | tee "$OUT/step_time_26x500k.txt"
    python3 benchmarks/step_time.py --device cuda --world-size 2 --cuda-backend gloo --steps 20 \
        --optimizers fused | tee "$OUT/step_time_gloo2.txt"
}

fp16() {
    [ -n "${RAN_TESTS:-}" ] || python3 -m pytest tests/gpu/test_cuda_low_precision.py -q -rfE \
        -p no:cacheprovider --timeout=150 | tee "$OUT/tests_gpu_low_precision.txt"
    python3 benchmarks/low_precision.py --device cuda --world-size 1 --rows 4000000 --dim 128 \
        --batch-size 16384 --pooling 20 | tee "$OUT/low_precision_1.txt"
    python3 benchmarks/low_precision.py --device cuda --world-size 2 --cuda-backend gloo \
        --rows 1000000 --batch-size 4096 | tee "$OUT/low_precision_gloo2.txt"
}

reshard() {
    [ -n "${RAN_TESTS:-}" ] || python3 -m pytest tests/gpu/test_cuda_reshard.py -q -rfE \
        -p no:cacheprovider --timeout=150 | tee "$OUT/tests_gpu_reshard.txt"
    python3 benchmarks/reshard.py --device cuda --cuda-backend gloo --world-sizes 2 \
        --methods reshard --stage on off | tee "$OUT/reshard_gloo2.txt"
}

tiered() {
    MODULAR_CUDA_TIERS=1 python3 -m pytest tests/gpu/test_cuda_tiered.py -q -s -rfE -p no:cacheprovider \
        --timeout=300 | tee "$OUT/tests_gpu_tiered.txt"
}

tiered_bench() {
    local bench="python3 benchmarks/tiered_cuda.py --device cuda --world-size 1"
    timeout 400 $bench --json "$OUT/tiered_cuda.json" 2>&1 | tee "$OUT/tiered_cuda.txt"
    # No row for the tiered contender (it failed, or the run did): once more without prefetch
    # (its side-stream path has never run on a GPU either) and without TorchRec.
    if ! grep -q "^| modular tiered" "$OUT/tiered_cuda.txt"; then
        timeout 140 $bench --no-prefetch --no-torchrec --json "$OUT/tiered_cuda_no_prefetch.json" 2>&1 \
            | tee "$OUT/tiered_cuda_no_prefetch.txt"
    fi
}

# timeout sends SIGINT: the CLI's subprocess.run then kills the measuring process it started
# (SIGTERM would leave it running until calibrate's own limit); -k: SIGKILL 30 s later.
calibrate() {
    local p="python3 -m planners" t=examples/tables_ranking.yaml
    local size=(--world-size 2 --batch-size 1024 --device-memory 120GiB)
    # each under a timeout, so that a hang still leaves the next its share of a 10-minute command
    timeout -s INT -k 30 240 $p calibrate --out "$OUT/calibrate_nccl1.json" --device cuda --backend nccl --world-size 1 \
        --quick 2>&1 | tee "$OUT/calibrate_nccl1.txt"
    timeout -s INT -k 30 240 $p calibrate --out "$OUT/calibrate_gloo2.json" --device cuda --backend gloo --world-size 2 \
        --quick 2>&1 | tee "$OUT/calibrate_gloo2.txt"
    [ -s "$OUT/calibrate_gloo2.json" ] || return 1
    {
        $p plan $t "${size[@]}" -o "$OUT/plan_h100.json"
        $p plan $t "${size[@]}" --topology "$OUT/calibrate_gloo2.json" -o "$OUT/plan_calibrated.json"
        $p show "$OUT/plan_h100.json" --topology "$OUT/calibrate_gloo2.json"
        $p compare "$OUT/plan_h100.json" "$OUT/plan_calibrated.json" --topology "$OUT/calibrate_gloo2.json"
    } 2>&1 | tee "$OUT/calibrate_plans.txt"
}

mc() {
    [ -n "${RAN_TESTS:-}" ] || python3 -m pytest tests/gpu/test_cuda_mc.py -q -rfE -p no:cacheprovider \
        --timeout=300 | tee "$OUT/tests_gpu_mc.txt"
}

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests example speed fp16 reshard tiered tiered_bench calibrate mc)
for part in "${parts[@]}"; do
    case "$part" in
        tests|example|speed|fp16|reshard|tiered|tiered_bench|calibrate|mc) echo "== $part" && "$part" ;;
        *) echo "run.sh: unknown part '$part' (tests, example, speed, fp16, reshard, tiered, tiered_bench," \
                "calibrate, mc)" >&2
           exit 2 ;;
    esac
done
