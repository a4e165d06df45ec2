#!/usr/bin/env bash
# Downloads the Python packages the GPU machine's image lacks, as wheels for its Python (3.12,
# manylinux x86_64), into .whl/ of this checkout (.gitignore lists it); `runners/carry.sh` copies
# them into .carry/whl/ and `device_run.sh` installs them there (mixers, mixers_grid).
#   fla-core 0.6.0: flash-linear-attention's kernels (`sequence_mixers --compare fla`); its
#   other need, einops, is on the image.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl fla-core==0.6.0
ls -la .whl
