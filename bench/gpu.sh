#!/usr/bin/env bash
# The GPU checks in one command (bench/device.py: the ensemble's members per second at N = 1, 8, 64,
# 256, the default shape's tracker overhead, an ensemble's cost with the tracker, bench.cuda), for a
# machine with a CUDA GPU, torch and Lightning but not the project's other dependencies and no network.
#
#   OUT=DIR bash bench/gpu.sh [bench.device options]        # from the repository root, ~6.5 min
#
# The wheels in .whl/ (ignored by git; bash bench/gpu_wheels.sh fetches them) are installed into
# /tmp/site first, without their dependencies, and put first on PYTHONPATH (unzipped as they are where
# pip fails). PYTHON picks the interpreter (default python3); SKIP_WHEELS=1 leaves the wheels alone.
set -u
PYTHON=${PYTHON:-python3}
if [ -z "${SKIP_WHEELS:-}" ] && compgen -G ".whl/*.whl" >/dev/null; then
  start=$SECONDS
  PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 $PYTHON -m pip install -q --no-index --no-deps \
    --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl ||
    $PYTHON -c 'import glob, zipfile; [zipfile.ZipFile(w).extractall("/tmp/site") for w in glob.glob(".whl/*.whl")]'
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  $PYTHON -c 'import hydra, omegaconf, ruptures; print("wheels: hydra", hydra.__version__, "omegaconf", omegaconf.__version__, "ruptures", ruptures.__version__)'
  echo "wheels installed into /tmp/site in $((SECONDS - start)) s"
fi
export WANDB_MODE=offline WANDB_SILENT=true MPLBACKEND=Agg PYTHONUNBUFFERED=1
exec $PYTHON -m bench.device --out "${OUT:-bench/results/device}" "$@"
