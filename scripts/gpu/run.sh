#!/usr/bin/env bash
# On the GPU machine, from the repo root, after scripts/gpu/pack.sh here: the CUDA tests, the
# example on one GPU (NCCL) with a resume, and step_time.py against TorchRec on one GPU.
source scripts/gpu/setup.sh || exit 1
export PYTHONWARNINGS=ignore
OUT="${OUT:-/tmp/gpu-out}"; mkdir -p "$OUT"
python3 -m pytest tests/gpu -q -rfE -p no:cacheprovider --timeout=150
TR="python3 -m torch.distributed.run --standalone --nproc-per-node 1"
$TR examples/train_dlrm.py --steps 200 --checkpoint-dir /tmp/ck --no-progress
$TR examples/train_dlrm.py --steps 260 --checkpoint-dir /tmp/ck --resume --no-progress
python3 benchmarks/step_time.py --device cuda --world-size 1 --steps 40 | tee "$OUT/step_time.txt"
# Issue 29: the size that ran out of memory side by side (one contender at a time now), and
# prefetch with two ranks on the one GPU over gloo.
python3 benchmarks/step_time.py --device cuda --world-size 1 --tables 26 --rows 500000 --dim 128 \
    --batch 16384 --optimizers fused --steps 8 --blocks 1 | tee "$OUT/step_time_26x500k.txt"
python3 benchmarks/step_time.py --device cuda --world-size 2 --cuda-backend gloo --steps 20 \
    --optimizers fused | tee "$OUT/step_time_gloo2.txt"
# Issue 25: FP16 tables and FP16 comms against FP32 on the GPU: memory and step time, world 1
# (NCCL) and two ranks sharing the GPU over gloo.
python3 benchmarks/low_precision.py --device cuda --world-size 1 --rows 4000000 --dim 128 \
    --batch-size 16384 --pooling 20 | tee "$OUT/low_precision_1.txt"
python3 benchmarks/low_precision.py --device cuda --world-size 2 --cuda-backend gloo \
    --rows 1000000 --batch-size 4096 | tee "$OUT/low_precision_gloo2.txt"
