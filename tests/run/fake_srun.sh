#!/usr/bin/env bash
# A stand-in for Slurm's srun in keel run's drills (tests/run/check_run.py): it takes
# --ntasks=N, --exclude=NODE,... and --kill-on-bad-exit as srun does inside an allocation and
# runs the tasks under mpiexec on this machine, each told its node's name (SLURMD_NODENAME, as
# slurmd sets it): the allocation's nodes FAKE_SLURM_NODES, in order, without the excluded ones,
# FAKE_SLURM_TASKS_PER_NODE (1) tasks per node. Each call's options go to FAKE_SLURM_LOG.
set -euo pipefail
ntasks=1
exclude=""
while [ $# -gt 0 ]; do
  case "$1" in
    --ntasks=*) ntasks=${1#--ntasks=} ;;
    --exclude=*) exclude=${1#--exclude=} ;;
    --kill-on-bad-exit=*) ;;
    -*) echo "fake srun: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
  shift
done
echo "ntasks=$ntasks exclude=$exclude" >>"${FAKE_SLURM_LOG:-/dev/null}"
left=""
for n in ${FAKE_SLURM_NODES:?}; do
  case ",$exclude," in *",$n,"*) ;; *) left="$left $n" ;; esac
done
per=${FAKE_SLURM_TASKS_PER_NODE:-1}
count=$(echo $left | wc -w)
if [ "$ntasks" -gt $((count * per)) ]; then
  echo "srun: error: $ntasks tasks do not fit the $count node(s) left ($per per node)" >&2
  exit 1
fi
export FAKE_SLURM_LEFT="$left" FAKE_SLURM_PER="$per"
exec mpiexec -n "$ntasks" --oversubscribe --bind-to none -x FAKE_SLURM_LEFT -x FAKE_SLURM_PER bash -c '
  i=$((OMPI_COMM_WORLD_RANK / FAKE_SLURM_PER)); k=0
  for n in $FAKE_SLURM_LEFT; do
    if [ "$k" -eq "$i" ]; then export SLURMD_NODENAME=$n; fi
    k=$((k + 1))
  done
  exec "$@"' fake_srun_task "$@"
