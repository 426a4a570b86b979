#!/usr/bin/env bash
# Make `snakemake --profile slurm` find profiles/slurm from anywhere: Snakemake looks for
# `slurm/` in the current directory, then in its user config directory
# (${XDG_CONFIG_HOME:-~/.config}/snakemake/). Links that to this checkout's profile if
# nothing is there yet; an existing profile of that name is left alone, with a note.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd -P)
profile=$root/profiles/slurm
dir=${XDG_CONFIG_HOME:-$HOME/.config}/snakemake
link=$dir/slurm

if [[ -L $link && $(readlink -f "$link") == "$profile" ]]; then
    exit 0
elif [[ -e $link || -L $link ]]; then
    echo "envs/link-slurm-profile.sh: $link exists and is not $profile; left as it is (snakemake --profile slurm uses it)"
else
    mkdir -p "$dir"
    ln -s "$profile" "$link"
    echo "envs/link-slurm-profile.sh: linked $link -> $profile (snakemake --profile slurm)"
fi
