#!/usr/bin/env bash
# One prepared GPU check (docs/PERFORMANCE.md, "GPU check"): on a single-GPU machine whose python3 has torch >= 2.11,
# lightning and transformers, in at most 8 minutes: the four benchmark cases (13B pretrain and 7B finetune at 224 and
# 336 px), Qwen3.5's linear attention (neva's delta rule vs flash-linear-attention's kernel, when installed: errors and
# forward + backward times; scripts/bench/linear_attention.py) and a 50-step `neva.train` finetune of a ~1B model on
# synthetic images through the real loader. Prints one JSON line per case (scripts/bench/check.py); exits 1 if any case
# has no numbers. For the kernel: `python3 -m pip download fla-core --no-deps -d shared/wheels` (pure Python, Triton).
#
#   scripts/gpu_check.sh                      # from the checkout, on the GPU machine
#   NEVA_GPU_CHECK_TINY=1 scripts/gpu_check.sh   # CPU, tiny shapes: what tests/test_gpu_check.py runs
#
# Packages the GPU image lacks (hydra-core, omegaconf, antlr4-python3-runtime, webdataset, braceexpand) come as
# wheels from $NEVA_WHEELS (default: shared/wheels in the checkout), installed with --no-deps into a temporary
# directory put on PYTHONPATH; nothing is installed when python3 already imports them. Fetch the wheels on a machine
# with network access, inside the checkout (all pure Python, so any platform's pip fetches the right ones; hydra 1.3
# needs antlr4 4.9, which PyPI has as an sdist only, hence `pip wheel`):
#
#   python3 -m pip download hydra-core==1.3.2 omegaconf==2.3.0 webdataset braceexpand --no-deps -d shared/wheels
#   python3 -m pip wheel antlr4-python3-runtime==4.9.3 --no-deps -w shared/wheels
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BUDGET_S=${NEVA_GPU_CHECK_BUDGET_S:-480}

if ! "$PYTHON" -c "import hydra, omegaconf, webdataset" 2>/dev/null; then
    WHEELS=${NEVA_WHEELS:-shared/wheels}
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        echo "gpu_check: $PYTHON lacks hydra-core/omegaconf/webdataset and $WHEELS holds no wheels; fetch them with:" >&2
        echo "  python3 -m pip download hydra-core==1.3.2 omegaconf==2.3.0 webdataset braceexpand --no-deps -d $WHEELS" >&2
        echo "  python3 -m pip wheel antlr4-python3-runtime==4.9.3 --no-deps -w $WHEELS" >&2
        exit 2
    fi
    SITE=$(mktemp -d)/site
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

ARGS=(--budget-s "$BUDGET_S")
if [[ "${NEVA_GPU_CHECK_TINY:-0}" == "1" ]]; then
    ARGS+=(--tiny)
fi
# The check keeps to its budget by itself; the outer limit only catches a hang in its own start-up.
exec timeout $((BUDGET_S + 60)) "$PYTHON" scripts/bench/check.py "${ARGS[@]}" "$@"
