#!/usr/bin/env bash
# Packs the GPU stack for a machine that has torch 2.11 (CUDA 13) but no network, as the lent
# H100 does: fbgemm-gpu 1.6.0 (the release built for torch 2.11) with only sm_90 cubins, and the
# pure-Python torchrec 1.6.1 (torchrec 1.8 imports fbgemm modules 1.6 lacks) and its deps.
# Writes .gpu/pkg.tar.xz (~59 MiB; .gpu/ is git-ignored). See docs/gpu.md.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
KEEP="${KEEP_ARCH:-90}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform any -d "$work/w" "$@"
}
dl fbgemm-gpu==1.6.0
dl torchrec==1.6.1 tensordict==0.15.3 pyvers==0.2.3 torchmetrics==1.0.3 pyre-extensions==0.0.32
mkdir -p "$work/site" && (cd "$work/site" && unzip -q "$work"/w/fbgemm_gpu-*.whl)
# Inference, VBE and global-weight-decay kernels are never used here: 345 MiB of cubins less.
for lib in tbe_inference tbe_training_backward_gwd tbe_training_backward_vbe; do
  rm "$work/site/fbgemm_gpu/fbgemm_gpu_$lib.so"
  sed -i "/\"fbgemm_gpu_$lib\",/d" "$work/site/fbgemm_gpu/__init__.py"
done
python3 "$ROOT/scripts/gpu/strip_fatbin.py" --keep "$KEEP" "$work"/site/fbgemm_gpu/*.so
cp "$work"/w/*.whl "$work/site/" && rm "$work"/site/fbgemm_gpu-*.whl
mkdir -p "$ROOT/.gpu"
tar -C "$work/site" -cf - . | xz -T0 -6 > "$ROOT/.gpu/pkg.tar.xz"
ls -la "$ROOT/.gpu/pkg.tar.xz"
