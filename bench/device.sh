#!/usr/bin/env bash
# The evidence of bench/results/<machine>/, made on the GPU machine from a clean tree (bench/README.md):
#
#   bash bench/device.sh STEP[+STEP...] [STEP ...] --out DIR [--base REV|DIR] [runner options]
#
# Sets up what the machine lacks, then runs the runner, `python3 -m adaln_lab.bench` (its --help lists the steps
# and options), with every argument as given. Wheels in .whl/ (diffusers is not on the machine) go to /tmp/site
# first, unless PYTHONPATH has it already; the checkout's src/ goes on PYTHONPATH so its adaln_lab is the one run.
set -u
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root" || exit 2
if ls .whl/*.whl > /dev/null 2>&1; then
  case ":${PYTHONPATH:-}:" in
    *:/tmp/site:*) ;;
    *) PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
         --upgrade --target /tmp/site .whl/*.whl || echo "wheels from .whl/ failed to install"
       export PYTHONPATH=/tmp/site:$root/src${PYTHONPATH:+:$PYTHONPATH} ;;
  esac
fi
case ":${PYTHONPATH:-}:" in *":$root/src:"*) ;; *) export PYTHONPATH=$root/src${PYTHONPATH:+:$PYTHONPATH} ;; esac
export PYTHONUNBUFFERED=1
exec python3 -m adaln_lab.bench "$@"
