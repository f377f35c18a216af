#!/usr/bin/env bash
# The device checks of issue 23, in one go on a machine with a CUDA GPU; prints one JSON object.
#
#   scripts/gpu_check.sh [OUT]         (OUT: a folder for the pieces, default ./gpu-check)
#
# 1. `bench device-codec`: int8 encode/decode GB/s on the GPU beside a device-to-host copy.
# 2. `bench pipeline` on the "small" preset (85.6M parameters), fp32: one-process training on
#    the GPU beside a 3-stage testnet whose 3 nodes share that GPU (lossless and int8).
# 3. The CUDA-only tests: the lossless 3-stage GPU pipeline equals one-process GPU training
#    to 1e-4 over 10 steps, state moving between GPU and CPU stages, codecs on the GPU.
# Needs the project's dependencies installed for $PYTHON (default python3). About 3 to 4
# minutes on an H100; each piece has its own time limit, so the whole stays under 8.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
out="$(mkdir -p "${1:-gpu-check}" && cd "${1:-gpu-check}" && pwd)"
python="${PYTHON:-python3}"
cd "$root"

# The repository root is the package: make `import swarmpipe` find it without installing.
if ! "$python" -c "import swarmpipe" 2>/dev/null; then
    link="$(mktemp -d)"
    ln -s "$root" "$link/swarmpipe"
    export PYTHONPATH="$link${PYTHONPATH:+:$PYTHONPATH}"
fi
"$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU: nothing to check')"
export PYTHONUNBUFFERED=1

echo "1/3 codec on the GPU" >&2
timeout 120 "$python" -m swarmpipe bench device-codec --device cuda >"$out/device_codec.json"

echo "2/3 small preset: one process beside a 3-stage testnet on one GPU" >&2
timeout 300 "$python" -m swarmpipe bench pipeline --codecs lossless,int8 --steps 10 \
    --set model.preset=small --set pipeline.stages=3 --set train.device=cuda \
    --set train.precision=fp32 --out "$out/pipeline_small.json" >/dev/null

echo "3/3 CUDA-only tests" >&2
set +e
timeout 240 "$python" -m pytest -q -p no:cacheprovider \
    "tests/integration/test_training.py::test_lossless_gpu_pipeline_matches_single_process_gpu" \
    tests/node/test_device.py tests/compression/test_codecs.py -k "gpu or cuda or state_moves" \
    >"$out/tests.txt" 2>&1
tests_rc=$?
set -e

"$python" - "$out" "$tests_rc" <<'EOF'
import json, sys
from pathlib import Path

import torch

out, rc = Path(sys.argv[1]), int(sys.argv[2])
pipeline = json.loads((out / "pipeline_small.json").read_text())
print(json.dumps({
    "gpu": torch.cuda.get_device_name(0),
    "device_codec": json.loads((out / "device_codec.json").read_text()),
    "small_preset": {
        "single_process": pipeline["single_process"],
        "testnet": pipeline["testnet"],
        "testnet_over_single_process": pipeline["testnet_over_single_process"],
    },
    "cuda_tests": {"exit_code": rc, "summary": (out / "tests.txt").read_text().splitlines()[-1:]},
}, indent=2))
EOF
exit "$tests_rc"
