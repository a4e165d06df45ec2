#!/usr/bin/env bash
# Downloads the Python packages the GPU machine's image lacks, as wheels for its Python (3.12,
# manylinux x86_64), into .whl/ of this checkout (.gitignore lists it); `runners/carry.sh` copies
# them into .carry/whl/ and `device_run.sh` installs them there (mixers, mixers_grid).
#   fla-core 0.6.0: flash-linear-attention's kernels (`sequence_mixers --compare fla`); its
#   other need, einops, is on the image.
#   mamba_ssm 2.3.2.post1: PyPI has only its source distribution, whose build compiles CUDA
#   extensions; runners/mamba_wheel.py packs its Python sources and Triton kernels into a wheel
#   (`sequence_mixers --compare mamba`: the Triton SSD; the CUDA selective scan stays
#   unsupported without the extension). packaging, which it imports, travels too.
#   ott-jax 0.6.0 (`kernel_sums --compare ott`: its Sinkhorn solver) with what it needs beyond
#   the image's jax, flax and optax: jaxopt, lineax, equinox, jaxtyping, wadler-lindig (all pure
#   Python).
#   geomloss 0.3.1 (`kernel_sums --compare geomloss`: its Sinkhorn soft-min; pure Python on the
#   image's torch and scipy), and for its online backend KeOps: pykeops and keopscore 2.3, which
#   PyPI has as source distributions only (pure Python: `pip wheel` packs them here), and
#   pybind11, which pykeops imports.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl fla-core==0.6.0 packaging==25.0 \
  ott-jax==0.6.0 jaxopt==0.8.5 lineax==0.1.1 equinox==0.13.8 jaxtyping==0.3.11 \
  wadler-lindig==0.1.8 geomloss==0.3.1 pybind11==3.0.1
sdist=$(mktemp -d)
trap 'rm -rf "$sdist"' EXIT
python3 -m pip download -q --no-deps --no-binary=:all: -d "$sdist" pykeops==2.3 keopscore==2.3
python3 -m pip wheel -q --no-deps -w .whl "$sdist"/pykeops-2.3.tar.gz "$sdist"/keopscore-2.3.tar.gz
# The source distribution itself (pip download would run its setup.py, which needs torch).
curl -sSfL -o "$sdist/mamba_ssm-2.3.2.post1.tar.gz" \
  https://files.pythonhosted.org/packages/af/48/aa7bec0efc7453fa0512276c0069c854bf684219050294266534bfef34bb/mamba_ssm-2.3.2.post1.tar.gz
python3 runners/mamba_wheel.py "$sdist"/mamba_ssm-2.3.2.post1.tar.gz .whl
ls -la .whl
