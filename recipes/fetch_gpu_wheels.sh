#!/usr/bin/env bash
# Recreates .whl/ (git-ignored): the wheels the GPU box lacks and cannot download (it has no
# network), for its Python 3.12. Run here, on a machine with PyPI access, before a device run
# that carries .whl (recipes/deepspeed/gpu_bench.sh, recipes/megatron/gpu.sh, .ci/gpu-box.sh ucx).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
# DeepSpeed is an sdist; built without its CUDA ops it is a pure-Python wheel.
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation "deepspeed==0.19.8" -w .whl
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux2010_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d .whl \
  "megatron-core==0.19.2" hjson ninja py-cpuinfo pydantic pydantic-core annotated-types \
  typing-inspection typing-extensions msgpack psutil einops packaging tqdm
# UCX for the bridge's ucx transport (.ci/gpu-box.sh ucx); the version pyproject's [ucx] extra
# and .ci/setup pin (the one measured in docs/benchmarks.md). 43 MB: .whl stays under the device
# tool's 64 MiB working-tree limit together with the wheels above.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d .whl "libucx-cu13==1.22.0"
du -sh .whl
