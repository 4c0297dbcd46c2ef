#!/usr/bin/env bash
# Every GPU check in one command, for a session that is lent a device (docs/benchmarks.md, "On CUDA"):
#     run(command="bash scripts/device_check.sh", timeout_s=560)
# Uses the device machine's own python3 (PyTorch with CUDA) and imports this working tree. Each check has
# its own time limit so that one slow check leaves the others their turn; outputs also go to $OUT.
set -uo pipefail
out="${OUT:-/tmp/device_check}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())" 2>&1 | tee "$out/device.txt"
timeout 200 python3 scripts/cuda_check.py 2>&1 | tee "$out/cuda_check.md"
timeout 100 python3 scripts/executor_overhead.py --device cuda --rounds 10 2>&1 | tee "$out/executor_overhead_cuda.md"
timeout 220 python3 scripts/bptt_gruslys.py --device cuda --steps 1000 --batch 512 --hidden 2048 --input 512 \
    --memory 0.05 2>&1 | tee "$out/gruslys_cuda.md"
