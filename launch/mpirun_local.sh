#!/usr/bin/env bash
# One node, N ranks sharing one ESSA population (one rank per GPU; on CPU the cores are split).
#
#   launch/mpirun_local.sh 2 configs/demo.yaml --run-dir runs/essa-demo-2ranks
#
# runs exactly:
#
#   mpiexec -n 2 essa train configs/demo.yaml --run-dir runs/essa-demo-2ranks
#
# with the mpiexec of the active environment (`pip install 'essa-align[mpi]'` puts MPICH's next to
# python). Open MPI as root also needs: MPIEXEC_FLAGS="--allow-run-as-root --oversubscribe".
# Everything after N is passed to `essa train` unchanged (--set k=v, --resume DIR, --overwrite).
set -euo pipefail

if [[ $# -lt 1 || ! $1 =~ ^[0-9]+$ ]]; then
    echo "usage: $0 N [CONFIG] [essa train options...]" >&2
    exit 2
fi
ranks=$1
shift

# numpy's BLAS runs the CMA-ES eigendecomposition on every rank: one thread each, or the ranks
# of a node fight over its cores. Torch threads are split per rank by essa (docs/scaling.md).
export OPENBLAS_NUM_THREADS="${OPENBLAS_NUM_THREADS:-1}"
export TOKENIZERS_PARALLELISM=false

mpiexec="${MPIEXEC:-$(command -v mpiexec || true)}"
if [[ -z $mpiexec ]]; then
    echo "error: no mpiexec on PATH: pip install 'essa-align[mpi]' (or load your site MPI)" >&2
    exit 2
fi
# shellcheck disable=SC2086  # MPIEXEC_FLAGS is a list of flags
exec "$mpiexec" ${MPIEXEC_FLAGS:-} -n "$ranks" essa train "$@"
