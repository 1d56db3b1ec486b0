#!/usr/bin/env bash
# The checks that need a CUDA device, as one run on a lent GPU machine (its python3 holds a CUDA torch,
# pyarrow, fsspec, pytest, hypothesis and pytest-xdist; nothing is installed): the CUDA-only tests, the
# device-copy benchmark, then the loader tests again on a machine where CUDA is present (pin_memory=None
# pins there, a path the CPU suite never takes). Logs and JSON go to $OUT (default benchmarks/out/device).
set -u -o pipefail
OUT=${OUT:-benchmarks/out/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L
python3 -c "import torch, pyarrow, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'pyarrow', pyarrow.__version__, 'numpy', numpy.__version__)"
echo "== CUDA-only tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_prefetch.py tests/test_handoff.py -k cuda 2>&1 | tee "$OUT/cuda_tests.log"
echo "== device-copy benchmark"
timeout 200 python3 benchmarks/device_copy.py --rows 32768 --seq 4096 --batch 128 --workers 4 --step-ms 10 \
    --out "$OUT/device_copy.json" 2>&1 | tee "$OUT/device_copy.log"
echo "== loader tests with CUDA present"
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_prefetch.py tests/test_handoff.py \
    tests/test_dataset.py tests/test_resume.py tests/test_sampler_loader.py tests/test_plain_dataloader.py \
    tests/test_thread_workers.py tests/test_pass_model.py 2>&1 | tail -40 | tee "$OUT/loader_tests.log"
