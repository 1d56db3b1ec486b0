#!/usr/bin/env bash
# The checks that need a CUDA device, as one run on a lent GPU machine (its python3 holds a CUDA torch,
# pyarrow, fsspec, pytest, hypothesis and pytest-xdist; nothing is installed): the CUDA-only tests, the
# device-copy benchmark, then the loader tests again on a machine where CUDA is present (pin_memory=None
# pins there, a path the CPU suite never takes). Logs and JSON go to $OUT (default benchmarks/out/device).
set -u -o pipefail
OUT=${OUT:-benchmarks/out/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels carried along (torchdata, for the StatefulDataLoader tests)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=$PWD:/tmp/site
fi
nvidia-smi -L
python3 -c "import torch, pyarrow, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'pyarrow', pyarrow.__version__, 'numpy', numpy.__version__)"
if [ "${1:-}" != "bench" ]; then
echo "== CUDA-only tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider -rs tests/test_prefetch.py tests/test_handoff.py -k cuda 2>&1 | tee "$OUT/cuda_tests.log"
fi
echo "== device-copy benchmark"
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
for ms in ${STEPS_MS:-10 3}; do  # a step the loader outpaces, and one about as long as its delivery
    timeout 150 python3 benchmarks/device_copy.py --rows 32768 --seq 4096 --batch 128 --workers 4 --step-ms $ms \
        --out "$OUT/device_copy_${ms}ms.json" 2>&1 | tee "$OUT/device_copy_${ms}ms.log"
done
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv
timeout 60 python3 benchmarks/h2d_probe.py --out "$OUT/h2d_probe.json" 2>&1 | tee "$OUT/h2d_probe.log"
[ "${1:-}" = "bench" ] && exit 0
echo "== loader tests with CUDA present"
timeout 200 python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_prefetch.py tests/test_handoff.py \
    tests/test_dataset.py tests/test_resume.py tests/test_sampler_loader.py tests/test_plain_dataloader.py \
    tests/test_thread_workers.py tests/test_pass_model.py -k "not over_s3" 2>&1 | tee "$OUT/loader_tests.log" | tail -25
